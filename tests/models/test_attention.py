"""Attention: GQA semantics, document masks, backends agree, q/k norm, head-sharded weights."""

from __future__ import annotations

import math
import re

import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.kernels import attention_mask
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.models.components.attention import ATTENTION_BACKENDS, Attention
from torchloom.models.components.cache import KVState
from torchloom.models.components.mla import MultiHeadLatentAttention
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

DIM, HEADS, KV_HEADS, HEAD_DIM, T = 32, 4, 2, 8, 12


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x_BTD = torch.randn(2, T, DIM, generator=generator)
    positions_BT = torch.arange(T).expand(2, T)
    cos, sin = RotaryEmbedding(RopeConfig(), HEAD_DIM)(positions_BT)
    doc_ids_BT = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    return x_BTD, cos, sin, doc_ids_BT


def _explicit_attention(
    attn: Attention,
    x_BTD: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask_BTT: torch.Tensor,
) -> torch.Tensor:
    """Textbook GQA: every kv head repeated for its group of query heads, masked softmax."""
    B = x_BTD.shape[0]
    q = apply_rotary(attn.q_proj(x_BTD).view(B, T, HEADS, HEAD_DIM), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.k_proj(x_BTD).view(B, T, KV_HEADS, HEAD_DIM), cos, sin).transpose(1, 2)
    v = attn.v_proj(x_BTD).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
    group = HEADS // KV_HEADS
    outs = []
    for h in range(HEADS):
        scores_BTT = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(HEAD_DIM)
        weights_BTT = scores_BTT.masked_fill(~mask_BTT, float("-inf")).softmax(-1)
        outs.append(weights_BTT @ v[:, h // group])
    return attn.o_proj(torch.cat(outs, dim=-1))


@pytest.mark.parametrize("with_docs", [False, True])
def test_gqa_equals_explicit_repeat_kv(with_docs: bool) -> None:
    attn = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM)
    x, cos, sin, doc_ids = _inputs()
    mask_BTT = (
        CAUSAL.dense(T, x.device, doc_ids)[:, 0] if with_docs else torch.ones(T, T).tril().bool()
    )
    got = attn(x, cos, sin, doc_ids if with_docs else None)
    assert got.shape == (2, T, DIM)
    expected = _explicit_attention(attn, x, cos, sin, mask_BTT.expand(2, T, T))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_document_mask_is_causal_and_per_document() -> None:
    mask = CAUSAL.dense(5, torch.device("cpu"), torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    ).bool()
    assert torch.equal(mask, expected), mask


# Packed rows: several documents per row, boundaries at different places in each row, and
# documents of a single token (at a row's start, in its middle and at its end).
PACKED_DOC_IDS_BT = torch.tensor(
    [
        [0] * 5 + [1] * 7,
        [0] + [1] * 8 + [2] * 3,
        [0] * 4 + [1] + [2] * 6 + [3],
        [0] * T,
    ]
)


def _reference_attention(
    q_BHTd: torch.Tensor, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor, doc_ids_BT: torch.Tensor
) -> torch.Tensor:
    """Causal same-document GQA in float64, written out: query t of row b and head h sees key s
    of kv head h // (H / K) iff s <= t and both tokens carry the same document id."""
    B, H, T_, d = q_BHTd.shape
    group = H // k_BKTd.shape[1]
    out = torch.zeros(B, H, T_, d, dtype=torch.float64)
    for b in range(B):
        for t in range(T_):
            keys = [s for s in range(t + 1) if doc_ids_BT[b, s] == doc_ids_BT[b, t]]
            for h in range(H):
                k_Sd = k_BKTd[b, h // group, keys].double()
                scores_S = k_Sd @ q_BHTd[b, h, t].double() / math.sqrt(d)
                out[b, h, t] = scores_S.softmax(0) @ v_BKTd[b, h // group, keys].double()
    return out


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_backends_agree_with_a_float64_reference(backend: str, with_docs: bool) -> None:
    """Every registered kernel, with and without packed documents: the output (and, except for
    flex, which has no CPU backward, the input gradients) within 1e-5 of float64 attention."""
    generator = torch.Generator().manual_seed(1)
    B = PACKED_DOC_IDS_BT.shape[0]
    qkv = [
        torch.randn(B, heads, T, HEAD_DIM, generator=generator)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    ]
    doc_ids = PACKED_DOC_IDS_BT if with_docs else None
    reference_docs = PACKED_DOC_IDS_BT if with_docs else torch.zeros(B, T, dtype=torch.long)
    ref_inputs = [t.double().requires_grad_() for t in qkv]
    expected = _reference_attention(*ref_inputs, reference_docs)
    out_weights = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    ref_grads = torch.autograd.grad((expected * out_weights).sum(), ref_inputs)

    backward = backend != "flex"
    inputs = [t.clone().requires_grad_(backward) for t in qkv]
    with torch.set_grad_enabled(backward):
        got = ATTENTION_BACKENDS[backend](*inputs, doc_ids)
    diffs = {"out": (got.double() - expected).abs().max().item()}
    if backward:
        grads = torch.autograd.grad((got * out_weights.float()).sum(), inputs)
        for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
            diffs[name] = (grad.double() - ref).abs().max().item()
    print(
        f"{backend} docs={with_docs}: max abs diff vs float64 "
        + ", ".join(f"{name} {diff:.1e}" for name, diff in diffs.items())
    )
    worst = max(diffs.values())
    assert worst < 1e-5, f"{backend} docs={with_docs}: max abs diff vs float64 {diffs}"


MASKS = [AttentionMask(window=3), AttentionMask(chunk=5), AttentionMask(window=4, chunk=8)]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
@pytest.mark.parametrize("with_docs", [False, True])
def test_sdpa_and_flex_honour_window_and_chunk(mask: AttentionMask, with_docs: bool) -> None:
    """An Attention layer with a window or chunk equals the explicit per-head attention under
    that mask, on sdpa and on flex (forward only: flex has no CPU backward)."""
    x, cos, sin, doc_ids = _inputs()
    docs = doc_ids if with_docs else None
    visible_BTT = mask.dense(T, x.device, docs)[:, 0].expand(2, T, T)
    sdpa = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, mask=mask)
    flex = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, mask=mask, backend="flex")
    flex.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        expected = _explicit_attention(sdpa, x, cos, sin, visible_BTT)
        for name, layer in (("sdpa", sdpa), ("flex", flex)):
            diff = (layer(x, cos, sin, docs) - expected).abs().max().item()
            print(f"{name} {mask.describe()} docs={with_docs}: max abs diff {diff:.1e}")
            assert diff < 1e-5, (name, diff)


def test_masks_are_refused_where_they_cannot_be_honoured() -> None:
    """The batch-invariant kernels (attention and decode) and MLA compute plain masks only, a
    KV cache causal ones; sinks, compressed and top-k keys belong to layers of their own: each
    refusal is one line naming the mask."""
    with pytest.raises(ValueError, match="batch_invariant.*window 4.*batch_invariant false"):
        Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, backend="batch_invariant",
                  mask=AttentionMask(window=4))  # fmt: skip
    for mask in (AttentionMask(sink=True), AttentionMask(compress=4), AttentionMask(topk=8)):
        with pytest.raises(ConfigError, match=re.escape(mask.describe())):
            Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, mask=mask)
    window, cpu = AttentionMask(window=4), torch.device("cpu")
    with pytest.raises(
        ValueError, match=r"batch-invariant decode kernel .*\(causal \+ document \+ window 4\)"
    ):
        KVState(2, KV_HEADS, 8, HEAD_DIM, cpu, torch.float32, batch_invariant=True, mask=window)
    with pytest.raises(ValueError, match="KV cache decodes causal attention only"):
        KVState(2, KV_HEADS, 8, HEAD_DIM, cpu, torch.float32, mask=AttentionMask(causal=False))
    with pytest.raises(ValueError, match=r"multi-head latent attention .*window 4"):
        MultiHeadLatentAttention(DIM, HEADS, None, 16, 8, 8, 8, 0.25, mask=window)


