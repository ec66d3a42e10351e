"""The one entry point the trainer calls: apply every parallelism to a single-device model."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.parallel.context_parallel import apply_context_parallel, check_context_parallel
from torchloom.parallel.data_parallel import apply_data_parallel
from torchloom.parallel.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    install_sequence_sums,
    moe_layers,
)
from torchloom.parallel.mesh import ParallelDims
from torchloom.parallel.tensor_parallel import (
    TPPlan,
    apply_tensor_parallel,
    check_sequence_parallel,
)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    seq_len: int,
    tp_plan: TPPlan = decoder_tp_plan,
    wrap_blocks: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Context and tensor parallel, expert parallel (MoE layers), then ``wrap_blocks(model)``
    (the trainer's recomputation and regional compile), then data parallel (FSDP / HSDP /
    replication; MoE layers' weights on their own meshes), in place; returns model.

    Call it on every rank with the same model, after its weights are initialized identically
    on every rank (tensor parallelism keeps rank 0's values) and before building the
    optimizer. ``tp_plan`` is the model family's plan (the shared decoder's by default).
    """
    config = dims.degrees
    # pp is applied by torchloom.parallel.pipeline, which calls this once per stage.
    check_expert_parallel(model, config.ep)
    if config.cp > 1:
        # Each rank holds seq_len / cp tokens (the trainer shards every batch with shard_sequence).
        check_context_parallel(seq_len, config.cp)
        cp_mesh = dims.mesh("cp")
        assert cp_mesh is not None
        apply_context_parallel(model, cp_mesh)
    if dims.tp_enabled:
        # The plan first: it refuses a tp that splits heads, which no seq_len would mend.
        plan = tp_plan(model, config.tp, config.loss_parallel)
        check_sequence_parallel(seq_len // config.cp, config.tp)
        tp_mesh = dims.mesh("tp")
        assert tp_mesh is not None
        apply_tensor_parallel(model, tp_mesh, plan)
    if moe_layers(model):
        install_sequence_sums(model, dims)
        if config.ep > 1:
            ep_mesh = dims.moe_meshes().ep
            assert ep_mesh is not None
            apply_expert_parallel(model, ep_mesh)
    if wrap_blocks is not None:
        # After TP has replaced the weights (compiled code sees DTensors) and before FSDP, whose
        # hooks then stay outside the recomputed and compiled regions.
        wrap_blocks(model)
    apply_data_parallel(model, dims)
    return model
