"""Qwen3: published parameter counts and logits parity with transformers' Qwen3ForCausalLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn

from torchloom.models import Decoder, build_model
from torchloom.models.qwen3 import QWEN3_FLAVORS

# Totals of the released checkpoints (0.6B-4B tie the head to the embedding).
PUBLISHED = {"0.6B": 0.596e9, "1.7B": 1.72e9, "4B": 4.02e9, "8B": 8.19e9, "14B": 14.77e9,
             "32B": 32.76e9}  # fmt: skip


@pytest.mark.parametrize("flavor", list(QWEN3_FLAVORS))
def test_num_params_matches_module_and_release(flavor: str) -> None:
    cfg = QWEN3_FLAVORS[flavor]
    with torch.device("meta"):
        model = build_model(cfg)
    assert isinstance(model, Decoder)
    counted = sum(p.numel() for p in model.parameters())
    print(f"qwen3 {flavor}: {counted:,} parameters ({counted / 1e9:.2f}B)")
    assert cfg.num_params() == counted
    if flavor in PUBLISHED:
        assert abs(counted / PUBLISHED[flavor] - 1) < 0.005, f"{counted:,} vs {PUBLISHED[flavor]}"


@pytest.mark.parametrize("tie_embeddings", [True, False])
@torch.no_grad()
def test_logits_match_transformers(
    tie_embeddings: bool,
    hf_model: Callable[..., nn.Module],
    randomize: Callable[[Decoder, int], None],
) -> None:
    cfg = replace(QWEN3_FLAVORS["debug"], tie_embeddings=tie_embeddings)
    model = build_model(cfg).eval()
    randomize(model, 0)
    reference = hf_model(model, "qwen3")
    tokens = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    ours, theirs = model(tokens), reference(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"qwen3 debug tied={tie_embeddings}: max abs logit diff vs transformers {diff:.2e}")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
