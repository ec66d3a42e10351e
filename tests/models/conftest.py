"""Shared fixtures for the model tests: Hugging Face reference models with our weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchloom.models import Decoder, get_model_spec

HFBuilder = Callable[[Decoder, str], nn.Module]


@pytest.fixture
def hf_model() -> HFBuilder:
    """Build the transformers reference of torchloom family ``family`` holding ``model``'s weights
    (config and names mapped by the family's HF adapter)."""

    def build(model: Decoder, family: str) -> nn.Module:
        import transformers

        adapter = get_model_spec(family).hf_adapter
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        }[adapter.model_type]
        hf_config = config_cls(**adapter.config_to_hf(model.config), attn_implementation="eager")
        reference = model_cls(hf_config).eval()
        state = {adapter.to_hf_name(k): v for k, v in model.state_dict().items()}
        missing, unexpected = reference.load_state_dict(state, strict=False)
        tied = ["lm_head.weight"] if model.config.tie_embeddings else []
        assert sorted(missing) == tied and not unexpected, (missing, unexpected)
        return reference

    return build


@pytest.fixture
def randomize() -> Callable[[Decoder, int], None]:
    """Give every weight (norms and MoE choice biases included) a distinct random value,
    reproducibly."""

    @torch.no_grad()
    def fill(model: Decoder, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))

    return fill
