"""Summing token losses and label-token counts over the data ranks (the ``dp_cp`` group).

The global mean loss is sum(token losses) / count(label tokens) over the whole global batch.
Each rank divides its own sum by the *global* count (``global_label_count``); its gradients are
then its exact share, data parallelism sums them, and ``sum_over_data_ranks`` of the per-rank
losses is the global mean, identical to one process running the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchloom.parallel.mesh import ParallelDims


def as_local(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the full value of a DTensor (loss_parallel returns replicated DTensors)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


@torch.no_grad()
def sum_over_data_ranks(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The sum of ``value`` over the dp_cp ranks (a detached copy; ``value`` is left alone)."""
    total = as_local(value.detach()).clone()
    mesh = dims.mesh("dp_cp")
    if mesh is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return total


@torch.no_grad()
def max_over_data_ranks(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The elementwise maximum of ``value`` over the dp_cp ranks (a detached copy)."""
    highest = as_local(value.detach()).clone()
    mesh = dims.mesh("dp_cp")
    if mesh is not None:
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return highest


def global_label_count(
    local_count: int | torch.Tensor, dims: ParallelDims, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Label tokens (labels != ignore index) in the whole global batch, as an int64 tensor."""
    count = torch.as_tensor(local_count, dtype=torch.int64, device=device)
    return sum_over_data_ranks(count, dims)
