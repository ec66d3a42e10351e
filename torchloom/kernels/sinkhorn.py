"""Sinkhorn-Knopp normalisation of many small [N, N] matrices (DeepSeek-V4's hyper-connection
``comb``, one per token): the PyTorch reference and one Triton kernel each way.

``sinkhorn`` is the reference: a softmax over each row (+ eps), then ``iterations``
normalisations of the columns alternating with ``iterations - 1`` of the rows (columns first),
all in fp32. Compiled, its backward still launches a few kernels per iteration (a compiled
flash4 hyper-connection ran ~170 kernels a call, most of them the Sinkhorn's 1-2 us steps), so
on the GPU ``sinkhorn_fused`` runs the whole loop in one kernel per direction: a program holds
a block of tokens' matrices in registers. The backward keeps nothing from the forward but the
logits: to step back through normalisation k it recomputes that step's input from the softmax
(k steps forward), which costs O(iterations^2) register arithmetic per token and no memory
traffic beyond reading the logits and the gradient once.
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
def _softmax_rows(x):
    e = tl.exp(x - tl.max(x, axis=2, keep_dims=True))
    return e / tl.sum(e, axis=2, keep_dims=True)


@jit
def _offsets(N: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, N)
    return tokens[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]


@jit
def _sinkhorn_forward_kernel(
    logits_ptr, out_ptr, n_values, eps, ITERS: tl.constexpr, N: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = _offsets(N, BLOCK)
    mask = offsets < n_values
    c = _softmax_rows(tl.load(logits_ptr + offsets, mask=mask, other=0.0)) + eps
    c = _by_columns(c, eps)
    for _ in range(ITERS - 1):
        c = _by_columns(_by_rows(c, eps), eps)
    tl.store(out_ptr + offsets, c, mask=mask)


@jit
def _sinkhorn_backward_kernel(
    logits_ptr, grad_ptr, dlogits_ptr, n_values, eps, ITERS: tl.constexpr, N: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = _offsets(N, BLOCK)
    mask = offsets < n_values
    p = _softmax_rows(tl.load(logits_ptr + offsets, mask=mask, other=0.0))
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    # Normalisation k (0 .. 2 * ITERS - 2) divides columns when k is even, rows when odd.
    k = 2 * ITERS - 2
    while k >= 0:  # a while loop: Triton's interpreter rejects a runtime range() bound
        c = p + eps  # normalisation k's input: k steps from the softmax, as pairs
        pairs = 0
        while pairs < k // 2:
            c = _by_rows(_by_columns(c, eps), eps)
            pairs += 1
        c = tl.where(k % 2 == 1, _by_columns(c, eps), c)
        # y = c / (s + eps), s summed over one axis: dc = (dy - sum(dy * y)) / (s + eps).
        col_sum = tl.sum(c, axis=1, keep_dims=True) + eps
        row_sum = tl.sum(c, axis=2, keep_dims=True) + eps
        by_col = (g - tl.sum(g * (c / col_sum), axis=1, keep_dims=True)) / col_sum
        by_row = (g - tl.sum(g * (c / row_sum), axis=2, keep_dims=True)) / row_sum
        g = tl.where(k % 2 == 0, by_col, by_row)
        k -= 1
    tl.store(dlogits_ptr + offsets, p * (g - tl.sum(g * p, axis=2, keep_dims=True)), mask=mask)


def _launch(kernel, *tensors: torch.Tensor, n_values: int, iterations: int, eps: float) -> None:
    n = tensors[0].shape[-1]
    tokens = n_values // (n * n)
    grid = (max(1, -(-tokens // _BLOCK)),)
    wrap_triton(kernel)[grid](*tensors, n_values, eps, ITERS=iterations, N=n, BLOCK=_BLOCK)


@triton_op("torchloom::sinkhorn_backward")
def _sinkhorn_backward(
    comb_logits: torch.Tensor, grad: torch.Tensor, iterations: int, eps: float
) -> torch.Tensor:
    logits = comb_logits.contiguous()
    dlogits = torch.empty_like(logits)
    _launch(_sinkhorn_backward_kernel, logits, grad.float().contiguous(), dlogits,
            n_values=logits.numel(), iterations=iterations, eps=eps)  # fmt: skip
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
    _launch(_sinkhorn_forward_kernel, logits, out, n_values=logits.numel(),
            iterations=iterations, eps=eps)  # fmt: skip
    return out
