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

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchloom.parallel.config import ParallelConfig
from torchloom.parallel.mesh import ParallelDims

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mixed_precision_policy(config: ParallelConfig, device_type: str) -> MixedPrecisionPolicy:
    """Compute (gathered) parameter dtype and gradient-reduction dtype; auto is bf16 on GPUs."""
    param = config.mixed_precision_param
    if param == "auto":
        param = "bf16" if device_type == "cuda" else "fp32"
    return MixedPrecisionPolicy(
        param_dtype=_DTYPES[param], reduce_dtype=_DTYPES[config.mixed_precision_reduce]
    )


def apply_data_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """Shard (or replicate) ``model`` in place: each block, then the embedding and the head,
    then the root, which holds whatever is left (with tied embeddings, the embedding: the head
    reads ``embed_tokens.weight`` from the root's forward, so it must be gathered there).
    """
    mesh, config = dims.fsdp_mesh, dims.degrees
    if mesh is None:
        return
    replicate_only = dims.size("dp_shard_cp") == 1
    policy = config.reshard_after_forward
    mp_policy = mixed_precision_policy(config, dims.device_type)

    def reshard(default: bool) -> bool:
        # Without sharding there is nothing to free; re-gathering would only copy.
        if policy == "default":
            return default and not replicate_only
        return policy == "always"

    def shard(module: nn.Module | list[nn.Module], default_reshard: bool) -> None:
        fully_shard(
            module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard(default_reshard)
        )

    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right at the start of backward.
        shard(block, default_reshard=i < len(blocks) - 1)
    if model.output is not None:  # untied: the embedding is used only at the start of forward
        if model.embed_tokens is not None:
            shard(model.embed_tokens, default_reshard=True)
        shard([m for m in (model.norm, model.output) if m is not None], default_reshard=False)
    shard(model, default_reshard=False)
    _sum_gradients(model, mesh)


def shard_pipeline_stage(stage: nn.Module, dims: ParallelDims) -> None:
    """Make a pipeline stage's wrapper (around a model ``apply_data_parallel`` sharded) the FSDP
    root: torch's pipeline then defers gradient reduction to the last microbatch and keeps
    parameters gathered between the input- and weight-backward of zero-bubble schedules."""
    if dims.fsdp_mesh is None:
        return
    policy = mixed_precision_policy(dims.degrees, dims.device_type)
    fully_shard(stage, mesh=dims.fsdp_mesh, mp_policy=policy, reshard_after_forward=False)
    _sum_gradients(stage, dims.fsdp_mesh)


def _sum_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    if mesh.size() == 1:
        # One rank: sum and mean agree, and with a divide factor set FSDP's one-rank path
        # divides every gradient by it, even by 1.0 (one more pass over all of them).
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain sums also on gloo, which lacks the pre-multiplied sum a factor asks for.
            module.set_force_sum_reduction_for_comms(True)