def test_flops_read_the_window_and_chunk() -> None:
    full = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM).flops_per_token(64)
    window = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, mask=AttentionMask(window=8))
    chunk = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, mask=AttentionMask(chunk=8))
    attention_part = 6 * HEADS * HEAD_DIM
    assert full - window.flops_per_token(64) == attention_part * (64 - 16)
    assert full - chunk.flops_per_token(64) == attention_part * (64 - 8)


def test_causal_positions_and_starts_mark_each_document_start() -> None:
    """The batch-invariant kernel's view of packed rows: key span start = its document's first
    index, computed here by walking each row."""
    positions, starts = attention_mask.causal_positions_and_starts(
        *PACKED_DOC_IDS_BT.shape, PACKED_DOC_IDS_BT, torch.device("cpu")
    )
    expected = torch.zeros_like(PACKED_DOC_IDS_BT)
    for b, row in enumerate(PACKED_DOC_IDS_BT.tolist()):
        for t in range(1, T):
            expected[b, t] = t if row[t] != row[t - 1] else expected[b, t - 1]
    assert torch.equal(positions, torch.arange(T).expand_as(positions)), positions
    assert starts is not None and torch.equal(starts, expected), (starts, expected)
    assert attention_mask.causal_positions_and_starts(2, T, None, torch.device("cpu"))[1] is None


