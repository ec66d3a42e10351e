"""Llama 3: published parameter counts and logits parity with transformers' LlamaForCausalLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn

from torchloom.models import Decoder, RopeConfig, build_model
from torchloom.models.llama3 import LLAMA3_FLAVORS

# Totals of the released checkpoints (1B and 3B tie the head to the embedding).
PUBLISHED = {"1B": 1.24e9, "3B": 3.21e9, "8B": 8.03e9, "70B": 70.6e9, "405B": 405.9e9}


@pytest.mark.parametrize("flavor", list(LLAMA3_FLAVORS))
def test_num_params_matches_module_and_release(flavor: str) -> None:
    cfg = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        model = build_model(cfg)
    assert isinstance(model, Decoder)
    counted = sum(p.numel() for p in model.parameters())
    print(f"llama3 {flavor}: {counted:,} parameters ({counted / 1e9:.2f}B)")
    assert cfg.num_params() == counted
    if flavor in PUBLISHED:
        assert abs(counted / PUBLISHED[flavor] - 1) < 0.005, f"{counted:,} vs {PUBLISHED[flavor]}"


ROPES = {
    "default": RopeConfig(theta=10000.0),
    # A short "original" context, so that the 8 frequencies of head_dim 16 fall in every regime:
    # llama3 keeps pair 0, blends pairs 1-2, divides 3-7; yarn ramps over pairs 0-3.
    "llama3": RopeConfig(theta=10000.0, scaling="llama3", factor=4.0, high_freq_factor=8.0,
                         original_max_seq_len=64),
    "yarn": RopeConfig(theta=10000.0, scaling="yarn", factor=4.0, original_max_seq_len=64),
}  # fmt: skip


@pytest.mark.parametrize("rope", list(ROPES))
@torch.no_grad()
def test_logits_match_transformers(
    rope: str, hf_model: Callable[..., nn.Module], randomize: Callable[[Decoder, int], None]
) -> None:
    cfg = replace(LLAMA3_FLAVORS["debug"], rope=ROPES[rope], max_seq_len=256)
    model = build_model(cfg).eval()
    randomize(model, 0)
    reference = hf_model(model, "llama3")
    tokens = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    ours, theirs = model(tokens), reference(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"llama3 debug rope={rope}: max abs logit diff vs transformers {diff:.2e}")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
