"""Gathered multi-query attention with a sink (DeepSeek-V4's sparse attention): each query
attends over its own list of K rows of one shared key = value tensor, so the cost grows with
T * K, not with T * (T + S).

    out[b, h, t] = sum_k p[b, h, t, k] * kv[b, indices[b, t, k]]
    p[b, h, t, :] = softmax([scale * q[b, h, t] . kv[b, indices[b, t, k]] for k | sinks[h]])[:-1]

Inputs: q [B, H, T, d] (any strides; a view of [B, T, H, d] reads best: one query's heads are
then one contiguous [H, d] tile), kv [B, N, d] (keys double as
values; in the model N = T token keys then S group keys), indices [B, T, K] int32 or int64
(rows of kv; -1 pads and is ignored), sinks [H] fp32 (a logit per head that joins the softmax's
denominator and attends to nothing). Output [B, H, T, d] in q's dtype. A query with no valid
index outputs zeros (only its sink is left).

``sparse_attention`` dispatches: ``impl="triton"`` the Triton kernels (CUDA, or CPU tensors
under ``TRITON_INTERPRET=1``), ``"gather"`` the PyTorch reference (any device and size: it
gathers the K rows of a block of queries at a time; autograd gives its backward), ``"auto"``
Triton on CUDA when installed, else the reference. The Triton path is a pair of
``torch.library`` custom ops (forward, backward) with the backward registered as the forward's
autograd formula, so torch.compile keeps it in one graph (fullgraph regions).

The Triton forward runs one program per (query, block of BLOCK_H heads): the heads' [BLOCK_H, d]
queries against BLOCK_K gathered rows at a time (one load serves as keys and as values), online
softmax in fp32 starting from the sink, and saves the log-sum-exp. The backward recomputes the
probabilities from it per program and writes dq directly; d(kv) (key and value contributions
both) goes by atomic adds into an fp32 buffer at the gathered rows, so its order, and so its
last bits, vary from run to run. d(sinks) needs no kernel: with p_sink = exp(sink - lse) and
delta = sum_d(dout * out), d(sink_h) = -sum_{b, t} p_sink * delta (the sink only scales every
probability down by its share of the denominator).
"""

from __future__ import annotations

import torch

from torchloom.kernels.triton_support import jit, tl, triton, use_triton

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton: never launched
    OutOfResources = RuntimeError

IMPLS = ("auto", "gather", "triton")
_LOG2E = 1.4426950408889634
# Reference: elements of the gathered rows ([chunk, K, d]) or logits ([H, chunk, K]) per step.
_GATHER_BUDGET = 1 << 26


