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


SLIDING_DEBUG = replace(
    QWEN3_FLAVORS["debug"], layer_types=("sliding_attention", "full_attention"), sliding_window=4
)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("chunk", [None, 6], ids=["window", "window+chunk"])
def test_flex_equals_sdpa_with_one_block_mask_per_distinct_mask(chunk, monkeypatch) -> None:
    """Interleaved sliding (window 4) and full (or, with ``chunk``, chunked) layers: the flex
    model equals the sdpa one on packed rows (forward: flex has no CPU backward), building one
    BlockMask per distinct mask per forward."""
    from torchloom.kernels.attention_mask import AttentionMask
    from torchloom.models.components import attention

    built = []

    def counting(*args, **kwargs):
        built.append(args[3:5])
        return create_block_mask(*args, **kwargs)

    create_block_mask = attention.create_block_mask
    monkeypatch.setattr(attention, "create_block_mask", counting)
    sdpa = build_model(SLIDING_DEBUG)
    sdpa.init_weights(0)
    flex = build_model(replace(SLIDING_DEBUG, attn_backend="flex"))
    flex.load_state_dict(sdpa.state_dict())
    if chunk is not None:
        for model in (sdpa, flex):
            model.layers["1"].attention.mask = AttentionMask(chunk=chunk)
    tokens = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20])
    with torch.no_grad():
        for docs in (None, doc_ids):
            diff = (flex(tokens, None, docs) - sdpa(tokens, None, docs)).abs().max().item()
            print(f"flex vs sdpa chunk={chunk} docs={docs is not None}: max abs diff {diff:.1e}")
            assert diff < 1e-5
    assert built == [(20, 20)] * 4  # two forwards, two distinct masks each
