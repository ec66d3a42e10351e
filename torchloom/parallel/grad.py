"""Gradient-norm clipping over every parallel axis at once."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchloom.kernels.adamw import squared_norm_partials
from torchloom.kernels.triton_support import use_triton


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return that norm
    (before clipping) as a plain tensor, equal to the single-process norm of the same model.
    See ``grad_norm`` for the meshes; an optimizer that folds the clip into its step takes
    ``clip_coefficient(grad_norm(...), max_norm)`` instead of this pass over the gradients."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, norm_type, pp_mesh)
    # One call per mesh: DTensor's foreach ops refuse tensors of different meshes (expert
    # weights live on the expert-parallel mesh, the rest on FSDP's).
    for group in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.Tensor] = (),
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
    triton_kernel: bool = False,
    grads: Iterable[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The global norm of the parameters' gradients as a plain tensor, equal to the
    single-process norm of the same model; no host sync.

    Gradients may be DTensors on different meshes (FSDP x TP on one, FSDP only on another) or
    plain tensors; DTensor cannot combine norms across meshes, so each mesh's gradients are
    reduced on their own and the per-mesh norms combined here. With pipeline parallelism each
    stage holds different parameters: pass ``pp_mesh`` to combine the stages' norms too. With
    ``triton_kernel`` (the Triton AdamW's companion), plain CUDA gradients' 2-norm is summed by
    one Triton kernel per gradient into fp32 per-block partials (kernels/adamw.py): one read of
    each gradient, the same total every run; otherwise torch's ``get_total_norm``. ``grads``
    gives the gradients themselves instead of ``parameters`` (e.g. ones held in bf16 apart
    from ``.grad``).
    """
    if grads is None:
        grads = [p.grad for p in parameters if p.grad is not None]
    grads = list(grads)
    partial_norms = []
    for mesh, group in _by_mesh(grads).items():
        if triton_kernel and mesh is None and norm_type == 2.0 and _triton_norm(group):
            partial_norms.append(squared_norm_partials(group).sum().sqrt())
            continue
        if mesh is not None and "ep" in (mesh.mesh_dim_names or ()):
            partial_norms.extend(_expert_norms(group, norm_type, mesh))
            continue
        norm = _total_norm(group, norm_type)
        partial_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not partial_norms:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(partial_norms, norm_type)
    if pp_mesh is not None:
        total = _combine_over(total, norm_type, pp_mesh)
    return total


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch's ``get_total_norm``; gradients of several dtypes (some held in bf16) are each
    measured in fp32, in order, where torch would measure the bf16 ones in bf16."""
    if len({g.dtype for g in grads}) == 1:
        return torch.nn.utils.get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _by_mesh(tensors: list[torch.Tensor]) -> dict[DeviceMesh | None, list[torch.Tensor]]:
    """``tensors`` grouped by DTensor mesh (None: plain tensors)."""
    groups: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return groups


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_grad_norm_`` multiplies every gradient by (at most 1), as an fp32 tensor."""
    return (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)


def _triton_norm(grads: list[torch.Tensor]) -> bool:
    """Plain contiguous CUDA gradients on one device, and Triton to sum them."""
    device = grads[0].device
    return use_triton(grads[0]) and all(g.device == device and g.is_contiguous() for g in grads)


def _expert_norms(
    grads: list[torch.Tensor], norm_type: float, mesh: DeviceMesh
) -> list[torch.Tensor]:
    """Norms of gradients on an expert-parallel mesh (FSDP's dims, then ep), from their local
    shards combined over every mesh dim that splits them. DTensor's own reduction cannot run
    there (torch 2.13): it tries to merge the per-dim all-reduces into one over a flattened
    mesh, and slicing that mesh fails when ep sits between FSDP's dims (tp inside efsdp)."""
    by_split: dict[tuple[bool, ...], list[torch.Tensor]] = {}
    for grad in grads:
        if any(p.is_partial() for p in grad.placements):
            raise AssertionError(f"unreduced gradient on the expert mesh: {grad.placements}")
        # Shard and _StridedShard (FSDP over an ep-sharded dim) both split the tensor.
        by_split.setdefault(tuple(not p.is_replicate() for p in grad.placements), []).append(grad)
    norms = []
    for split, group in by_split.items():
        norm = torch.nn.utils.get_total_norm([g.to_local() for g in group], norm_type)
        for dim, sharded in enumerate(split):
            if sharded:
                norm = _combine_over(norm, norm_type, mesh.get_group(dim))
        norms.append(norm)
    return norms


def _combine_over(
    norm: torch.Tensor, norm_type: float, over: DeviceMesh | dist.ProcessGroup
) -> torch.Tensor:
    """The norm of the union of every rank's gradients along ``over`` (disjoint parameters)."""
    group = over.get_group() if isinstance(over, DeviceMesh) else over
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm**norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered ** (1.0 / norm_type)
