"""Tensor parallelism inside a token mixer whose heads are split over the tp ranks: the pieces
the linear-attention mixers (Gated DeltaNet, KDA), MLA, DSA and DeepSeek-V4's attention share
besides torch's column- and row-wise linears.

A mixer's plan shards its projections by heads (``ColwiseParallel``) and its output projection
row-wise. What is left are parameters the mixer uses directly in its forward, not through a
linear layer: convolution taps and gate constants, one row per head channel (sharded like the
heads: ``HeadParallel``, read with ``local_shard``), and a weight every head shares (the output
norm's: replicated, read with ``shared_by_heads``, whose gradient is summed over the ranks
because each rank applies it to its own heads only). Modules the whole mixer replicates are
``ReplicatedModule``. Two tensors cross between the shared part and the heads in the forward,
each through a module of its own: a key every head reads (its gradient summed over the ranks:
``SumInputGradient``) and a sum over the heads (summed over the ranks: ``SumOverRanks``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a head-sharded parameter inside a forward (differentiable; the
    parameter itself when there is no tensor parallelism)."""
    return param.to_local() if isinstance(param, DTensor) else param


def shared_by_heads(param: torch.Tensor) -> torch.Tensor:
    """A replicated parameter that this rank applies to its own heads only: its local value,
    with a gradient that is a partial sum (summed over the ranks before the optimizer sees it)."""
    if not isinstance(param, DTensor):
        return param
    return param.to_local(grad_placements=[Partial()] * param.device_mesh.ndim)


class HeadParallel(ParallelStyle):
    """Distribute the named parameters of a mixer (dotted paths below it) with the given
    placements, the values of tp rank 0; with ``gather_input``, also gather the
    sequence-parallel input (the first of the forward's ``inputs`` positional arguments) into
    a whole local tensor, as the attention mixers do. The mixer reads these parameters with
    ``local_shard`` / ``shared_by_heads``."""

    def __init__(self, params: dict[str, Placement], gather_input: bool, inputs: int = 4) -> None:
        super().__init__()
        self.params, self.gather_input, self.inputs = params, gather_input, inputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for path, placement in self.params.items():
            owner_path, _, name = path.rpartition(".")
            owner = module.get_submodule(owner_path)
            param = getattr(owner, name)
            distributed = distribute_tensor(param.data, device_mesh, [placement])
            owner.register_parameter(
                name, nn.Parameter(distributed, requires_grad=param.requires_grad)
            )
        if self.gather_input:
            others = (None,) * (self.inputs - 1)
            PrepareModuleInput(
                input_layouts=(Shard(1), *others),
                desired_input_layouts=(Replicate(), *others),
                use_local_output=True,
            )._apply(module, device_mesh)
        return module


class ReplicatedModule(ParallelStyle):
    """The module's parameters as replicated DTensors on the tp mesh; local tensors in and out
    (the module computes the same thing on every rank, e.g. a low-rank projection whose output
    feeds a column-wise layer: that layer sums its input's gradient over the ranks, so the
    replicated weights get their whole gradient on every rank)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                         for x in inputs)  # fmt: skip

        def to_local(_: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class SumInputGradient(ParallelStyle):
    """Identity forward on the first input; its gradient is summed over the tp ranks (a tensor
    every head shares, e.g. a shared key: each rank's heads give a part of its gradient)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partial_grad(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            shared = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            return (shared.to_local(grad_placements=[Partial()]), *inputs[1:])

        return distribute_module(module, device_mesh, input_fn=partial_grad)


class SumOverRanks(ParallelStyle):
    """The module's output, a partial sum on each tp rank, summed over the ranks (forward
    only: for a target that takes no gradient, e.g. attention summed over the local heads)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def all_reduce(_: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            partial = DTensor.from_local(output, mesh, [Partial()], run_check=False)
            return partial.redistribute(mesh, [Replicate()]).to_local()

        return distribute_module(module, device_mesh, output_fn=all_reduce)
