"""Mixture-of-experts layers under parallelism: expert parallelism (``--parallel.ep``), the
all-to-all dispatcher, and the balance loss of sequences split over ranks.

An MoE layer is any module with a ``dispatcher`` (models/components/moe.py): it routes its
tokens, hands the (token, expert) pairs to ``dispatcher.dispatch``, runs its experts on the
rows it gets back (sorted by expert, ``ends_E`` marking each expert's last row) and puts the
outputs in order with ``dispatcher.combine``. ``LocalDispatch`` keeps every pair on the rank;
``AllToAllDispatch`` here sends each pair to the rank holding its expert.

Expert parallelism borrows ``ep`` of the dp_shard x cp ranks (it adds none; see
``MoEMeshes`` in mesh.py for the groups):

- **Weights.** Every parameter of ``layer.experts`` (stacked [num_experts, ...]) becomes a
  DTensor ``Shard(0)`` on the ep mesh: ep rank r holds experts r * E/ep .. (r+1) * E/ep - 1,
  whole. FSDP then shards them over the ranks holding the same experts (data_parallel.py), so
  their gradients are summed over exactly those ranks. Checkpoints see [num_experts, ...]
  tensors under the single-process names (DCP reshards between any ep), and the export
  gathers them whole (state.py).
- **Tokens.** Each rank sorts its pairs by expert, tells every ep rank how many pairs it
  sends to each of that rank's experts (one small all-to-all of counts), then sends the rows
  with ``all_to_all_single`` and the exact, uneven split sizes (no padding). The rows arrive
  grouped by source rank, then local expert; one stable sort on the device regroups them by
  local expert. ``combine`` undoes all of it, and its gradient is the same exchange reversed.
- **Host sync.** ``all_to_all_single`` takes its split sizes as Python integers, and the
  receiving buffer's size must be known to allocate it: the counts are read on the host once
  per layer and forward (``tolist``). That is inherent to variable-size all-to-all; everything
  else (sorting, regrouping, group ends) stays on the device. The grouped matrix product then
  runs on this rank's experts only (kernels/grouped_mm.py).

Under sequence parallelism (tp) and context parallelism (cp) each rank routes only its part of
every sequence. The layer's weights are then data-parallel over tp as well (mesh.py
``MoEMeshes.layer``), and the balance loss, a function of per-sequence statistics, gets them
summed over the ranks sharing the sequences (``SequenceShardSum``), so every layout computes
the single-process value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import MOE_FFNS
from torchloom.models.components.moe import LocalDispatch, permute_rows
from torchloom.parallel.mesh import ParallelDims


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of ``model`` (modules with a ``dispatcher``)."""
    return [m for m in model.modules() if hasattr(m, "dispatcher")]