def test_qk_norm_makes_attention_invariant_to_qk_scale() -> None:
    x, cos, sin, _ = _inputs()
    for qk_norm in (True, False):
        attn = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, qk_norm=qk_norm, norm_eps=1e-6)
        assert (attn.q_norm is not None) == (attn.k_norm is not None) == qk_norm
        before = attn(x, cos, sin)
        with torch.no_grad():
            attn.q_proj.weight.mul_(10.0)
            attn.k_proj.weight.mul_(10.0)
        diff = (attn(x, cos, sin) - before).abs().max().item()
        if qk_norm:
            assert diff < 1e-5, f"qk_norm should undo the scale; max abs diff {diff}"
        else:
            assert diff > 1e-3, f"without qk_norm the scale must matter; max abs diff {diff}"


def test_heads_are_read_from_weight_shapes() -> None:
    """Two head-sharded halves (as a tensor-parallel plan makes them) sum to the full output."""
    full = Attention(DIM, HEADS, KV_HEADS, HEAD_DIM)
    x, cos, sin, _ = _inputs()
    total = torch.zeros(2, T, DIM)
    with torch.no_grad():
        for shard in range(2):
            part = Attention(DIM, HEADS // 2, KV_HEADS // 2, HEAD_DIM)
            q_rows = HEADS // 2 * HEAD_DIM
            rows = slice(shard * q_rows, (shard + 1) * q_rows)  # 2 query heads
            kv_rows = slice(shard * HEAD_DIM, (shard + 1) * HEAD_DIM)  # 1 kv head
            part.q_proj.weight.copy_(full.q_proj.weight[rows])
            part.k_proj.weight.copy_(full.k_proj.weight[kv_rows])
            part.v_proj.weight.copy_(full.v_proj.weight[kv_rows])
            part.o_proj.weight.copy_(full.o_proj.weight[:, rows])
            total += part(x, cos, sin)
        torch.testing.assert_close(total, full(x, cos, sin), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [CAUSAL, *MASKS[:2]], ids=lambda m: m.describe())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_docs", [False, True])
def test_compiled_flex_matches_sdpa_with_gradients_on_gpu(
    dtype: torch.dtype, with_docs: bool, mask: AttentionMask
) -> None:
    B, H, K, T_, d = 2, 8, 2, 200, 64  # T not a multiple of the 128-token block
    generator = torch.Generator("cuda").manual_seed(0)
    qkv = [
        torch.randn(B, heads, T_, d, device="cuda", generator=generator).to(dtype)
        for heads in (H, K, K)
    ]
    doc_ids = torch.cat([torch.zeros(B, 70), torch.ones(B, 130)], dim=1).long().cuda()
    results = []
    for backend in ("sdpa", "flex"):
        inputs = [t.clone().requires_grad_() for t in qkv]
        out = ATTENTION_BACKENDS[backend](*inputs, doc_ids if with_docs else None, mask)
        out.float().square().sum().backward()
        results.append([out, *(t.grad for t in inputs)])
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    for name, sdpa, flex in zip(("out", "dq", "dk", "dv"), *results):
        diff = (sdpa.float() - flex.float()).abs().max().item()
        print(f"{mask.describe()} {dtype} docs={with_docs} {name}: flex vs sdpa {diff:.2e}")
        assert diff < tol * max(1.0, sdpa.abs().max().item()), f"{name}: max abs diff {diff}"
