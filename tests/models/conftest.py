"""Shared fixtures for the model tests: Hugging Face reference models with our weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchloom.models import Transformer, TransformerConfig

HFBuilder = Callable[[Transformer, str], nn.Module]


def _hf_rope_parameters(cfg: TransformerConfig) -> dict[str, object]:
    rope = cfg.rope
    params: dict[str, object] = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.scaling == "llama3":
        params |= {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_seq_len,
        }
    elif rope.scaling == "yarn":
        params |= {
            "rope_type": "yarn",
            "factor": rope.factor,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "original_max_position_embeddings": rope.original_max_seq_len,
            "truncate": rope.truncate,
        }
    return params


def _hf_name(name: str) -> str:
    """torchloom parameter name -> transformers *ForCausalLM name."""
    if name == "output.weight":
        return "lm_head.weight"
    for ours, theirs in (
        (".attention_norm.", ".input_layernorm."),
        (".mlp_norm.", ".post_attention_layernorm."),
        (".attention.", ".self_attn."),
    ):
        name = name.replace(ours, theirs)
    return "model." + name


@pytest.fixture
def hf_model() -> HFBuilder:
    """Build the transformers reference ('llama' or 'qwen3') holding ``model``'s weights."""

    def build(model: Transformer, family: str) -> nn.Module:
        import transformers

        cfg = model.config
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        }[family]
        hf_config = config_cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.dim,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.resolved_head_dim,
            rms_norm_eps=cfg.norm_eps,
            max_position_embeddings=cfg.max_seq_len,
            rope_parameters=_hf_rope_parameters(cfg),
            tie_word_embeddings=cfg.tie_embeddings,
            attn_implementation="eager",
        )
        reference = model_cls(hf_config).eval()
        state = {_hf_name(k): v for k, v in model.state_dict().items()}
        missing, unexpected = reference.load_state_dict(state, strict=False)
        tied = ["lm_head.weight"] if cfg.tie_embeddings else []
        assert sorted(missing) == tied and not unexpected, (missing, unexpected)
        return reference

    return build


@pytest.fixture
def randomize() -> Callable[[Transformer, int], None]:
    """Give every weight (norms included) a distinct random value, reproducibly."""

    @torch.no_grad()
    def fill(model: Transformer, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)

    return fill
