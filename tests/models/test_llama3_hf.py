"""Llama 3 <-> transformers' LlamaForCausalLM: config mapping, refusals, logits and training-step
parity of checkpoints written by ``save_pretrained``."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

import torchloom
from torchloom.config.errors import ConfigError
from torchloom.models import Decoder, TransformerConfig, get_hf_model_spec
from torchloom.models.llama3 import LLAMA3_FLAVORS, Llama3HFAdapter

ADAPTER = Llama3HFAdapter()
# A short original context, so the 8 frequencies of head_dim 16 fall in every scaling regime.
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},
}  # fmt: skip


@pytest.mark.parametrize("rope", list(ROPES))
@torch.no_grad()
def test_from_hf_logits_match_transformers(rope, hf_checkpoint, logits_parity) -> None:
    # The yarn checkpoint is sharded (transformers writes an index), the others are one file.
    shard = "40KB" if rope == "yarn" else None
    path, reference = hf_checkpoint("llama", rope_parameters=ROPES[rope], max_shard_size=shard)
    model = torchloom.from_hf(path)
    assert isinstance(model, Decoder) and not model.training
    assert model.config.rope.scaling == ("none" if rope == "default" else rope)
    tokens = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    logits_parity(f"llama GQA 4/2 rope={rope}", model(tokens), reference(tokens).logits)


def test_training_step_matches_transformers(hf_training_step) -> None:
    """Same weights and batch: our loss (as the trainer computes it) and gradients equal HF's."""
    model, reference = hf_training_step("llama", rope_parameters=ROPES["llama3"])
    for name in ("embed_tokens.weight", "layers.0.attention.q_proj.weight",
                 "layers.1.mlp.down_proj.weight", "layers.1.mlp_norm.weight", "output.weight"):  # fmt: skip
        ours, theirs = (
            model.get_parameter(name).grad,
            reference.get_parameter(ADAPTER.to_hf_name(name)).grad,
        )
        diff = (ours - theirs).abs().max().item()
        print(f"  grad {name}: max abs diff {diff:.2e} (max {theirs.abs().max().item():.2e})")
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flavor", list(LLAMA3_FLAVORS))
def test_config_round_trips_through_hf(flavor: str) -> None:
    cfg = LLAMA3_FLAVORS[flavor]
    assert ADAPTER.config_from_hf(ADAPTER.config_to_hf(cfg)) == cfg


def test_config_written_by_transformers_is_read() -> None:
    """A full transformers dump (every generic key) maps onto the flavor it describes."""
    published = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ).to_dict()  # fmt: skip
    assert get_hf_model_spec(published["model_type"]).name == "llama3"
    assert ADAPTER.config_from_hf(published) == LLAMA3_FLAVORS["1B"]
    # The transformers 4.x spelling: rope_theta at the top, rope_scaling with "type".
    legacy = {k: v for k, v in published.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}}  # fmt: skip
    assert ADAPTER.config_from_hf(legacy) == LLAMA3_FLAVORS["1B"]


REFUSED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias=True is not supported"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    "dropout": ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    "linear rope": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "'linear'"),
    "dynamic rope": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    "longrope": ({"rope_parameters": {"rope_type": "longrope"}}, "'longrope'"),
    "llama3 incomplete": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                           "original_max_position_embeddings": 8192}}, "needs low_freq_factor"),
    "rope key": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "alpha": 2}},
                 "alpha"),
    "partial rope": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "odd head_dim": ({"head_dim": 15}, "head_dim must be positive and even"),
    "no head_dim": ({"hidden_size": 66, "head_dim": None}, "not divisible by num_attention_heads"),
    "quantized": ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    "unknown": ({"logit_softcap": 30.0}, "unknown option logit_softcap=30.0"),
    "head": ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForCausalLM"),
    "size": ({"vocab_size": None}, "required field(s) vocab_size are missing"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_refused_by_name(case: str) -> None:
    change, message = REFUSED[case]
    hf = ADAPTER.config_to_hf(TransformerConfig()) | change
    with pytest.raises(ConfigError, match=re.escape(message)):
        ADAPTER.config_from_hf(hf)


def test_unknown_model_type_is_refused() -> None:
    with pytest.raises(
        ConfigError, match="model_type 'mistral' is not supported.*llama \\(llama3\\)"
    ):
        get_hf_model_spec("mistral")


def test_names_map_both_ways() -> None:
    pairs = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "layers.3.attention.q_proj.weight": "model.layers.3.self_attn.q_proj.weight",
        "layers.3.attention.k_norm.weight": "model.layers.3.self_attn.k_norm.weight",
        "layers.0.attention_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.0.mlp_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "layers.12.mlp.gate_proj.weight": "model.layers.12.mlp.gate_proj.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for ours, theirs in pairs.items():
        assert ADAPTER.to_hf_name(ours) == theirs and ADAPTER.from_hf_name(theirs) == ours
    assert ADAPTER.from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(ConfigError, match="Unexpected tensor 'score.weight'"):
        ADAPTER.from_hf_name("score.weight")
