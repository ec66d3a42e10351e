"""Sinkhorn-Knopp normalisation of many small [N, N] matrices (DeepSeek-V4's hyper-connection
``comb``, one per token): the PyTorch reference and one Triton kernel each way.

``sinkhorn`` is the reference: a softmax over each row (+ eps), then ``iterations``
normalisations of the columns alternating with ``iterations - 1`` of the rows (columns first),
all in fp32. Compiled, its 2 x iterations tiny reductions stay separate kernels each way (about
150 launches of 1-2 us per hyper-connection call, forward and backward), so on the GPU
``sinkhorn_fused`` runs the whole loop in one kernel per direction: a program holds a block of
tokens' matrices in registers.

The backward keeps nothing from the forward but the logits. Its kernel first replays the
forward, writing each normalisation's input to a per-program scratch buffer (2 x iterations - 1
matrices per token, read back once, mostly from L2), then steps back through the normalisations
in reverse. Every loop has a compile-time trip count: inductor compiles the kernel inside a
compiled model (an earlier form with nested data-dependent loops did not).
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from torchloom.kernels.triton_support import jit, tl, triton_op, use_triton

_BLOCK = 32
"""Tokens (matrices) per program."""


def sinkhorn(comb_logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """A doubly stochastic [..., N, N] matrix from logits, in fp32: softmax over each row (+ eps),
    then ``iterations`` normalisations of the columns alternating with ``iterations - 1`` of the
    rows (DeepSeek-V4's order: columns first)."""
    comb = torch.softmax(comb_logits.float(), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def sinkhorn_fused(comb_logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """``sinkhorn`` by the Triton kernels on CUDA (when Triton is installed and N is a power of
    two), else the reference."""
    n = comb_logits.shape[-1]
    if use_triton(comb_logits) and n & (n - 1) == 0 and iterations >= 1:
        return torch.ops.torchloom.sinkhorn(comb_logits.float(), iterations, eps)
    return sinkhorn(comb_logits, iterations, eps)


@jit
def _by_columns(c, eps):
    """c [BLOCK, N, N] with each column divided by its sum (+ eps)."""
    return c / (tl.sum(c, axis=1, keep_dims=True) + eps)


@jit
def _by_rows(c, eps):
    return c / (tl.sum(c, axis=2, keep_dims=True) + eps)


@jit
def _back_by_columns(c, g, eps):
    """The gradient of ``_by_columns``'s input c from its output's g: with y = c / s (s the
    column sum + eps), dc = (g - sum over the column of g * y) / s."""
    s = tl.sum(c, axis=1, keep_dims=True) + eps
    return (g - tl.sum(g * (c / s), axis=1, keep_dims=True)) / s


@jit
def _back_by_rows(c, g, eps):
    s = tl.sum(c, axis=2, keep_dims=True) + eps
    return (g - tl.sum(g * (c / s), axis=2, keep_dims=True)) / s


@jit
def _softmax_rows(x):
    e = tl.exp(x - tl.max(x, axis=2, keep_dims=True))
    return e / tl.sum(e, axis=2, keep_dims=True)


@jit
def _local(N: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets of a program's [BLOCK, N, N] matrices from its first element."""
    t = tl.arange(0, BLOCK)
    i = tl.arange(0, N)
    return t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]


@jit
def _sinkhorn_forward_kernel(
    logits_ptr, out_ptr, n_values, eps, ITERS: tl.constexpr, N: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * (BLOCK * N * N) + _local(N, BLOCK)
    mask = offsets < n_values
    c = _softmax_rows(tl.load(logits_ptr + offsets, mask=mask, other=0.0)) + eps
    c = _by_columns(c, eps)
    for _ in range(ITERS - 1):
        c = _by_columns(_by_rows(c, eps), eps)
    tl.store(out_ptr + offsets, c, mask=mask)


@jit
def _sinkhorn_backward_kernel(
    logits_ptr, grad_ptr, dlogits_ptr, scratch_ptr, n_values, eps, ITERS: tl.constexpr,
    N: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    local = _local(N, BLOCK)
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * (BLOCK * N * N) + local
    mask = offsets < n_values
    # This program's scratch: normalisation k's input at [k, BLOCK, N, N]; k even divides the
    # columns, k odd the rows (2 * ITERS - 1 of them).
    scratch = scratch_ptr + pid * ((2 * ITERS - 1) * BLOCK * N * N) + local
    p = _softmax_rows(tl.load(logits_ptr + offsets, mask=mask, other=0.0))
    c = p + eps
    for i in range(ITERS - 1):
        tl.store(scratch + (2 * i) * (BLOCK * N * N), c)
        c = _by_columns(c, eps)
        tl.store(scratch + (2 * i + 1) * (BLOCK * N * N), c)
        c = _by_rows(c, eps)
    # The last normalisation's input is still in registers; the barrier makes every thread's
    # scratch writes visible to the threads that read them back below.
    tl.debug_barrier()
    g = _back_by_columns(c, tl.load(grad_ptr + offsets, mask=mask, other=0.0), eps)
    for j in range(ITERS - 1):
        i = ITERS - 2 - j
        g = _back_by_rows(tl.load(scratch + (2 * i + 1) * (BLOCK * N * N)), g, eps)
        g = _back_by_columns(tl.load(scratch + (2 * i) * (BLOCK * N * N)), g, eps)
    # Through the softmax (the + eps has no gradient).
    tl.store(dlogits_ptr + offsets, p * (g - tl.sum(g * p, axis=2, keep_dims=True)), mask=mask)


def _programs(n_values: int, n: int) -> int:
    return max(1, -(-(n_values // (n * n)) // _BLOCK))


@triton_op("torchloom::sinkhorn_backward")
def _sinkhorn_backward(
    comb_logits: torch.Tensor, grad: torch.Tensor, iterations: int, eps: float
) -> torch.Tensor:
    logits = comb_logits.contiguous()
    dlogits = torch.empty_like(logits)
    n = logits.shape[-1]
    programs = _programs(logits.numel(), n)
    scratch = logits.new_empty(programs * (2 * iterations - 1) * _BLOCK * n * n)
    wrap_triton(_sinkhorn_backward_kernel)[(programs,)](
        logits, grad.float().contiguous(), dlogits, scratch, logits.numel(), eps,
        ITERS=iterations, N=n, BLOCK=_BLOCK,
    )  # fmt: skip
    return dlogits


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: object) -> None:
    comb_logits, iterations, eps = inputs
    ctx.save_for_backward(comb_logits)
    ctx.iterations, ctx.eps = iterations, eps


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    (comb_logits,) = ctx.saved_tensors
    dlogits = torch.ops.torchloom.sinkhorn_backward(comb_logits, grad, ctx.iterations, ctx.eps)
    return dlogits, None, None


@triton_op("torchloom::sinkhorn", backward=_backward, setup_context=_setup_context)
def sinkhorn_triton(comb_logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """The Triton forward (fp32 logits [..., N, N], N a power of two; any device Triton runs
    on), with its Triton backward."""
    logits = comb_logits.contiguous()
    out = torch.empty_like(logits)
    n = logits.shape[-1]
    wrap_triton(_sinkhorn_forward_kernel)[(_programs(logits.numel(), n),)](
        logits, out, logits.numel(), eps, ITERS=iterations, N=n, BLOCK=_BLOCK
    )
    return out
