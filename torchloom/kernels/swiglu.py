"""The SwiGLU gate, silu(gate) * up: the PyTorch reference and fused Triton kernels.

``swiglu`` is the reference the model's MLP runs between its linears; ``swiglu_fused`` runs the
Triton kernels on CUDA (one read of gate and up, one write, and the same for the backward,
instead of an intermediate silu tensor) and the reference everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from torchloom.kernels.triton_support import jit, tl, triton, triton_op, use_triton

_BLOCK = 1024


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``swiglu`` by the Triton kernels on CUDA (when Triton is installed), else the reference."""
    if use_triton(gate):
        return torch.ops.torchloom.swiglu(gate, up)
    return swiglu(gate, up)


@jit
def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)  # as the reference
    tl.store(out_ptr + offsets, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _swiglu_backward_kernel(
    grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(dup_ptr.dtype.element_ty).to(tl.float32)
    dsilu = (dy * u).to(dgate_ptr.dtype.element_ty).to(tl.float32)  # rounded as autograd does
    tl.store(
        dgate_ptr + offsets,
        (dsilu * sig * (1 + g * (1 - sig))).to(dgate_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(dup_ptr + offsets, (dy * silu).to(dup_ptr.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} "
            f"{gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )


@triton_op("torchloom::swiglu_backward")
def _swiglu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.numel()
    wrap_triton(_swiglu_backward_kernel)[(triton.cdiv(n, _BLOCK),)](
        grad.contiguous(), gate.contiguous(), up.contiguous(), dgate, dup, n, BLOCK=_BLOCK
    )
    return dgate, dup


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: object) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors
    return torch.ops.torchloom.swiglu_backward(grad, gate, up)


@triton_op("torchloom::swiglu", backward=_backward, setup_context=_setup_context)
def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton forward (any device Triton runs on), with its Triton backward."""
    _check(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    wrap_triton(_swiglu_forward_kernel)[(triton.cdiv(n, _BLOCK),)](
        gate.contiguous(), up.contiguous(), out, n, BLOCK=_BLOCK
    )
    return out
