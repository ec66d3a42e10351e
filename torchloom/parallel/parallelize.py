"""The one entry point the trainer calls: apply every parallelism to a single-device model."""

from __future__ import annotations

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.transformer_plan import transformer_tp_plan
from torchloom.parallel.data_parallel import apply_data_parallel
from torchloom.parallel.mesh import ParallelDims
from torchloom.parallel.tensor_parallel import (
    TPPlan,
    apply_tensor_parallel,
    check_sequence_parallel,
)


def parallelize(
    model: nn.Module, dims: ParallelDims, *, seq_len: int, tp_plan: TPPlan = transformer_tp_plan
) -> nn.Module:
    """Tensor parallel, then data parallel (FSDP / HSDP / replication), in place; returns model.

    Call it on every rank with the same model, after its weights are initialized identically
    on every rank (tensor parallelism keeps rank 0's values) and before building the
    optimizer. ``tp_plan`` is the model family's plan (the shared decoder's by default).
    """
    config = dims.degrees
    for axis in ("cp", "pp", "ep"):
        if getattr(config, axis) > 1:
            raise ConfigError(
                f"--parallel.{axis} {getattr(config, axis)} is not implemented yet; this build "
                "supports dp_replicate, dp_shard and tp. Set it to 1."
            )
    if dims.tp_enabled:
        check_sequence_parallel(seq_len, config.tp)
        tp_mesh = dims.mesh("tp")
        assert tp_mesh is not None
        apply_tensor_parallel(model, tp_mesh, tp_plan(model, config.tp, config.loss_parallel))
    # Activation checkpointing and torch.compile slot in here: per block, after TP has
    # replaced the weights and before FSDP wraps the blocks.
    apply_data_parallel(model, dims)
    return model
