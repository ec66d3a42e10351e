"""Attention of one new token per row over a generation cache (flash-decoding, split over keys).

    out[b, h] = sum_j p[b, h, j] * v[slots[b], h // group, j]
    p[b, h, :] = softmax(scale * q[b, h] . k[slots[b], h // group, j]  for j in [start_b, end_b))

Inputs: q [B, H, d] (the step's rotated queries), k and v [S, K, L, d] (the cache of S slots,
K kv heads, L positions; H = K * group), slots [B] (each row's cache slot), positions [B] (each
row's query position: it sees keys 0..position, and with ``window`` only the last ``window`` of
them, with ``chunk`` only those of its chunk) and optionally live [B] (a row not live is a
dummy row of a captured step: it reads nothing and outputs zeros). Output [B, H, d] in q's
dtype. The step's own key and value must already be in the cache.

Why a kernel. The PyTorch form (``decode_attention_reference``, what models/components/cache.py
runs for prefills) is two batched matmuls around a masked fp32 softmax, over every one of the
L indices the step's shapes hold: for a CUDA graph's static shapes that is the whole cache
(``max_len``), whatever each row's length. At batch 1 on an H200 those three kernels and
their gaps took ~9 us of each 1B layer's ~66 us decode step (benchmarks/RESULTS.md, s27); in
a long RL rollout they read ``max_len`` keys for a row that holds a few hundred. The kernel
reads each row's keys up to its position only, straight from its slot (no gather copy), in
one launch (two when the keys are split).

Layout. One program per (row, kv head, block of up to 64 of its query heads, split): the
heads' [G, d] queries against BLOCK_L cached keys at a time, online softmax in fp32 (log2
units), the [G, d] sum of values in fp32. With one split it writes the output; with several,
each split covers a contiguous range of key indices and writes its running max, sum and
unnormalised output, and a second kernel combines the splits of each (row, head). The split
count depends on the cache's L, the kv heads and the GPU's SM count (and on B when B is a
plain int): enough programs to fill the GPU at batch 1, none when a row's range is empty.

``decode_attention`` dispatches: ``impl="triton"`` the kernels (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``), ``"torch"`` the reference, ``"auto"`` Triton on CUDA when installed.
The Triton path is a ``torch.library.triton_op`` (inductor compiles it into a decode step)
with no autograd formula: it serves generation, which runs without gradients.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from torchloom.kernels.attention_mask import AttentionMask
from torchloom.kernels.triton_support import (
    jit,
    num_persistent_programs,
    tl,
    triton,
    triton_op,
    use_triton,
)

IMPLS = ("auto", "torch", "triton")
_LOG2E = 1.4426950408889634
_BLOCK_L = 64
_MAX_BLOCK_G = 64


def decode_attention_reference(
    q_BHd: torch.Tensor,
    k_SKLd: torch.Tensor,
    v_SKLd: torch.Tensor,
    slots_B: torch.Tensor,
    positions_B: torch.Tensor,
    live_B: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The PyTorch form: gather each row's slot, scores in q's dtype, a masked fp32 softmax,
    the probabilities in q's dtype times the values (a row that sees no key: zeros)."""
    B, H, d = q_BHd.shape
    K, L = k_SKLd.shape[1], k_SKLd.shape[2]
    keys_BKLd, values_BKLd = k_SKLd[slots_B].to(q_BHd.dtype), v_SKLd[slots_B].to(q_BHd.dtype)
    q_BKGd = q_BHd.view(B, K, H // K, d)
    scores_BKGL = (q_BKGd @ keys_BKLd.transpose(-1, -2)).float() * d**-0.5
    index_L = torch.arange(L, device=q_BHd.device)
    mask = AttentionMask(window=window, chunk=chunk)  # causal, plus the window / chunk
    seen_BL = mask.visible(positions_B[:, None], index_L[None, :])
    if live_B is not None:
        seen_BL &= live_B[:, None]
    scores_BKGL = scores_BKGL.masked_fill(~seen_BL[:, None, None], float("-inf"))
    probs_BKGL = scores_BKGL.softmax(-1).nan_to_num(0.0)  # a row that sees nothing: zeros
    return (probs_BKGL.to(q_BHd.dtype) @ values_BKLd).reshape(B, H, d)


def decode_attention(
    q_BHd: torch.Tensor,
    k_SKLd: torch.Tensor,
    v_SKLd: torch.Tensor,
    slots_B: torch.Tensor,
    positions_B: torch.Tensor,
    live_B: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """[B, H, d]: each row's one query attending over its slot's cached keys (module
    docstring); ``impl`` picks the kernel."""
    if impl not in IMPLS:
        raise ValueError(f"decode attention impl must be one of {IMPLS}; got {impl!r}")
    if impl == "torch" or (impl == "auto" and not kernel_takes(q_BHd, k_SKLd, v_SKLd)):
        return decode_attention_reference(
            q_BHd, k_SKLd, v_SKLd, slots_B, positions_B, live_B, window, chunk
        )
    if live_B is None:
        live_B = torch.ones_like(slots_B, dtype=torch.bool)
    return torch.ops.torchloom.decode_attention(
        q_BHd, k_SKLd, v_SKLd, slots_B, positions_B, live_B, window or 0, chunk or 0
    )


def kernel_takes(q_BHd: torch.Tensor, k_SKLd: torch.Tensor, v_SKLd: torch.Tensor) -> bool:
    """Whether ``impl="auto"`` runs the kernel: on CUDA with Triton, one dtype throughout, the
    cache's head dim contiguous, and no gradient asked for (the op has no backward)."""
    same_dtype = q_BHd.dtype == k_SKLd.dtype == v_SKLd.dtype
    unit_stride = k_SKLd.stride(-1) == 1 and v_SKLd.stride(-1) == 1
    wants_grad = torch.is_grad_enabled() and q_BHd.requires_grad
    return use_triton(q_BHd) and same_dtype and unit_stride and not wants_grad


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


@jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, live_ptr,
    out_ptr, max_ptr, sum_ptr, acc_ptr,
    H, group, g_blocks, L, d, split_len,
    stride_qb, stride_qh, stride_ks, stride_kk, stride_kl, stride_vs, stride_vk, stride_vl,
    SCALE_LOG2: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (row b, kv head * g_blocks + head block, split). q, out: [B, H, d] with unit d
    stride; max, sum: [B, H, SPLITS] fp32; acc: [B, H, SPLITS, d] fp32."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // g_blocks
    in_group = (tl.program_id(1) % g_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    split = tl.program_id(2)
    heads = (kv_head * group + in_group).to(tl.int64)
    g_ok = in_group < group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    gd_ok = g_ok[:, None] & d_ok[None, :]

    slot = tl.load(slots_ptr + b).to(tl.int64)
    position = tl.load(pos_ptr + b).to(tl.int64)
    live = tl.load(live_ptr + b)
    end = tl.where(live, tl.minimum(position + 1, L), 0)
    start = tl.zeros_like(position)
    if WINDOW > 0:
        start = tl.maximum(start, position - WINDOW + 1)
    if CHUNK > 0:
        start = tl.maximum(start, position - position % CHUNK)
    lo = tl.maximum(start, split * split_len)
    hi = tl.minimum(end, (split + 1) * split_len)

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gd_ok, other=0.0)  # fmt: skip
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kk
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vk
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for block in range(lo, hi, BLOCK_L):  # every block holds a visible key: the max is finite
        index = block + tl.arange(0, BLOCK_L)
        index_ok = index < hi
        ld_ok = index_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_base + index[:, None] * stride_kl + offs_d[None, :], mask=ld_ok, other=0.0)
        scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * SCALE_LOG2
        scores = tl.where(index_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        values = tl.load(
            v_base + index[:, None] * stride_vl + offs_d[None, :], mask=ld_ok, other=0.0
        )
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(values.dtype), values, input_precision=DOT_PRECISION
        )
        running_max = new_max

    if SPLITS == 1:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # nothing seen: zeros
        out_ptrs = out_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_ok)
    else:
        row_head = (b * H + heads) * SPLITS + split  # [B, H, SPLITS] index
        tl.store(max_ptr + row_head, running_max, mask=g_ok)
        tl.store(sum_ptr + row_head, running_sum, mask=g_ok)
        tl.store(acc_ptr + row_head[:, None] * d + offs_d[None, :], acc, mask=gd_ok)


