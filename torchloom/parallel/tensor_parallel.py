"""Applying a model's tensor-parallel plan, and the loss context that goes with it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from torchloom.config.errors import ConfigError
from torchloom.parallel.mesh import ParallelDims

TPPlan = Callable[[nn.Module, int, bool], dict[str, ParallelStyle]]
"""A model's plan: (model, tp degree, loss_parallel) -> {module path ("" = root): style}."""


def check_sequence_parallel(seq_len: int, tp: int) -> None:
    """Sequence parallelism splits every sequence into tp equal chunks."""
    if seq_len % tp:
        raise ConfigError(
            f"--training.seq_len {seq_len} is not divisible by --parallel.tp {tp}: sequence "
            f"parallelism splits each sequence into {tp} equal parts. Use a seq_len that is a "
            f"multiple of {tp} (e.g. {(seq_len // tp + 1) * tp})."
        )


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]
) -> None:
    """Distribute ``model`` in place over the 1-D ``mesh`` following ``plan``."""
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    for path, style in plan.items():
        parallelize_module(model.get_submodule(path), mesh, style)
    for name, param in model.named_parameters():
        if name in frozen:  # torch's styles make new parameters, trainable: keep them frozen
            param.requires_grad_(False)
        elif isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(_match_param_placements)


def _match_param_placements(param: torch.Tensor) -> None:
    # A replicated weight applied to sharded activations (sequence-parallel norms, per-head
    # q/k norms) gets a Partial gradient: each rank holds its tokens' or heads' share. FSDP
    # reduces these itself; without FSDP this hook sums them so the optimizer and clipping see
    # the true gradient. It is idempotent, so it is harmless where FSDP already did the work.
    grad = param.grad
    if (
        isinstance(grad, DTensor)
        and isinstance(param, DTensor)
        and grad.placements != param.placements
    ):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def loss_context(dims: ParallelDims) -> contextlib.AbstractContextManager:
    """Wrap the loss computation *and* its backward in this: with tensor parallelism and
    ``loss_parallel`` the cross-entropy then runs on vocabulary-sharded logits."""
    if dims.tp_enabled and dims.degrees.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()
