"""Batch-invariant Triton kernels (GPU) for ``torchloom/kernels/batch_invariant.py``.

A GPU kernel is batch-invariant when every output element is reduced in an order that depends
only on the kernel's compile-time configuration, never on how many rows share the call. So:

- ``matmul``: no split-K, fp32 accumulation over K in increasing order, so a row's result does
  not depend on which row of its tile it lands in (a tensor-core MMA computes every row the
  same way). On Hopper every tile shape chains the same 16-deep MMA steps over K and gives the
  same bits, so the tiling follows M (small tiles for decode, large ones for training); on
  other GPUs one tiling per weight shape and dtype serves every M (``matmul_config``).
- ``attention``: flash-style online softmax with fixed BLOCK_M and BLOCK_N whatever the call.
  Key blocks sit at absolute key indices (multiples of BLOCK_N from 0) and are visited in
  increasing order; a block in which a query sees no key leaves that query's state bit for
  bit unchanged (alpha = 1, p = 0), so a decode step (one query, a cache of any length) does
  exactly the arithmetic, in the same order, of that query's row in a full forward.

Forward passes run the kernels; backward passes use ordinary PyTorch (gradients are correct
but not batch-invariant). Both are ``torch.library.triton_op`` custom ops, so torch.compile
can trace them; eager calls take an autograd Function twin that launches the same kernel with
the same arguments without the dispatcher (a fraction of the host cost). ``batch_invariant``
calls these for CUDA tensors when Triton is installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.library import triton_op, wrap_triton

from torchloom.kernels.attention_mask import causal_positions_and_starts, masked_attention
from torchloom.kernels.triton_support import cuda_index, jit, tl, triton


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The fixed tiling, a function of the weight alone (any GPU): per dtype, vocabulary-sized heads
# and every narrower weight. fp32 takes shorter K blocks so that its pipelined tiles fit in
# shared memory; it multiplies in full fp32 ("ieee"), never TF32.
_HEAD_TILING = {
    torch.bfloat16: MatmulConfig(128, 128, 64, 8, 3),
    torch.float16: MatmulConfig(128, 128, 64, 8, 3),
    torch.float32: MatmulConfig(128, 128, 32, 8, 3),
}
_NARROW_TILING = {
    torch.bfloat16: MatmulConfig(64, 64, 128, 4, 3),
    torch.float16: MatmulConfig(64, 64, 128, 4, 3),
    torch.float32: MatmulConfig(64, 64, 32, 4, 3),
}
_HEAD_COLUMNS = 16384

# Tilings that follow the row count, on GPUs where every tiling gives the same bits (below).
_16BIT = (torch.bfloat16, torch.float16)
# M <= 16: (wide weights, narrow weights, narrow weights whose 16-column tiles fit one wave).
# A decode step streams each weight from HBM once; the narrow ones have few column tiles, so
# each program must keep much of its strip in flight: 16x16x1024 tiles in 3 stages hold 96 KB
# of weights a program (one program an SM: 192 KB of shared memory). Timed with the weights
# streamed, not L2-resident (benchmarks/bi_decode_tiling.py, H100), against 64x16x128 before:
# the 1B's down projection 27.1 -> 15.3 us, o 8.6 -> 6.7, and q/k/v (192 tiles of 16 columns:
# more than one wave) 10.1 -> 8.1 with 16x64x256 in 4 stages.
_DECODE_TILING = {
    **dict.fromkeys(_16BIT, (
        MatmulConfig(16, 64, 256, 4, 3), MatmulConfig(16, 64, 256, 4, 4),
        MatmulConfig(16, 16, 1024, 4, 3),
    )),
    torch.float32: (MatmulConfig(16, 64, 32, 4, 3),) * 3,
}  # fmt: skip
# M <= 64, the same three slots. Streamed as above at 64 rows (H100, s50), against 64x16x128 in
# 3 stages for every narrow weight: the 1B's down projection 26.8 -> 17.3 us and o 8.4 -> 6.2
# with 6 stages (one program an SM), q/k/v 9.6 -> 8.0 with 64x32x128 in 4 (96 tiles, one wave).
# fp16 takes them too since its bits were checked against every other tiling (s52, GPU test).
_SMALL_TILING = {
    **dict.fromkeys(_16BIT, (
        MatmulConfig(64, 64, 128, 4, 3), MatmulConfig(64, 32, 128, 4, 4),
        MatmulConfig(64, 16, 128, 4, 6),
    )),
    torch.float32: (MatmulConfig(64, 64, 32, 4, 3),) * 3,
}  # fmt: skip
_LARGE_TILINGS = {  # M > 64: the first with enough tiles to keep half the GPU busy
    **dict.fromkeys(_16BIT, (
        MatmulConfig(128, 256, 64, 8, 3), MatmulConfig(128, 128, 64, 8, 3),
        MatmulConfig(64, 128, 64, 4, 3), MatmulConfig(64, 64, 128, 4, 3),
        MatmulConfig(64, 16, 128, 4, 3),
    )),
    torch.float32: (MatmulConfig(128, 128, 32, 8, 3), MatmulConfig(64, 64, 32, 4, 3)),
}  # fmt: skip
_WIDE_COLUMNS = 4096
# The tilings benchmarks/bi_decode_tiling.py times at decode-sized M (<= 16) and small M
# (<= 64), the rule's picks among them; test_matmul_tilings_agree_on_gpu checks all of their
# bits against the rule's own, so one measured faster can take a slot above without an
# unchecked tiling. Each fits an sm_90 program's shared memory (at most 192 KB of stages).
_TIMED_TILINGS = {  # 16-bit only; fp32 keeps its one tiling a row band
    "decode": tuple(MatmulConfig(*t) for t in (
        (16, 64, 256, 4, 3), (64, 16, 128, 4, 3), (16, 16, 128, 2, 3), (16, 16, 256, 4, 4),
        (16, 16, 512, 4, 4), (16, 16, 512, 4, 3), (16, 16, 1024, 4, 3), (16, 16, 512, 8, 4),
        (16, 32, 256, 4, 4), (16, 32, 512, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 4, 6),
        (16, 16, 256, 2, 6), (16, 32, 512, 8, 3),
    )),
    "small": tuple(MatmulConfig(*t) for t in (
        (64, 16, 128, 4, 3), (64, 16, 128, 4, 5), (64, 16, 128, 4, 6), (64, 16, 128, 2, 6),
        (64, 16, 256, 4, 3), (64, 16, 256, 4, 4), (64, 32, 128, 4, 4), (64, 32, 256, 4, 3),
        (64, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 128, 8, 3),
    )),
}  # fmt: skip


@functools.cache
def _tiling_follows_rows(device_index: int) -> bool:
    """Whether the tiling may follow M on this GPU: on Hopper (sm_90: H100, H200), where every
    tiling of the kernel gives bitwise the same output, because whatever its shape each tile
    chains the same 16-deep tensor-core steps (FMA steps in fp32) over K in the same order.
    benchmarks/batch_invariant_matmul.py and test_matmul_tilings_agree_on_gpu check it; on
    other GPUs, where it is unverified, one tiling per weight serves every M."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def tilings_agree(device: torch.device) -> bool:
    """Whether every tiling of the matmul kernel gives the same bits on ``device`` (a CUDA
    device): then neither M nor the weight's width N changes an output element."""
    index = cuda_index(device)
    return _tiling_follows_rows(index)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fixed_matmul_config(N: int, dtype: torch.dtype) -> MatmulConfig:
    """The tiling of a weight with N output columns for every M, on any GPU. Vocabulary-sized
    heads (N >= 16384) take 128x128 tiles: thousands of column tiles fill the GPU at any M.
    Every other weight takes 64x64 tiles with long K blocks, so that a decode step spreads the
    weight over N / 64 programs."""
    return (_HEAD_TILING if N >= _HEAD_COLUMNS else _NARROW_TILING)[dtype]


