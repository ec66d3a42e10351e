"""Rotary embedding application: the PyTorch reference and a fused Triton kernel.

Hugging Face "rotate half" layout: channel i of a head turns together with channel i + d/2.
``apply_rotary`` is the reference the model's attention runs; ``apply_rotary_fused`` runs the
Triton kernel on CUDA and the reference everywhere else. One kernel serves both directions:
the backward is the transposed rotation, i.e. the rotation by -sin with each half taking the
other half's sine (the same as by -sin when both halves hold the same angles, as RoPE's do).
cos/sin get no gradient (they come from positions).
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from torchloom.kernels.triton_support import jit, tl, triton, triton_op, use_triton

_HEADS_PER_PROGRAM = 16


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim: a 90 degree turn of every (i, i + d/2) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x_BTHd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor
) -> torch.Tensor:
    """Rotate every head of ``x`` by its token's angles.

    cos/sin are cast to x's dtype first, as Hugging Face does, so bf16 runs match it too.
    """
    cos_BT1d = cos_BTd.to(x_BTHd.dtype).unsqueeze(2)
    sin_BT1d = sin_BTd.to(x_BTHd.dtype).unsqueeze(2)
    return x_BTHd * cos_BT1d + rotate_half(x_BTHd) * sin_BT1d


def apply_rotary_fused(
    x_BTHd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor
) -> torch.Tensor:
    """``apply_rotary`` by the Triton kernel on CUDA (when Triton is installed), else the
    reference."""
    if use_triton(x_BTHd):
        return torch.ops.torchloom.apply_rotary(x_BTHd, cos_BTd, sin_BTd)
    return apply_rotary(x_BTHd, cos_BTd, sin_BTd)


@jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, half,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # token * n_heads * head_dim may pass 2**31
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_mask = cols < half
    # cos/sin rounded to x's dtype first, as the reference does.
    angle = token * 2 * half + cols
    c1 = tl.load(cos_ptr + angle, mask=col_mask).to(x_ptr.dtype.element_ty).to(tl.float32)
    c2 = tl.load(cos_ptr + angle + half, mask=col_mask).to(x_ptr.dtype.element_ty).to(tl.float32)
    s1 = tl.load(sin_ptr + angle, mask=col_mask).to(x_ptr.dtype.element_ty).to(tl.float32)
    s2 = tl.load(sin_ptr + angle + half, mask=col_mask).to(x_ptr.dtype.element_ty).to(tl.float32)
    if BACKWARD:  # the transpose: each half is turned by minus the other half's sine
        s1, s2 = -s2, -s1
    mask = (heads < n_heads) & col_mask
    offsets = (token * n_heads + heads) * 2 * half + cols
    x1 = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + offsets + half, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offsets + half, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(
    x_BTHd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor, backward: bool
) -> torch.Tensor:
    B, T, H, d = x_BTHd.shape
    x_NHd = x_BTHd.reshape(B * T, H, d).contiguous()
    cos_Nd = cos_BTd.expand(B, T, d).reshape(B * T, d).contiguous()
    sin_Nd = sin_BTd.expand(B, T, d).reshape(B * T, d).contiguous()
    out_BTHd = torch.empty(x_BTHd.shape, dtype=x_BTHd.dtype, device=x_BTHd.device)
    block_h = min(triton.next_power_of_2(H), _HEADS_PER_PROGRAM)
    grid = (B * T, triton.cdiv(H, block_h))
    wrap_triton(_rotary_kernel)[grid](
        x_NHd, cos_Nd, sin_Nd, out_BTHd, H, d // 2,
        BACKWARD=backward, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(d // 2),
    )  # fmt: skip
    return out_BTHd


@triton_op("torchloom::apply_rotary_backward")
def _apply_rotary_backward(
    grad_BTHd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor
) -> torch.Tensor:
    return _rotate(grad_BTHd, cos_BTd, sin_BTd, backward=True)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: object) -> None:
    _, cos_BTd, sin_BTd = inputs
    ctx.save_for_backward(cos_BTd, sin_BTd)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_BTHd: torch.Tensor) -> tuple:
    cos_BTd, sin_BTd = ctx.saved_tensors
    return torch.ops.torchloom.apply_rotary_backward(grad_BTHd, cos_BTd, sin_BTd), None, None


@triton_op("torchloom::apply_rotary", backward=_backward, setup_context=_setup_context)
def apply_rotary_triton(
    x_BTHd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor
) -> torch.Tensor:
    """The Triton rotation (any device Triton runs on), with its Triton backward."""
    return _rotate(x_BTHd, cos_BTd, sin_BTd, backward=False)
