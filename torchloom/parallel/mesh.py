"""The process group and the one DeviceMesh every parallelism slices its axes from.

Axes, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost, so a TP group is the
fastest-connected set of ranks). Only axes of degree > 1 exist in the mesh, so a degree-1 axis
creates no process group and issues no collective; asking for it returns None. Flattened groups:

- ``dp``: dp_replicate x dp_shard, the ranks that read different data (data-loader rank/size);
- ``dp_shard_cp``: dp_shard x cp, the ranks FSDP shards parameters over;
- ``dp_cp``: dp_replicate x dp_shard x cp, the ranks whose token losses and counts are summed.

Mixture-of-experts layers have their own groups (``ParallelDims.moe_meshes``, built on first
use): expert parallelism's ``ep`` ranks and those that shard the same experts.

Flattened meshes are kept here rather than sliced back out of the root mesh by name: that
slicing is deprecated from torch 2.11 on, while ``DeviceMesh._flatten`` returns the new mesh in
both 2.11 and 2.13.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchloom.config.errors import ConfigError
from torchloom.parallel.config import ParallelConfig

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh axes, outermost first."""

FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
"""Named groups made of several axes."""


def init_distributed(device_type: str = "auto") -> torch.device:
    """Join the torchrun job (a no-op for a single process) and return this rank's device.

    Reads RANK / WORLD_SIZE / LOCAL_RANK from torchrun's environment. On GPUs each process
    takes ``cuda:LOCAL_RANK`` and NCCL; on the CPU, gloo. ``device_type`` is auto, cuda or cpu.
    """
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("A CUDA device was asked for, but no CUDA GPU is visible.")
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            # Binding the device lets the mesh split NCCL communicators instead of creating
            # each group from scratch.
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device