def possible_matmul_configs(dtype: torch.dtype) -> set[MatmulConfig]:
    """Every tiling ``matmul_config`` can choose for ``dtype``, on any GPU (what must agree bit
    for bit for the tiling to follow M)."""
    tables = (_DECODE_TILING, _SMALL_TILING, _LARGE_TILINGS)
    return {c for table in tables for c in table[dtype]} | {
        _HEAD_TILING[dtype],
        _NARROW_TILING[dtype],
    }


def timed_matmul_configs(dtype: torch.dtype, rows: str) -> tuple[MatmulConfig, ...]:
    """The alternatives benchmarks/bi_decode_tiling.py times for ``rows`` ("decode": M <= 16,
    "small": M <= 64), each also in ``checked_matmul_configs``."""
    return _TIMED_TILINGS[rows] if dtype in _16BIT else ()


def checked_matmul_configs(dtype: torch.dtype) -> set[MatmulConfig]:
    """What test_matmul_tilings_agree_on_gpu checks bit for bit: every tiling the rule can
    choose, and the timed alternatives it may be re-chosen from."""
    timed = {c for rows in _TIMED_TILINGS for c in timed_matmul_configs(dtype, rows)}
    return possible_matmul_configs(dtype) | timed


def matmul_config(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The tiling of ``x[M, K] @ w[N, K]^T``. Where tilings agree bit for bit (sm_90) it follows
    M: decode-sized calls take narrow tiles spread over many programs, training-sized ones the
    largest tiles that still give half the multiprocessors a tile (measured:
    benchmarks/batch_invariant_matmul.py, benchmarks/RESULTS.md). Elsewhere it is
    ``fixed_matmul_config``: a function of the weight alone."""
    if device.type != "cuda":  # Triton's interpreter
        return fixed_matmul_config(N, dtype)
    index = cuda_index(device)
    if not _tiling_follows_rows(index):
        return fixed_matmul_config(N, dtype)
    if M <= 64:
        table = _DECODE_TILING if M <= 16 else _SMALL_TILING
        wide_tiling, narrow_tiling, one_wave_tiling = table[dtype]
        if N >= _WIDE_COLUMNS:
            return wide_tiling
        one_wave = triton.cdiv(N, one_wave_tiling.block_n) <= _multiprocessors(index)
        return one_wave_tiling if one_wave else narrow_tiling
    tiles_wanted = _multiprocessors(index) // 2
    tilings = _LARGE_TILINGS[dtype]
    for config in tilings:
        if triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n) >= tiles_wanted:
            return config
    return tilings[-1]


_MATMUL_GROUP_M = 8  # tiles of 8 row blocks share their weight columns in L2
# Attention tiles: 64 (query, head) rows against 64 keys. A decode step runs the same tile.
ATTENTION_BLOCK_M = 64
ATTENTION_BLOCK_N = 64


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


@jit
def _matmul_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[M, N] = x[M, K] @ w[N, K]^T, one [BLOCK_M, BLOCK_N] tile per program."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: consecutive programs walk GROUP_M row blocks before the next column block.
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block_k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - block_k * BLOCK_K
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launcher(kernel, traceable: bool):
    """``wrap_triton(kernel)`` inside a triton_op's body (so torch.compile traces the launch),
    the kernel itself for eager calls. On an H200's host a bare launch took 23 us, a call of the
    custom op 64 us, and ``wrap_triton`` outside an op 252 us (benchmarks/RESULTS.md)."""
    return wrap_triton(kernel) if traceable else kernel


def launch_matmul(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    out_MN: torch.Tensor,
    config: MatmulConfig,
    traceable: bool = False,
) -> None:
    """Run the matmul kernel with ``config`` (benchmarks/batch_invariant_matmul.py compares
    tilings with it; the op and its eager twin pass ``matmul_config``)."""
    (M, K), N = x_MK.shape, w_NK.shape[0]
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
    _launcher(_matmul_kernel, traceable)[grid](
        x_MK, w_NK, out_MN, M, N, K, *x_MK.stride(), *w_NK.stride(), *out_MN.stride(),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=_MATMUL_GROUP_M, DOT_PRECISION=_dot_precision(x_MK.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _matmul_forward(x_MK: torch.Tensor, w_NK: torch.Tensor, traceable: bool) -> torch.Tensor:
    M, K = x_MK.shape
    N = w_NK.shape[0]
    out_MN = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M > 0:
        config = matmul_config(M, N, K, x_MK.dtype, x_MK.device)
        launch_matmul(x_MK, w_NK, out_MN, config, traceable)
    return out_MN


def _matmul_setup(ctx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _matmul_backward(ctx, grad_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x_MK, w_NK = ctx.saved_tensors
    grad_x = grad_MN @ w_NK if ctx.needs_input_grad[0] else None
    grad_w = grad_MN.T @ x_MK if ctx.needs_input_grad[1] else None
    return grad_x, grad_w


@triton_op("torchloom::batch_invariant_matmul", mutates_args=())
def _matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """What torch.compile calls: it sees the kernel through the op."""
    return _matmul_forward(x_MK, w_NK, traceable=True)


def _with_eager_twin(
    op: Callable, body: Callable, setup_context: Callable, backward: Callable
) -> Callable:
    """Register ``backward`` as ``op``'s autograd formula and return what the public functions
    call: ``op`` while torch.compile traces (it sees the kernel through the op), else the op's
    eager twin, an autograd Function with the same formula whose ``body`` launches the same
    kernel with the same arguments directly. The custom-op dispatcher cost about three times a
    bare launch's host time per eager call on an H200's host (benchmarks/RESULTS.md), which
    dominated small eager steps. The twin takes the classic ``forward(ctx, ...)`` form, whose
    ``apply`` measured cheaper than the ``setup_context`` form's."""
    op.register_autograd(backward, setup_context=setup_context)
    formula = backward

    class Twin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            setup_context(ctx, inputs, None)
            return body(*inputs)

        backward = staticmethod(formula)

    def call(*args):
        return (op if torch.compiler.is_compiling() else Twin.apply)(*args)

    return call


_matmul_call = _with_eager_twin(
    _matmul, functools.partial(_matmul_forward, traceable=False), _matmul_setup, _matmul_backward
)


def linear(x_ND: torch.Tensor, weight_MD: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype (any leading dims) with the fixed-tile matmul."""
    if x_ND.dtype not in _NARROW_TILING:
        raise TypeError(f"batch-invariant linear takes bf16, fp16 or fp32, not {x_ND.dtype}")
    rows = x_ND.reshape(-1, x_ND.shape[-1])
    out = _matmul_call(rows, weight_MD.to(x_ND.dtype))
    return out.reshape(*x_ND.shape[:-1], weight_MD.shape[0])


@jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, pos_ptr, start_ptr,
    T, L, kv_heads, group, head_dim, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_pb, stride_pt, stride_sb, stride_st,
    HAS_START: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M (query, head) rows of one batch row and kv head; row r is query
    r // group of head kv_head * group + r % group, so a head group shares its key loads."""
    tiles = tl.cdiv(T * group, BLOCK_M)  # consecutive programs: tiles of one (b, kv_head)
    pid = tl.program_id(0).to(tl.int64)
    b, kv_head = (pid // tiles) // kv_heads, (pid // tiles) % kv_heads
    rows = (pid % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * group
    t = rows // group
    head = kv_head * group + rows % group
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=row_ok, other=-1)
    if HAS_START:
        start = tl.load(start_ptr + b * stride_sb + t * stride_st, mask=row_ok, other=0)
    else:
        start = tl.zeros_like(pos)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q_ptrs = q_ptr + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh + offs_d[:, None] * stride_kd
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh + offs_d[None, :] * stride_vd

    # One fp32 scale however the scalar arrives (a compiled caller may pass it as fp64).
    scale = tl.full((), qk_scale, tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # From the block holding the tile's earliest visible key to the one holding its furthest
    # query; blocks outside a row's own span are exact no-ops for that row (see below).
    first_block = tl.min(tl.where(row_ok, start, 2**31 - 1)) // BLOCK_N  # int64, as positions
    end_block = tl.cdiv(tl.max(pos) + 1, BLOCK_N)
    for block in range(first_block, end_block):
        offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < L
        k_ptrs = k_base + offs_n[None, :] * stride_kl  # [BD, BN]
        k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BM, BN], log2 units
        visible = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] >= start[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # A row that sees no key here keeps its max, so alpha = exp2(0) = 1 and p = 0 exactly:
        # its sum and accumulator come out bit for bit unchanged. The safe max avoids
        # exp2(-inf - -inf) = NaN while a row has seen no key at all (its state stays 0).
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_base + offs_n[:, None] * stride_vl  # [BN, BD]
        v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_ot
    tl.store(out_ptrs + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _attention_forward(
    q_BHTd: torch.Tensor,
    k_BKLd: torch.Tensor,
    v_BKLd: torch.Tensor,
    positions_BT: torch.Tensor,
    starts_BT: torch.Tensor | None,
    causal: bool,
    traceable: bool,
) -> torch.Tensor:
    """The attention op's body (``causal`` matters only to its backward)."""
    B, H, T, d = q_BHTd.shape
    kv_heads, L = k_BKLd.shape[1], k_BKLd.shape[2]
    out_BHTd = torch.empty_like(q_BHTd)  # keeps q's memory layout (often a [B, T, H, d] view)
    if T == 0:
        return out_BHTd
    starts = positions_BT if starts_BT is None else starts_BT  # unread without HAS_START
    group = H // kv_heads
    grid = (triton.cdiv(T * group, ATTENTION_BLOCK_M) * B * kv_heads,)
    _launcher(_attention_kernel, traceable)[grid](
        q_BHTd, k_BKLd, v_BKLd, out_BHTd, positions_BT, starts,
        T, L, kv_heads, group, d, d**-0.5 * 1.4426950408889634,  # scale * log2(e), for exp2
        *q_BHTd.stride(), *k_BKLd.stride(), *v_BKLd.stride(), *out_BHTd.stride(),
        *positions_BT.stride(), *starts.stride(),
        HAS_START=starts_BT is not None, BLOCK_M=ATTENTION_BLOCK_M, BLOCK_N=ATTENTION_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(d)), DOT_PRECISION=_dot_precision(q_BHTd.dtype),
        num_warps=4, num_stages=2 if q_BHTd.dtype == torch.float32 else 3,
    )  # fmt: skip
    return out_BHTd


@triton_op("torchloom::batch_invariant_attention", mutates_args=())
def _attention(
    q_BHTd: torch.Tensor,
    k_BKLd: torch.Tensor,
    v_BKLd: torch.Tensor,
    positions_BT: torch.Tensor,
    starts_BT: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """``causal``: positions are 0..T-1 with keys 0..T-1 and no starts (for the backward)."""
    return _attention_forward(q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT, causal, True)


def _attention_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT, ctx.causal = inputs
    ctx.has_starts = starts_BT is not None
    ctx.save_for_backward(q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT)


def _attention_backward(ctx, grad_BHTd: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Recompute with torch's SDPA and take its gradients: the flash kernels for plain causal
    attention, else the memory-efficient ones with an explicit mask (``masked_attention``)."""
    q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT = ctx.saved_tensors
    inputs = [t.detach().requires_grad_() for t in (q_BHTd, k_BKLd, v_BKLd)]
    with torch.enable_grad():
        if ctx.causal:
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
        else:
            out = masked_attention(*inputs, positions_BT, starts_BT if ctx.has_starts else None)
        grads = torch.autograd.grad(out, inputs, grad_BHTd)
    return *grads, None, None, None


_attention_call = _with_eager_twin(
    _attention,
    functools.partial(_attention_forward, traceable=False),
    _attention_setup,
    _attention_backward,
)


def _check_queries(q_BHTd: torch.Tensor) -> None:
    if q_BHTd.dtype not in _NARROW_TILING:
        raise TypeError(f"batch-invariant attention takes bf16, fp16 or fp32, not {q_BHTd.dtype}")
    if q_BHTd.shape[-1] < 16:  # tl.dot needs every dimension >= 16
        raise ValueError(f"batch-invariant attention needs head_dim >= 16, got {q_BHTd.shape[-1]}")


def attention(
    q_BHTd: torch.Tensor,
    k_BKLd: torch.Tensor,
    v_BKLd: torch.Tensor,
    positions_BT: torch.Tensor,
    starts_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention: query (b, t) sees keys ``starts[b, t] .. positions[b, t]`` of row b
    (key index = position), softmax scale 1/sqrt(d), fp32 softmax; keys and values are cast to
    q's dtype. Query-for-query identical whatever T, L and the other rows are."""
    _check_queries(q_BHTd)
    return _attention_call(
        q_BHTd, k_BKLd.to(q_BHTd.dtype), v_BKLd.to(q_BHTd.dtype), positions_BT, starts_BT, False
    )


def causal_attention(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | None,
) -> torch.Tensor:
    """The attention-backend form (training and full forwards), as
    ``batch_invariant.causal_attention``: positions 0..T-1, documents from ``doc_ids_BT``."""
    _check_queries(q_BHTd)
    B, _, T, _ = q_BHTd.shape
    positions_BT, starts_BT = causal_positions_and_starts(B, T, doc_ids_BT, q_BHTd.device)
    k_BKTd, v_BKTd = k_BKTd.to(q_BHTd.dtype), v_BKTd.to(q_BHTd.dtype)
    return _attention_call(q_BHTd, k_BKTd, v_BKTd, positions_BT, starts_BT, doc_ids_BT is None)
