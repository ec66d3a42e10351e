"""Gradient-norm clipping over every parallel axis at once."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return that norm
    (before clipping) as a plain tensor, equal to the single-process norm of the same model.

    Gradients may be DTensors on different meshes (FSDP x TP on one, FSDP only on another) or
    plain tensors; DTensor cannot combine norms across meshes, so each mesh's gradients are
    reduced on their own and the per-mesh norms combined here. With pipeline parallelism each
    stage holds different parameters: pass ``pp_mesh`` to combine the stages' norms too.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    partial_norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        partial_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not partial_norms:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(partial_norms, norm_type)
    if pp_mesh is not None:
        total = _combine_over(total, norm_type, pp_mesh)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _combine_over(norm: torch.Tensor, norm_type: float, mesh: DeviceMesh) -> torch.Tensor:
    """The norm of the union of every rank's gradients along ``mesh`` (disjoint parameters)."""
    group = mesh.get_group()
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)
