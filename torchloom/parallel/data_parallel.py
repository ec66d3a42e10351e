"""Data parallelism with FSDP2 (``fully_shard``): FSDP, HSDP and plain replication.

One mechanism for all three. FSDP shards over the 1-D ``dp_shard_cp`` mesh; HSDP passes the
2-D (dp_replicate, dp_shard_cp) mesh, sharding within a replica and all-reducing across them;
replication is HSDP whose shard group is one rank. Replication is deliberately not DDP
(``torch.distributed._composable.replicate``): DDP does not take tensor-parallel DTensor
parameters, and FSDP2's own ``replicate`` is a private module whose signature differs between
torch 2.11 and 2.13. ``fully_shard`` composes with TP on both versions, gives one parameter
and state-dict form (DTensor) for every layout, and shares the mixed-precision policy.

Gradients are summed over data ranks, not averaged: the trainer divides each rank's token-loss
sum by the global label-token count, so the sum of the ranks' gradients is the gradient of the
global mean loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchloom.models.components.multimodal import media_encoder_names
from torchloom.parallel.config import ParallelConfig
from torchloom.parallel.expert_parallel import moe_layers
from torchloom.parallel.mesh import MoEMeshes, ParallelDims

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mixed_precision_policy(config: ParallelConfig, device_type: str) -> MixedPrecisionPolicy:
    """Compute (gathered) parameter dtype and gradient-reduction dtype; auto is bf16 on GPUs
    and fp32 on the CPU (the trainer first resolves auto to an explicit
    --training.mixed_precision: ``ParallelConfig.following``)."""
    param = config.mixed_precision_param
    if param == "auto":
        param = "bf16" if device_type == "cuda" else "fp32"
    return MixedPrecisionPolicy(
        param_dtype=_DTYPES[param], reduce_dtype=_DTYPES[config.mixed_precision_reduce]
    )


def apply_data_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """Shard (or replicate) ``model`` in place: each block, a vision encoder as one unit, then
    the embedding and the head, then the root, which holds whatever is left (with tied embeddings, the embedding: the head
    reads ``embed_tokens.weight`` from the root's forward, so it must be gathered there).

    A mixture-of-experts layer's weights that live on other meshes (``MoEMeshes``: experts under
    expert parallelism, the whole layer under tensor parallelism) get their own FSDP groups
    first, even without any other data parallelism (tp alone).
    """
    mesh, config = dims.fsdp_mesh, dims.degrees
    mp_policy = mixed_precision_policy(config, dims.device_type)
    policy = config.reshard_after_forward
    summed: list[nn.Module] = []

    def shard(
        module: nn.Module | list[nn.Module], on: DeviceMesh, default_reshard: bool, **kwargs
    ) -> None:
        ranks = on.size(on.ndim - 1)  # the shard dimension's (HSDP: after the replicate one)
        # Without sharding there is nothing to free; re-gathering would only copy.
        reshard = default_reshard and ranks > 1 if policy == "default" else policy == "always"
        fully_shard(module, mesh=on, mp_policy=mp_policy, reshard_after_forward=reshard, **kwargs)
        if on.size() > 1:
            summed.extend(module if isinstance(module, list) else [module])

    blocks = list(model.layers.values())
    moe = _moe_meshes(model, dims)
    if moe is not None:
        # Every MoE layer, in the blocks or elsewhere (DeepSeek-V3's multi-token prediction),
        # before the groups that contain it. Those of the blocks before the last are not needed
        # again before their backward.
        early = {id(m) for block in blocks[:-1] for m in moe_layers(block)}
        for layer in moe_layers(model):
            default_reshard = id(layer) in early
            if moe.ep is not None:
                assert moe.experts is not None
                placement = _expert_placement(moe.experts)
                shard(layer.experts, moe.experts, default_reshard, shard_placement_fn=placement)
            if moe.layer is not None:  # tp: the router and shared experts (and experts)
                shard(layer, moe.layer, default_reshard)
    if mesh is not None:
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again right at the start of backward.
            shard(block, mesh, default_reshard=i < len(blocks) - 1)
        for name in media_encoder_names(model):  # each media encoder: a unit, used once
            encoder = getattr(model, name)
            if encoder is not None:
                shard(encoder, mesh, default_reshard=True, shard_placement_fn=_beside_strided)
        if model.output is not None:  # untied: the embedding is used only at the start
            if model.embed_tokens is not None:
                shard(model.embed_tokens, mesh, default_reshard=True)
            head = [m for m in (model.norm, model.output) if m is not None]
            shard(head, mesh, default_reshard=False)
        shard(model, mesh, default_reshard=False)
    _sum_gradients(summed)


def _moe_meshes(model: nn.Module, dims: ParallelDims) -> MoEMeshes | None:
    """The MoE meshes when ``model``'s MoE layers need groups of their own."""
    if (dims.degrees.ep == 1 and not dims.tp_enabled) or not moe_layers(model):
        return None
    return dims.moe_meshes()


def _beside_strided(param: nn.Parameter) -> Shard | None:
    """A matrix split by tensor parallelism in strides (a fused qkv's) is sharded by FSDP along
    its other dimension: FSDP's own split of the same dimension would nest two strided splits,
    which DTensor does not describe (the gathered weights came out permuted)."""
    strided = isinstance(param, DTensor) and any(
        isinstance(p, _StridedShard) for p in param.placements
    )
    return Shard(1) if strided and param.ndim == 2 else None


def _expert_placement(mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard]:
    """FSDP shards experts' stacks by expert while each rank gets whole experts, else along
    their second dimension (fewer local experts than ranks would leave shards empty)."""
    ranks = mesh.size(mesh.ndim - 1)

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(0) if local.shape[0] % ranks == 0 else Shard(1)

    return placement


def shard_pipeline_stage(stage: nn.Module, dims: ParallelDims) -> None:
    """Make a pipeline stage's wrapper (around a model ``apply_data_parallel`` sharded) the FSDP
    root: torch's pipeline then defers gradient reduction to the last microbatch and keeps
    parameters gathered between the input- and weight-backward of zero-bubble schedules."""
    if dims.fsdp_mesh is None:
        return
    policy = mixed_precision_policy(dims.degrees, dims.device_type)
    fully_shard(stage, mesh=dims.fsdp_mesh, mp_policy=policy, reshard_after_forward=False)
    if dims.fsdp_mesh.size() > 1:
        _sum_gradients([stage])


def _sum_gradients(modules: list[nn.Module]) -> None:
    """Sum, not average, over the data ranks. Only for groups of more than one rank: with a
    divide factor set FSDP's one-rank path divides every gradient by it, even by 1.0 (one more
    pass over all of them)."""
    for module in modules:
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)
        # Plain sums also on gloo, which lacks the pre-multiplied sum a factor asks for.
        module.set_force_sum_reduction_for_comms(True)