def destroy(barrier: bool = True) -> None:
    """Leave the process group (safe to call when none was joined), all ranks together unless
    ``barrier`` is False (after an error, when a peer may never arrive): a rank tearing gloo
    down while a peer is still finishing (rank 0 writing or printing) was seen to abort with
    "terminate called without an active exception" on the CPU. The same abort can still come
    at interpreter teardown: see ``leave``."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End this rank of a multi-process job now, without the interpreter's teardown, once its
    work is done, written and the group destroyed (``destroy``).

    DTensor's caches keep device meshes alive past ``destroy_process_group``, and the meshes
    their gloo groups; at teardown a gloo worker thread can wait for the GIL, be stopped, and
    abort the rank with "terminate called without an active exception" (SIGABRT) after every
    result was written: about one torchrun generation run in twenty on a loaded 2-core CPU.
    Only the standard streams need flushing here; every file is closed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class ParallelDims:
    """Resolved degrees plus the meshes of this rank; built by ``build_parallel_dims``."""

    degrees: ParallelConfig
    """The job's parallel section with dp_shard resolved."""
    world_size: int
    rank: int
    device_type: str
    world_mesh: DeviceMesh | None = None
    """The root mesh over the axes of degree > 1 (None for a single process)."""
    meshes: dict[str, DeviceMesh] = field(default_factory=dict)
    """Axis or flattened name -> 1-D mesh, only for groups of more than one rank."""
    fsdp_mesh: DeviceMesh | None = None
    """The mesh data parallelism runs on: 1-D (dp_shard_cp) for FSDP, 2-D (dp_replicate,
    dp_shard_cp) for HSDP and replication, None without data parallelism."""
    _moe: MoEMeshes | None = None

    def moe_meshes(self) -> MoEMeshes:
        """The groups of mixture-of-experts layers, created on the first call: a collective,
        so every rank makes it, models without MoE layers never (see ``MoEMeshes``)."""
        if self._moe is None:
            self._moe = _build_moe_meshes(self)
        return self._moe

    def mesh(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh of an axis or flattened group; None when it holds a single rank."""
        if name not in MESH_AXES and name not in FLATTENED:
            raise KeyError(f"unknown mesh name {name!r}; known: {MESH_AXES + tuple(FLATTENED)}")
        return self.meshes.get(name)

    def size(self, name: str) -> int:
        """Number of ranks in an axis or flattened group (1 when it does not exist)."""
        axes = FLATTENED.get(name, (name,))
        return math.prod(getattr(self.degrees, a) for a in axes)

    def local_rank(self, name: str) -> int:
        """This rank's index within an axis or flattened group."""
        mesh = self.mesh(name)
        return 0 if mesh is None else mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        """Ranks that read different data: the data loader's ``dp_size``."""
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        """This rank's share of the global batch: the data loader's ``dp_rank``."""
        return self.local_rank("dp")

    @property
    def is_rank0(self) -> bool:
        """Global rank 0: the one process that prints, logs and writes run files."""
        return self.rank == 0

    @property
    def tp_enabled(self) -> bool:
        return self.degrees.tp > 1


@dataclass
class MoEMeshes:
    """Where a mixture-of-experts layer's weights live (parallel/expert_parallel.py).

    Under sequence parallelism each tp rank routes its own tokens, so for an MoE layer the tp
    ranks are data ranks like dp_shard and cp: the layer's data ranks are dp_shard x cp x tp
    (times dp_replicate). Expert parallelism splits dp_shard x cp into ep groups of
    neighbouring ranks (stride tp), each rank of a group holding num_experts / ep experts; the
    dp_shard x cp x tp / ep ranks holding the same experts ("efsdp") shard them with FSDP.
    """

    ep: DeviceMesh | None
    """The ranks that exchange tokens, each holding different experts (None: ep 1)."""
    experts: DeviceMesh | None
    """What the routed experts' weights are data-parallel over: efsdp, or (dp_replicate,
    efsdp); with ep 1 and tp 1 the blocks' mesh; None without data parallelism."""
    layer: DeviceMesh | None
    """With tp > 1, what the layer's other weights (router, shared experts) are data-parallel
    over: dp_shard x cp x tp, or (dp_replicate, that); None with tp 1 (they stay in their
    block's FSDP group)."""


def _build_moe_meshes(dims: ParallelDims) -> MoEMeshes:
    degrees, root = dims.degrees, dims.world_mesh
    ep, tp, replicate, shard = (
        degrees.ep,
        degrees.tp,
        degrees.dp_replicate,
        dims.size("dp_shard_cp"),
    )
    if root is None or (ep == 1 and tp == 1):
        return MoEMeshes(None, dims.fsdp_mesh, None)
    names = [
        a for a in ("dp_replicate", "dp_shard", "cp", "tp") if a in (root.mesh_dim_names or ())
    ]
    data = root[tuple(names)]._flatten("moe_data") if len(names) > 1 else root[names[0]]
    layer = None
    if tp > 1:
        layer = data if replicate == 1 else data._unflatten(0, (replicate, shard * tp),
                                                            ("dp_replicate", "moe_shard"))  # fmt: skip
    if ep == 1:
        return MoEMeshes(None, layer, layer)
    split = data._unflatten(0, (replicate, shard // ep, ep, tp),
                            ("dp_replicate", "efsdp_dp", "ep", "efsdp_tp"))  # fmt: skip
    if tp == 1:
        experts = split["efsdp_dp"] if replicate == 1 else split["dp_replicate", "efsdp_dp"]
    else:
        efsdp = split["efsdp_dp", "efsdp_tp"]._flatten("efsdp")  # not neighbours: ep between
        experts = (
            efsdp if replicate == 1 else DeviceMesh._concatenate([split["dp_replicate"], efsdp])
        )
    return MoEMeshes(split["ep"], experts, layer)


def build_parallel_dims(
    config: ParallelConfig, device_type: str, ranks: int | None = None
) -> ParallelDims:
    """Resolve the degrees against the launched world and build the mesh on ``device_type``
    ("cuda" or "cpu"); call it on every rank, after ``init_distributed``.

    ``ranks``: lay the mesh over the first ``ranks`` processes only (the trainer's ranks of a
    disaggregated RL job, torchloom/rl/disaggregated.py). Every process still calls this, since
    creating a group is collective over the whole world; the others get dims they never use."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if ranks is not None:
        world_size = ranks
    degrees = config.resolve(world_size)
    if world_size == 1 and not degrees.fsdp_always:
        return ParallelDims(degrees, world_size, dist.get_rank() if dist.is_initialized() else 0,
                            device_type)  # fmt: skip
    if not dist.is_initialized():
        # FSDP on a single process still needs a process group: a one-rank one, no torchrun.
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(degrees, world_size, dist.get_rank(), device_type)
    sizes = {axis: getattr(degrees, axis) for axis in MESH_AXES}
    # Data parallelism with one rank per shard (pure replication, which runs as HSDP with a
    # one-rank shard group, see data_parallel.py; or --parallel.fsdp_always) keeps a
    # degree-1 dp_shard axis to shard over.
    unsharded = sizes["dp_shard"] * sizes["cp"] == 1
    replicate_only = sizes["dp_replicate"] > 1 and unsharded
    keep_shard_axis = unsharded and (replicate_only or degrees.fsdp_always)
    names = tuple(a for a in MESH_AXES if sizes[a] > 1 or (a == "dp_shard" and keep_shard_axis))
    shape = tuple(sizes[a] for a in names)
    if world_size == dist.get_world_size():
        dims.world_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    else:
        ranks_grid = torch.arange(world_size).view(shape)
        dims.world_mesh = DeviceMesh(device_type, ranks_grid, mesh_dim_names=names)
    dims.meshes = {a: dims.world_mesh[a] for a in names if sizes[a] > 1}
    flattened: dict[tuple[str, ...], DeviceMesh] = {}
    for name, axes in FLATTENED.items():
        present = tuple(a for a in axes if sizes[a] > 1)
        if len(present) == 1:  # the axis itself: no new process group
            dims.meshes[name] = dims.meshes[present[0]]
        elif present:  # equal axis sets (dp_cp == dp when cp is 1) share one group
            if present not in flattened:
                flattened[present] = dims.world_mesh[present]._flatten(name)
            dims.meshes[name] = flattened[present]
    dims.fsdp_mesh = _data_parallel_mesh(dims, replicate_only)
    return dims


def _data_parallel_mesh(dims: ParallelDims, replicate_only: bool) -> DeviceMesh | None:
    replicate, shard = dims.degrees.dp_replicate, dims.size("dp_shard_cp")
    if replicate == 1:
        if shard == 1 and dims.degrees.fsdp_always:
            assert dims.world_mesh is not None
            return dims.world_mesh["dp_shard"]
        return dims.mesh("dp_shard_cp")
    assert dims.world_mesh is not None
    if replicate_only or dims.degrees.cp == 1:
        return dims.world_mesh["dp_replicate", "dp_shard"]
    # dp_shard_cp is a flattened group, which cannot be sliced next to dp_replicate; unflatten
    # the data ranks instead (this duplicates the dp_replicate groups, only when cp > 1).
    return dims.meshes["dp_cp"]._unflatten(0, (replicate, shard), ("dp_replicate", "dp_shard_cp"))
