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
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != torch.bfloat16 or weight_EOD.dtype != torch.bfloat16:
        return False
    out_dim, in_dim = weight_EOD.shape[1:]
    if in_dim % 8 or out_dim % 8:  # 16-byte strides of bf16 rows and columns
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def grouped_linear(
    x_MD: torch.Tensor,
    weight_EOD: torch.Tensor,
    ends_E: torch.Tensor,
    invariant: bool = False,
) -> torch.Tensor:
    """[M, O]: row block e of ``x_MD`` (rows ends[e-1]..ends[e]) times ``weight_EOD[e]``
    transposed. ``ends_E`` is the int32 cumulative row count per group (ends[-1] <= M; rows
    past it are left zero)."""
    if x_MD.is_cuda and torch.is_autocast_enabled("cuda"):  # autocast does not cover it
        dtype = torch.get_autocast_dtype("cuda")
        x_MD, weight_EOD = x_MD.to(dtype), weight_EOD.to(dtype)
    if not invariant and grouped_mm_supported(x_MD, weight_EOD):
        return torch._grouped_mm(x_MD, weight_EOD.transpose(-2, -1), offs=ends_E)
    return _loop(x_MD, weight_EOD, ends_E, invariant)


def _loop(
    x_MD: torch.Tensor, weight_EOD: torch.Tensor, ends_E: torch.Tensor, invariant: bool
) -> torch.Tensor:
    """The reference: one matmul per group, the group bounds read on the host."""
    linear = batch_invariant.linear if invariant else F.linear
    bounds = [0, *ends_E.tolist()]
    pieces = [
        linear(x_MD[start:end], weight_EOD[e])
        for e, (start, end) in enumerate(itertools.pairwise(bounds))
        if end > start
    ]
    out_MO = torch.cat(pieces) if pieces else x_MD.new_zeros(0, weight_EOD.shape[1])
    if bounds[-1] == x_MD.shape[0]:
        return out_MO
    tail = x_MD.new_zeros(x_MD.shape[0] - bounds[-1], weight_EOD.shape[1])
    return torch.cat([out_MO, tail.to(out_MO.dtype)])
