"""Grouped matrix products for mixture-of-experts layers: rows sorted by group (expert), each
group multiplied by its own weight, in one kernel where the device has one.

``grouped_linear(x_MD, weight_EOD, ends_E)`` computes, for every group e, the rows
``x[ends[e-1]:ends[e]] @ weight[e].T``. On a CUDA device of compute capability 9.0 or newer
with bf16 operands whose inner dimensions keep 16-byte strides, that is ``torch._grouped_mm``
(one launch, no host synchronisation: the group ends stay on the device). Everywhere else it is
a loop of ordinary matmuls over the groups (it reads the group ends on the host), and in
batch-invariant mode a loop of the fixed-order linear, so a row's result never depends on the
other rows of its group.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from torchloom.kernels import batch_invariant


def grouped_mm_supported(x: torch.Tensor, weight_EOD: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands (device, dtype and alignment)."""
    dtypes = (x.dtype, weight_EOD.dtype)
    return _grouped_mm_runs(x.device, dtypes, weight_EOD.shape)


def reads_group_ends_on_host(dtype: torch.dtype, weight_EOD: torch.Tensor, invariant: bool) -> bool:
    """Whether ``grouped_linear`` with both operands in ``dtype`` (the weights' own, or the
    autocast dtype) takes the loop, which reads the group ends on the host, so that no CUDA
    graph can capture it."""
    return invariant or not _grouped_mm_runs(weight_EOD.device, (dtype, dtype), weight_EOD.shape)


def _grouped_mm_runs(
    device: torch.device, dtypes: tuple[torch.dtype, torch.dtype], shape_EOD: torch.Size
) -> bool:
    if not (device.type == "cuda" and hasattr(torch, "_grouped_mm")):
        return False
    if any(dtype != torch.bfloat16 for dtype in dtypes):
        return False
    out_dim, in_dim = shape_EOD[1:]
    if in_dim % 8 or out_dim % 8:  # 16-byte strides of bf16 rows and columns
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def grouped_linear(
    x_MD: torch.Tensor,
    weight_EOD: torch.Tensor,
    ends_E: torch.Tensor,
    invariant: bool = False,
) -> torch.Tensor:
    """[M, O]: row block e of ``x_MD`` (rows ends[e-1]..ends[e]) times ``weight_EOD[e]``
    transposed. ``ends_E`` is the int32 cumulative row count per group, and every row belongs
    to one: ends[-1] == M (``torch._grouped_mm`` leaves rows past the last end unwritten, so
    the loop refuses them rather than give the two paths different answers)."""
    device = x_MD.device.type
    if torch.is_autocast_enabled(device):  # autocast does not reach inside either path
        dtype = torch.get_autocast_dtype(device)
        x_MD, weight_EOD = x_MD.to(dtype), weight_EOD.to(dtype)
    if not invariant and grouped_mm_supported(x_MD, weight_EOD):
        return torch._grouped_mm(x_MD, weight_EOD.transpose(-2, -1), offs=ends_E)
    return torch.ops.torchloom.grouped_linear_loop(
        x_MD, weight_EOD.to(x_MD.dtype), ends_E, invariant
    )


# The reference as custom ops: opaque to the compiler (their row counts are data-dependent), so
# a compiled region keeps them as one call instead of breaking its graph.


def _bounds(ends_E: torch.Tensor, rows: int) -> list[tuple[int, int, int]]:
    """(group, first row, end row) of every non-empty group, read on the host."""
    bounds = [0, *ends_E.tolist()]
    if bounds[-1] != rows:
        raise ValueError(f"grouped_linear: the groups end at row {bounds[-1]} of {rows}; "
                         "every row must belong to a group (ends[-1] == rows)")  # fmt: skip
    return [(e, lo, hi) for e, (lo, hi) in enumerate(itertools.pairwise(bounds)) if hi > lo]


@torch.library.custom_op("torchloom::grouped_linear_loop", mutates_args=())
def _loop(
    x_MD: torch.Tensor, weight_EOD: torch.Tensor, ends_E: torch.Tensor, invariant: bool
) -> torch.Tensor:
    """One matmul per group (the fixed-order linear when ``invariant``)."""
    linear = batch_invariant.linear if invariant else F.linear
    out_MO = x_MD.new_zeros(x_MD.shape[0], weight_EOD.shape[1])
    for e, lo, hi in _bounds(ends_E, x_MD.shape[0]):
        out_MO[lo:hi] = linear(x_MD[lo:hi], weight_EOD[e])
    return out_MO


@_loop.register_fake
def _(x_MD, weight_EOD, ends_E, invariant):
    return x_MD.new_empty(x_MD.shape[0], weight_EOD.shape[1])


@torch.library.custom_op("torchloom::grouped_linear_loop_backward", mutates_args=())
def _loop_backward(
    grad_MO: torch.Tensor, x_MD: torch.Tensor, weight_EOD: torch.Tensor, ends_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_w = torch.zeros_like(x_MD), torch.zeros_like(weight_EOD)
    for e, lo, hi in _bounds(ends_E, x_MD.shape[0]):
        grad_x[lo:hi] = grad_MO[lo:hi] @ weight_EOD[e]
        grad_w[e] = grad_MO[lo:hi].T @ x_MD[lo:hi]
    return grad_x, grad_w


@_loop_backward.register_fake
def _(grad_MO, x_MD, weight_EOD, ends_E):
    return torch.empty_like(x_MD), torch.empty_like(weight_EOD)


def _save(ctx, inputs, output) -> None:
    x_MD, weight_EOD, ends_E, _ = inputs
    ctx.save_for_backward(x_MD, weight_EOD, ends_E)


def _backward(ctx, grad_MO):
    x_MD, weight_EOD, ends_E = ctx.saved_tensors
    grad_x, grad_w = _loop_backward(grad_MO.contiguous(), x_MD, weight_EOD, ends_E)
    return grad_x, grad_w, None, None


_loop.register_autograd(_backward, setup_context=_save)