def has_moe_layers(model: nn.Module) -> bool:
    """Whether the *whole* model has MoE layers (from its config, which every pipeline stage
    shares, so every rank answers alike even when its stage holds none)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "layer_specs"):
        return any(spec.ffn in MOE_FFNS for spec in config.layer_specs())
    return bool(moe_layers(model))


def check_expert_parallel(model: nn.Module, ep: int) -> None:
    """Refuse an ep the model cannot use: a model without MoE layers, or a degree that does not
    divide the experts (every rank holds whole experts)."""
    if ep == 1:
        return
    if not has_moe_layers(model):
        raise ConfigError(
            f"--parallel.ep {ep} needs a mixture-of-experts model, and this one has no MoE "
            "layers; set --parallel.ep 1."
        )
    config = getattr(model, "config", None)
    counts = {config.moe.num_experts} if hasattr(config, "moe") else set()
    counts |= {next(layer.experts.parameters()).shape[0] for layer in moe_layers(model)}
    for experts in sorted(counts):
        if experts % ep:
            fits = [d for d in range(2, experts + 1) if experts % d == 0]
            raise ConfigError(
                f"--parallel.ep {ep} does not divide num_experts {experts}: each expert-parallel "
                f"rank holds num_experts / ep whole experts. Choose ep among "
                f"{', '.join(map(str, fits))} (it must also divide dp_shard x cp)."
            )


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over ``ep_mesh`` (each rank keeps its own, whole) and
    give the layer an ``AllToAllDispatch`` over that group. Works on the meta device."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for layer in moe_layers(model):
        for module in layer.experts.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                per_rank = param.shape[0] // ep
                mine = param.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
                sharded = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)
                setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatcher = AllToAllDispatch(ep_mesh.get_group(), ep)


def install_sequence_sums(model: nn.Module, dims: ParallelDims) -> None:
    """Under tp (sequence parallel) or cp, let every MoE layer's balance loss see whole
    sequences (``SequenceShardSum``)."""
    tp, cp = dims.mesh("tp"), dims.mesh("cp")
    if tp is None and cp is None:
        return
    total = SequenceShardSum(
        None if tp is None else tp.get_group(), None if cp is None else cp.get_group()
    )
    for layer in moe_layers(model):
        layer.sequence_sum = total


# -- the all-to-all dispatcher ------------------------------------------------------------------


@dataclass
class _Route:
    """What ``combine`` needs to send the outputs back and put them in order."""

    order: tuple[torch.Tensor, torch.Tensor]
    """The local sort of the pairs by expert (LocalDispatch's route: order, inverse)."""
    regroup: torch.Tensor
    """Received row i of the by-expert layout is arrival row regroup[i]."""
    arrival: torch.Tensor
    """Its inverse: arrival row j is by-expert row arrival[j]."""
    sent: list[int]
    """Rows sent to each ep rank."""
    received: list[int]
    """Rows received from each ep rank."""


class AllToAllDispatch:
    """``LocalDispatch``'s contract over an expert-parallel group of ``ep`` ranks holding
    ``num_experts / ep`` experts each, in rank order: ``dispatch`` returns the rows for this
    rank's experts (from every rank) grouped by local expert, and the ends of those groups;
    ``combine`` returns every pair's output to the rank and position it came from."""

    def __init__(self, group: dist.ProcessGroup, ep: int) -> None:
        self.group, self.ep = group, ep
        self.local = LocalDispatch()

    @torch.compiler.disable  # the split sizes go to the host: compiled regions break here
    def dispatch(
        self, x_ND: torch.Tensor, experts_NK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, _Route]:
        ep, per_rank = self.ep, num_experts // self.ep
        x_sorted, ends_E, order = self.local.dispatch(x_ND, experts_NK, num_experts)
        counts_E = torch.diff(ends_E.long(), prepend=ends_E.new_zeros(1))
        # Counts first: arriving_RL[r, l] pairs rank r sends to this rank's l-th expert.
        arriving_RL = torch.empty_like(counts_E)
        dist.all_to_all_single(arriving_RL, counts_E, group=self.group)
        arriving_RL = arriving_RL.view(ep, per_rank)
        splits = torch.cat([counts_E.view(ep, per_rank).sum(1), arriving_RL.sum(1)]).tolist()
        sent, received = splits[:ep], splits[ep:]  # the one host sync
        arrived_MD = _AllToAll.apply(x_sorted, received, sent, self.group)
        # Arrival order is (source rank, local expert); the experts want (local expert, source).
        block_M = torch.repeat_interleave(
            torch.arange(ep * per_rank, device=x_ND.device),
            arriving_RL.flatten(),
            output_size=arrived_MD.shape[0],
        )
        regroup = (block_M % per_rank).argsort(stable=True)
        arrival = torch.empty_like(regroup)
        arrival[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        ends_L = arriving_RL.sum(0).cumsum(0).to(torch.int32)
        route = _Route(order, regroup, arrival, sent, received)
        return permute_rows(arrived_MD, regroup, arrival), ends_L, route

    @torch.compiler.disable
    def combine(self, y_MD: torch.Tensor, route: _Route, N: int) -> torch.Tensor:
        """[N, k, D]: every pair's output back on its token's rank, in (token, choice) order."""
        by_arrival_MD = permute_rows(y_MD, route.arrival, route.regroup)
        back_MD = _AllToAll.apply(by_arrival_MD, route.sent, route.received, self.group)
        return self.local.combine(back_MD, route.order, N)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its gradient goes back the same way."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


# -- the balance loss of split sequences --------------------------------------------------------


class SequenceShardSum:
    """Sums a balance loss's per-sequence statistics over the ranks that hold the other tokens
    of the same sequences: the tp ranks (sequence parallel) and the cp ranks. Every one of
    them then computes the single-process loss.

    Gradients flow back summed over cp only: each cp rank weights the term by its own label
    tokens and the cp ranks' losses add up, while every tp rank adds the same term to a loss
    that counts once (tensor parallelism's replicated loss)."""

    def __init__(self, tp: dist.ProcessGroup | None, cp: dist.ProcessGroup | None) -> None:
        self.tp, self.cp = tp, cp

    def __call__(self, stats: torch.Tensor) -> torch.Tensor:
        return _SumOverShards.apply(stats, self.tp, self.cp)


class _SumOverShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stats: torch.Tensor, tp, cp) -> torch.Tensor:
        ctx.cp = cp
        total = stats.clone()
        for group in (tp, cp):
            if group is not None:
                dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        if ctx.cp is not None:
            dist.all_reduce(grad, group=ctx.cp)
        return grad, None, None