def gather_attention(
    q_BHTd: torch.Tensor, kv_BNd: torch.Tensor, indices_BTK: torch.Tensor,
    sinks_H: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The PyTorch reference: for a block of queries at a time, gather their K rows, take the
    logits in q's dtype, the softmax (with the sink) in fp32 (or q's wider dtype), and the weighted sum of the rows."""
    B, H, T, d = q_BHTd.shape
    K = indices_BTK.shape[-1]
    chunk = max(1, _GATHER_BUDGET // max(1, B * K * max(d, H)))
    batch_B11 = torch.arange(B, device=q_BHTd.device)[:, None, None]
    softmax_dtype = torch.promote_types(q_BHTd.dtype, torch.float32)
    sinks_1H11 = sinks_H.to(softmax_dtype).view(1, H, 1, 1)
    outs = []
    for start in range(0, T, chunk):
        index_BCK = indices_BTK[:, start : start + chunk].long()
        rows_BCKd = kv_BNd[batch_B11, index_BCK.clamp(min=0)]
        q_BHCd = q_BHTd[:, :, start : start + chunk]
        logits_BHCK = torch.einsum("bhcd,bckd->bhck", q_BHCd, rows_BCKd.to(q_BHCd.dtype)) * scale
        logits_BHCK = logits_BHCK.to(softmax_dtype).masked_fill(index_BCK[:, None] < 0, -torch.inf)
        sinks_BHC1 = sinks_1H11.expand(B, H, logits_BHCK.shape[2], 1)
        probs_BHCK = torch.cat([logits_BHCK, sinks_BHC1], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhck,bckd->bhcd", probs_BHCK.to(rows_BCKd.dtype), rows_BCKd)
        outs.append(out.to(q_BHTd.dtype))
    return torch.cat(outs, dim=2) if outs else q_BHTd.new_zeros(q_BHTd.shape)


def dense_attention(
    q_BHTd: torch.Tensor, kv_BNd: torch.Tensor, indices_BTK: torch.Tensor,
    sinks_H: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The same function as a dense masked softmax over all N rows ([B, H, T, N] logits: tiny
    shapes only; what the tests compare the reference with)."""
    B, H, T, _ = q_BHTd.shape
    N = kv_BNd.shape[1]
    visible_BTN = torch.zeros(B, T, N + 1, dtype=torch.bool, device=q_BHTd.device)
    visible_BTN.scatter_(-1, torch.where(indices_BTK < 0, N, indices_BTK).long(), True)
    logits_BHTN = torch.matmul(q_BHTd, kv_BNd[:, None].transpose(-1, -2)) * scale
    softmax_dtype = torch.promote_types(q_BHTd.dtype, torch.float32)
    logits_BHTN = logits_BHTN.to(softmax_dtype).masked_fill(
        ~visible_BTN[:, None, :, :N], -torch.inf
    )
    sinks_BHT1 = sinks_H.to(softmax_dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    probs_BHTN = torch.cat([logits_BHTN, sinks_BHT1], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs_BHTN.to(kv_BNd.dtype), kv_BNd[:, None]).to(q_BHTd.dtype)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


@jit
def _forward_kernel(
    q_ptr, kv_ptr, idx_ptr, sinks_ptr, out_ptr, lse_ptr,
    T, H, K, d, scale_log2,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_ib, stride_it, stride_ik,
    stride_ob, stride_oh, stride_ot, stride_od,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: query (b, t), heads BLOCK_H * program_id(1) + [0, BLOCK_H). The running
    max and sum start at the sink (exp2(sink - sink) = 1), so they are finite throughout.
    Writes out and lse ([B, H, T] fp32, log2 units: the backward's exp2 reads it as is)."""
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // T, pid % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q_ptrs = q_ptr + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=hd_ok, other=0.0)
    scale = tl.full((), scale_log2, tl.float32)
    m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    idx_base = idx_ptr + b * stride_ib + t * stride_it
    kv_base = kv_ptr + b * stride_kb + offs_d[None, :] * stride_kd
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        rows = tl.load(idx_base + offs_k * stride_ik, mask=offs_k < K, other=-1).to(tl.int64)
        k_ok = rows >= 0
        kv = tl.load(kv_base + rows[:, None] * stride_kn, mask=k_ok[:, None] & d_ok[None, :],
                     other=0.0)  # fmt: skip
        scores = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * scale
        scores = tl.where(k_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    out_ptrs = out_ptr + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh
    tl.store(out_ptrs + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=hd_ok)
    tl.store(lse_ptr + (b * H + heads) * T + t, m_i + tl.log2(l_i), mask=h_ok)


@jit
def _backward_kernel(
    q_ptr, kv_ptr, idx_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    T, H, K, d, scale_log2, scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kn, stride_kd,
    stride_ib, stride_it, stride_ik,
    stride_ob, stride_oh, stride_ot, stride_od,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The forward's program recomputed from lse: p = exp2(scale_log2 * q.k - lse), then
    ds = p * (dout.k - delta) (the logits' gradient; kv doubles as the values, so dp reads it),
    dq = scale * sum_k ds k (stored, [B, H, T, d] with q's strides) and, added atomically into
    the fp32 [B, N, d] dkv at each gathered row, scale * ds^T q (as a key) + p^T dout (as a
    value). kv and dkv are contiguous; lse and delta are [B, H, T] fp32."""
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // T, pid % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q_offs = (
        b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptr + q_offs, mask=hd_ok, other=0.0)
    o_offs = (
        b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    )
    dout = tl.load(dout_ptr + o_offs, mask=hd_ok, other=0.0)
    lse = tl.load(lse_ptr + (b * H + heads) * T + t, mask=h_ok, other=0.0)
    delta = tl.load(delta_ptr + (b * H + heads) * T + t, mask=h_ok, other=0.0)
    scale_l = tl.full((), scale_log2, tl.float32)
    dq = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    idx_base = idx_ptr + b * stride_ib + t * stride_it
    kv_base = kv_ptr + b * stride_kb + offs_d[None, :] * stride_kd
    dkv_base = dkv_ptr + b * stride_kb + offs_d[None, :] * stride_kd  # contiguous like kv
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        rows = tl.load(idx_base + offs_k * stride_ik, mask=offs_k < K, other=-1).to(tl.int64)
        k_ok = rows >= 0
        kd_ok = k_ok[:, None] & d_ok[None, :]
        kv = tl.load(kv_base + rows[:, None] * stride_kn, mask=kd_ok, other=0.0)
        scores = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * scale_l
        p = tl.exp2(scores - lse[:, None])
        p = tl.where(h_ok[:, None] & k_ok[None, :], p, 0.0)
        dp = tl.dot(dout, tl.trans(kv), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kv.dtype), kv, dq, input_precision=DOT_PRECISION)
        dkv = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION) * scale
        dkv = tl.dot(tl.trans(p.to(dout.dtype)), dout, dkv, input_precision=DOT_PRECISION)
        tl.atomic_add(dkv_base + rows[:, None] * stride_kn, dkv, mask=kd_ok, sem="relaxed")
    dq_ptrs = dq_ptr + q_offs
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=hd_ok)


def _blocks(H: int, d: int, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_K, BLOCK_D, num_warps). tl.dot needs every side >= 16. Measured on an
    H200 at T = 32768, 64 heads of 512, K = 640 (bf16): the forward takes all 64 heads against
    64 rows (11 ms; 32 heads x 32 rows: 29 ms), the backward 32 heads x 32 rows (73 ms; 16 x 16:
    138 ms), whose [BLOCK_H, d] dq and [BLOCK_K, d] dkv accumulators are fp32."""
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(16, triton.next_power_of_2(H))
    if backward:
        return min(block_h, 32 if block_d >= 256 else 64), 32, block_d, 8
    return min(block_h, 64), 64, block_d, 8


def _launch_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> list:
    return [*q.stride(), *kv.stride(), *indices.stride()]


def _launch(kernel, shape: tuple[int, int, int], backward: bool, *args) -> None:
    """Launch ``kernel`` over (queries, head blocks) with ``_blocks``' tiling; if the GPU lacks
    the shared memory for it (OutOfResources at compile), retry with half the key block, then
    half the head block (a smaller GPU, or a new Triton's different staging)."""
    queries, H, d = shape
    block_h, block_k, block_d, warps = _blocks(H, d, backward)
    while True:
        try:
            kernel[(queries, triton.cdiv(H, block_h))](
                *args, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=block_d,
                DOT_PRECISION=_dot_precision(args[0].dtype), num_warps=warps, num_stages=2,
            )  # fmt: skip
            return
        except OutOfResources:
            if block_k == 16 and block_h == 16:
                raise
            block_k, block_h = (block_k // 2, block_h) if block_k > 16 else (16, block_h // 2)


def triton_forward(
    q_BHTd: torch.Tensor, kv_BNd: torch.Tensor, indices_BTK: torch.Tensor,
    sinks_H: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out [B, H, T, d] with q's strides, lse [B, H, T] fp32 in log2 units)."""
    B, H, T, d = q_BHTd.shape
    K = indices_BTK.shape[-1]
    out_BHTd = torch.empty_like(q_BHTd)
    lse_BHT = torch.empty(B, H, T, dtype=torch.float32, device=q_BHTd.device)
    if B * T == 0:
        return out_BHTd, lse_BHT
    _launch(_forward_kernel, (B * T, H, d), False, q_BHTd, kv_BNd, indices_BTK, sinks_H,
            out_BHTd, lse_BHT, T, H, K, d, scale * _LOG2E,
            *_launch_args(q_BHTd, kv_BNd, indices_BTK), *out_BHTd.stride())  # fmt: skip
    return out_BHTd, lse_BHT


def triton_backward(
    grad_BHTd: torch.Tensor, q_BHTd: torch.Tensor, kv_BNd: torch.Tensor,
    indices_BTK: torch.Tensor, sinks_H: torch.Tensor, scale: float, out_BHTd: torch.Tensor,
    lse_BHT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dkv, dsinks) of ``triton_forward``'s out for its gradient ``grad_BHTd``."""
    B, H, T, d = q_BHTd.shape
    K = indices_BTK.shape[-1]
    delta_BHT = (grad_BHTd.float() * out_BHTd.float()).sum(-1).contiguous()  # as lse
    dsinks_H = -(torch.exp2(sinks_H.float()[:, None] * _LOG2E - lse_BHT) * delta_BHT).sum((0, 2))  # fmt: skip
    dq_BHTd = torch.empty_like(q_BHTd)
    dkv_BNd = torch.zeros(kv_BNd.shape, dtype=torch.float32, device=kv_BNd.device)
    if B * T:
        _launch(_backward_kernel, (B * T, H, d), True, q_BHTd, kv_BNd, indices_BTK, grad_BHTd,
                lse_BHT, delta_BHT, dq_BHTd, dkv_BNd, T, H, K, d, scale * _LOG2E, scale,
                *_launch_args(q_BHTd, kv_BNd, indices_BTK), *grad_BHTd.stride())  # fmt: skip
    return dq_BHTd, dkv_BNd.to(kv_BNd.dtype), dsinks_H.to(sinks_H.dtype)


@torch.library.custom_op("torchloom::sparse_attention_forward", mutates_args=())
def _forward_op(
    q_BHTd: torch.Tensor, kv_BNd: torch.Tensor, indices_BTK: torch.Tensor,
    sinks_H: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``triton_forward`` as an op torch.compile keeps whole (fullgraph regions trace it)."""
    return triton_forward(q_BHTd, kv_BNd, indices_BTK, sinks_H, scale)


@_forward_op.register_fake
def _(q_BHTd, kv_BNd, indices_BTK, sinks_H, scale):
    B, H, T, _ = q_BHTd.shape
    return torch.empty_like(q_BHTd), q_BHTd.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("torchloom::sparse_attention_backward", mutates_args=())
def _backward_op(
    grad_BHTd: torch.Tensor, q_BHTd: torch.Tensor, kv_BNd: torch.Tensor,
    indices_BTK: torch.Tensor, sinks_H: torch.Tensor, scale: float, out_BHTd: torch.Tensor,
    lse_BHT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return triton_backward(grad_BHTd, q_BHTd, kv_BNd, indices_BTK, sinks_H, scale, out_BHTd, lse_BHT)  # fmt: skip


@_backward_op.register_fake
def _(grad_BHTd, q_BHTd, kv_BNd, indices_BTK, sinks_H, scale, out_BHTd, lse_BHT):
    return torch.empty_like(q_BHTd), torch.empty_like(kv_BNd), torch.empty_like(sinks_H)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q_BHTd, kv_BNd, indices_BTK, sinks_H, ctx.scale = inputs
    ctx.save_for_backward(q_BHTd, kv_BNd, indices_BTK, sinks_H, *output)


def _backward(ctx, grad_BHTd: torch.Tensor, _grad_lse: torch.Tensor | None) -> tuple:
    q_BHTd, kv_BNd, indices_BTK, sinks_H, out_BHTd, lse_BHT = ctx.saved_tensors
    dq, dkv, dsinks = _backward_op(
        grad_BHTd, q_BHTd, kv_BNd, indices_BTK, sinks_H, ctx.scale, out_BHTd, lse_BHT
    )
    return dq, dkv, None, dsinks, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def sparse_attention(
    q_BHTd: torch.Tensor, kv_BNd: torch.Tensor, indices_BTK: torch.Tensor,
    sinks_H: torch.Tensor, scale: float | None = None, impl: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """[B, H, T, d]: each query's softmax over its ``indices`` rows of ``kv`` and its head's
    sink (module docstring); ``scale`` defaults to 1/sqrt(d); ``impl`` one of IMPLS."""
    if impl not in IMPLS:
        raise ValueError(f"sparse_attention impl must be one of {IMPLS}, got {impl!r}")
    scale = q_BHTd.shape[-1] ** -0.5 if scale is None else scale
    if impl == "triton" or (impl == "auto" and use_triton(q_BHTd)):
        if triton is None:
            raise RuntimeError("sparse_attention impl 'triton' needs Triton: pip install triton")
        # dkv, an fp32 buffer, shares kv's (contiguous) strides
        kv_BNd = kv_BNd.to(q_BHTd.dtype).contiguous()
        return _forward_op(q_BHTd, kv_BNd, indices_BTK, sinks_H, float(scale))[0]
    return gather_attention(q_BHTd, kv_BNd, indices_BTK, sinks_H, scale)


def attention_flops(B: int, H: int, T: int, K: int, d: int) -> int:
    """Forward FLOPs of the gathered attention: scores and weighted sum over K rows each."""
    return 4 * B * H * T * K * d
