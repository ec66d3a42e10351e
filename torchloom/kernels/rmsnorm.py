"""RMSNorm (Zhang & Sennrich 2019): the PyTorch reference and a fused Triton kernel.

``rms_norm`` is the reference the model's ``RMSNorm`` runs: fp32 statistics, the normalized
row cast back to x's dtype, then multiplied by the weight (as Hugging Face does).
``rms_norm_fused`` runs the Triton kernels on CUDA and the reference everywhere else.

The forward kernel is batch-invariant: one program normalizes one whole row, with a block size
and warp count that depend only on the row length, so a row's output never depends on how many
rows share the call. The backward recomputes each row's statistics from x (no saved rstd) and
sums the weight's gradient in per-program fp32 partials.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from torchloom.kernels.triton_support import (
    jit,
    num_persistent_programs,
    tl,
    triton,
    triton_op,
    use_triton,
)

_MAX_ROW = 65536  # a whole row lives in one program's registers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the statistics in fp32 and the normalized x cast back first."""
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` by the Triton kernels on CUDA (when Triton is installed), else the reference."""
    if use_triton(x):
        return torch.ops.torchloom.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


@jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * n_cols may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _rms_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, eps, BLOCK: tl.constexpr
):
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    row = tl.program_id(0).to(tl.int64)
    while row < n_rows:  # a while loop: Triton's interpreter rejects a runtime range() bound
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        dw += dy * (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        # d loss / d normed, rounded where autograd rounds it in the reference.
        dn = (dy * w).to(dy_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty).to(tl.float32)
        dx = rstd * dn - (rstd * rstd * rstd / n_cols) * tl.sum(dn * x, axis=0) * x
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        row += tl.num_programs(0)
    tl.store(dw_partial_ptr + tl.program_id(0) * n_cols + cols, dw, mask=mask)


def _row_launch(n_cols: int) -> tuple[int, int]:
    """Block size (the whole row, rounded up to a power of two) and warps; both depend only on
    the row length, which is what keeps the forward batch-invariant."""
    if n_cols > _MAX_ROW:
        raise ValueError(f"the Triton RMSNorm handles rows up to {_MAX_ROW} wide, got {n_cols}")
    block = triton.next_power_of_2(n_cols)
    # Enough warps that the backward keeps a row in registers without spilling (ptxas, sm_90).
    return block, 4 if block < 2048 else 8 if block < 4096 else 16 if block < 8192 else 32


@triton_op("torchloom::rms_norm_backward")
def _rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x_ND = x.reshape(-1, n_cols).contiguous()
    dy_ND = dy.reshape(-1, n_cols).contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    programs = num_persistent_programs(x.device)
    dw_partial_PD = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    block, num_warps = _row_launch(n_cols)
    wrap_triton(_rms_norm_backward_kernel)[(programs,)](
        dy_ND, x_ND, weight.contiguous(), dx, dw_partial_PD, x_ND.shape[0], n_cols, eps,
        BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_partial_PD.sum(0).to(weight.dtype)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: object) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    dx, dweight = torch.ops.torchloom.rms_norm_backward(dy, x, weight, ctx.eps)
    return dx, dweight, None


@triton_op("torchloom::rms_norm", backward=_backward, setup_context=_setup_context)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton forward (any device Triton runs on), with its Triton backward."""
    n_cols = x.shape[-1]
    x_ND = x.reshape(-1, n_cols).contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    block, num_warps = _row_launch(n_cols)
    wrap_triton(_rms_norm_forward_kernel)[(x_ND.shape[0],)](
        x_ND, weight.contiguous(), y, n_cols, eps, BLOCK=block, num_warps=num_warps
    )
    return y