@jit
def _combine_kernel(
    max_ptr, sum_ptr, acc_ptr, out_ptr, H, d, stride_ob, stride_oh,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row b, head h): the splits' partial softmaxes rescaled to their common max."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    base = (b * H + h) * SPLITS
    maxes = tl.load(max_ptr + base + splits, mask=s_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + base + splits, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + (base + splits[:, None]) * d + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    top = tl.max(maxes, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row that sees nothing: every split empty
    weights = tl.where(maxes > float("-inf"), tl.exp2(maxes - top), 0.0)  # empty splits: 0
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(weights[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)  # fmt: skip


def split_count(L: int, kv_heads: int, rows: int | None, device: torch.device) -> int:
    """Key splits per (row, kv head): about two programs per SM at ``rows`` rows (a symbolic
    batch counts as one row), at most one split per key block."""
    programs = (rows if isinstance(rows, int) else 1) * kv_heads
    wanted = -(-2 * num_persistent_programs(device) // programs)
    return max(1, min(wanted, -(-L // _BLOCK_L)))


@triton_op("torchloom::decode_attention")
def decode_attention_triton(
    q_BHd: torch.Tensor,
    k_SKLd: torch.Tensor,
    v_SKLd: torch.Tensor,
    slots_B: torch.Tensor,
    positions_B: torch.Tensor,
    live_B: torch.Tensor,
    window: int,
    chunk: int,
) -> torch.Tensor:
    """The Triton kernels (window / chunk 0: none)."""
    if k_SKLd.stride(-1) != 1 or v_SKLd.stride(-1) != 1:
        raise ValueError("decode attention reads the cache's head dim contiguously (stride 1)")
    B, H, d = q_BHd.shape
    K, L = k_SKLd.shape[1], k_SKLd.shape[2]
    group = H // K
    q_BHd = q_BHd.contiguous()
    out_BHd = torch.empty_like(q_BHd)
    block_g = min(_MAX_BLOCK_G, max(16, triton.next_power_of_2(group)))
    g_blocks = triton.cdiv(group, block_g)
    block_d = max(16, triton.next_power_of_2(d))
    splits = split_count(L, K, B, q_BHd.device)
    split_len = triton.cdiv(triton.cdiv(L, splits), _BLOCK_L) * _BLOCK_L
    partial = splits > 1
    max_BHS = q_BHd.new_empty((B, H, splits) if partial else (1,), dtype=torch.float32)
    sum_BHS = torch.empty_like(max_BHS)
    acc_BHSd = q_BHd.new_empty((B, H, splits, d) if partial else (1,), dtype=torch.float32)
    wrap_triton(_split_kernel)[(B, K * g_blocks, splits)](
        q_BHd, k_SKLd, v_SKLd, slots_B, positions_B, live_B,
        out_BHd, max_BHS, sum_BHS, acc_BHSd,
        H, group, g_blocks, L, d, split_len,
        q_BHd.stride(0), q_BHd.stride(1), *k_SKLd.stride()[:3], *v_SKLd.stride()[:3],
        # A constant, not an argument: inductor passes a float argument as fp64, which would
        # turn the fp32 running max into fp64 inside the loop (Triton refuses that).
        SCALE_LOG2=d**-0.5 * _LOG2E, WINDOW=window, CHUNK=chunk, SPLITS=splits,
        BLOCK_G=block_g, BLOCK_L=_BLOCK_L, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q_BHd.dtype), num_warps=4,
    )  # fmt: skip
    if partial:
        wrap_triton(_combine_kernel)[(B, H)](
            max_BHS, sum_BHS, acc_BHSd, out_BHd, H, d, out_BHd.stride(0), out_BHd.stride(1),
            SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out_BHd
