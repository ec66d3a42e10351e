"""The training step as a function of its parts and a batch: forward and backward of every
micro-batch through the objective, the gradient clip, the optimizer step (eager, or replayed
from one CUDA graph), and the validation loss.

The loss of a step is the objective's sum over the global batch divided by its global
normalizer (the label-token count for cross-entropy), so gradient accumulation and data
parallelism give the loss and gradients of one big batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from torchloom.data.packing import Batch, to_device
from torchloom.parallel import as_local, loss_context, max_over_data_ranks, sum_over_data_ranks
from torchloom.parallel.context_parallel import shard_sequence
from torchloom.parallel.mesh import ParallelDims
from torchloom.parallel.pipeline import Pipeline
from torchloom.train.cuda_graph import StepGraph
from torchloom.train.loss import LossOutput, Objective, without_auxiliary
from torchloom.train.optim import clip_gradients


def media_inputs(batch: Batch) -> dict[str, dict[str, torch.Tensor]]:
    """The ``media`` keyword of a multimodal batch's forward; none for text, so a text-only
    model's forward never sees it."""
    return {"media": batch.media} if batch.media else {}


class TrainingError(RuntimeError):
    """The run cannot go on (for example a non-finite loss); the message says what to change."""


@dataclass
class StepParts:
    """Everything one step touches."""

    model: nn.Module
    """The model, or a ModuleList of this rank's pipeline stages."""
    pipeline: Pipeline | None
    objective: Objective
    optimizer: torch.optim.Optimizer
    dims: ParallelDims
    device: torch.device
    max_norm: float
    """Clip the global gradient norm to this (inf: measure only)."""
    autocast_dtype: torch.dtype | None = None
    """bf16 autocast when data parallelism does not set the compute dtype itself."""
    expert_balance: Callable[[], dict[str, torch.Tensor]] | None = None
    """Run after every optimizer step: the MoE layers' loads and bias updates, returning their
    metrics (train/expert_balance.py); None for a model without MoE layers."""

    def after_update(self) -> dict[str, torch.Tensor]:
        return {} if self.expert_balance is None else self.expert_balance()

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """The step's autocast. ``cache=False`` casts the weights anew in every op instead of
        once per context: what a CUDA graph captured inside it must do, since a cached cast
        is freed when the context exits while the graph would keep reading it."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    def forward(self, batch: Batch) -> LossOutput:
        """The objective's output for one micro-batch (forward only; the caller backprops)."""
        targets = batch.fields(self.objective.fields)
        with self.autocast():
            return self.model(batch.tokens, batch.positions, batch.doc_ids,
                              objective=self.objective, targets=targets, **media_inputs(batch))  # fmt: skip

    @torch.no_grad()
    def score(self, batch: Batch, objective: Objective) -> object:
        """What ``objective`` returns for one micro-batch, without gradients (e.g. the labels'
        log-probabilities under the current weights, before an RL update changes them)."""
        with self.autocast(), loss_context(self.dims):
            return self.model(batch.tokens, batch.positions, batch.doc_ids, objective=objective,
                              targets=batch.fields(objective.fields), **media_inputs(batch))  # fmt: skip

    def normalizer(self, batches: Iterable[Batch]) -> torch.Tensor:
        """The global batch's normalizer: this rank's micro-batches' shares, summed over the
        data ranks (an int64 tensor on the device)."""
        local = sum(self.objective.normalizer(b) for b in batches)
        count = to_device(torch.as_tensor(local, dtype=torch.int64), self.device, non_blocking=True)
        return sum_over_data_ranks(count, self.dims)

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks and, under pipeline parallelism, from the last stage."""
        value = sum_over_data_ranks(value, self.dims)
        return value if self.pipeline is None else self.pipeline.reduce_over_stages(value)


def backward_and_clip(
    parts: StepParts, batches: list[Batch], normalizer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Accumulate the micro-batches' gradients and clip them; no host sync (a CUDA graph
    captures this). Returns (the global loss, the gradient norm before clipping, the
    objective's metrics divided as the loss is, and its maxima as maxima; none under pipeline
    parallelism)."""
    loss = torch.zeros((), device=parts.device)
    metrics: dict[str, torch.Tensor] = {}
    maxima: dict[str, torch.Tensor] = {}
    for batch in batches:
        if parts.pipeline is not None:
            with parts.autocast():
                loss += parts.pipeline.step(batch, normalizer)
            continue
        with loss_context(parts.dims):
            out = parts.forward(batch)
            micro = out.loss / normalizer
            micro.backward()
        loss += as_local(micro.detach())
        for name, value in out.metrics.items():
            metrics[name] = metrics.get(name, 0) + as_local(value).float() / normalizer
        for name, value in out.maxima.items():
            value = as_local(value).float()
            maxima[name] = torch.maximum(maxima[name], value) if name in maxima else value
    loss = parts.sum_over_ranks(loss)  # the same value on every rank
    if metrics:  # one collective for all of them
        names = sorted(metrics)
        summed = parts.sum_over_ranks(torch.stack([metrics[n] for n in names]))
        metrics = dict(zip(names, summed.unbind(0)))
    if maxima:
        names = sorted(maxima)
        highest = max_over_data_ranks(torch.stack([maxima[n] for n in names]), parts.dims)
        metrics |= dict(zip(names, highest.unbind(0)))
    pp_mesh = parts.dims.mesh("pp")
    norm = clip_gradients(parts.optimizer, parts.model.parameters(), parts.max_norm, pp_mesh)
    return loss, norm, metrics


class TrainStep:
    """One optimizer step over a step's micro-batches: ``step(batches) -> (loss, grad norm)``.

    ``before_update`` runs right before the optimizer changes the weights (the checkpointer
    waits there for an async save still copying them). A step is non-finite when its loss or
    its gradient norm is nan/inf. With ``skip_nonfinite`` such a step is skipped (a host sync
    before the update) and counted in ``skipped``; otherwise the update is queued first, so
    its launches overlap the backward on the GPU, and a check after it raises: at once, or
    with ``check_late`` when ``check()`` is called (a host sync the caller places, so the host
    can queue the next step while the GPU finishes this one).
    With ``cuda_graph`` the whole step is captured after a few eager steps and replayed.
    """

    def __init__(
        self,
        parts: StepParts,
        before_update: Callable[[], object],
        skip_nonfinite: bool = False,
        cuda_graph: bool = False,
        check_late: bool = False,
    ) -> None:
        self.parts, self.before_update, self.skip_nonfinite = parts, before_update, skip_nonfinite
        self.graph = StepGraph(self._captured, parts.optimizer) if cuda_graph else None
        self.check_late = check_late
        self.step = 0
        self.skipped = 0  # steps skip_nonfinite skipped
        # (step, [its loss, its gradient norm]) to check
        self._unchecked: list[tuple[int, torch.Tensor]] = []

    def __call__(
        self, batches: list[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(the global loss, the gradient norm before clipping, the objective's metrics; none
        from a captured step)."""
        self.step += 1
        parts, optimizer = self.parts, self.parts.optimizer
        normalizer = parts.normalizer(batches)
        if self.graph is not None:
            self.before_update()
            loss, norm = self.graph(batches, normalizer)
            metrics = {}
        else:
            loss, norm, metrics = backward_and_clip(parts, batches, normalizer)
            if not self.skip_nonfinite or self._finite(loss, norm):
                self.before_update()
                optimizer.step()
            else:
                self.skipped += 1
            optimizer.zero_grad(set_to_none=True)
        if not self.skip_nonfinite:  # checked after the update (a captured step cannot skip)
            # One small copy, no sync: it also outlives a captured step's output buffers,
            # which the next replay rewrites.
            self._unchecked.append((self.step, torch.stack([loss.float(), norm.float()])))
            if not self.check_late:
                self.check()
        return loss, norm, metrics | parts.after_update()

    def check(self, through: int | None = None) -> None:
        """Raise for the first non-finite step (loss or gradient norm) of the steps not yet
        checked, up to step ``through`` (default all): a host sync that waits for them."""
        unchecked = [(s, v) for s, v in self._unchecked if through is None or s <= through]
        if not unchecked:
            return
        self._unchecked = self._unchecked[len(unchecked) :]
        values = torch.stack([v for _, v in unchecked]).tolist()
        for (step, _), (loss, norm) in zip(unchecked, values):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise TrainingError(nonfinite_step_message(step, loss, norm))

    def _captured(
        self, batches: list[Batch], normalizer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step --training.cuda_graph captures: the same kernels as the eager step."""
        loss, norm, _ = backward_and_clip(self.parts, batches, normalizer)
        self.parts.optimizer.step()
        return loss, norm

    def _finite(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """Whether the loss and the gradient norm are finite (a host sync before the update:
        skip_nonfinite)."""
        return bool(torch.stack([loss.float(), norm.float()]).isfinite().all())


def nonfinite_step_message(step: int, loss: float, norm: float) -> str:
    """What to change when step ``step`` had a non-finite loss or gradient norm: a gradient
    that overflows under a finite loss points at the weights' scale, not at the data."""
    skip = "--training.skip_nonfinite true skips such steps instead."
    if math.isfinite(loss):
        return (
            f"The gradient norm became {norm} at step {step} while the loss was finite "
            f"({loss:.4g}): the backward pass overflowed, which points at the initialization "
            "(e.g. --model.overrides init_std) or the model more than at --optimizer.lr; " + skip
        )
    return (
        f"The loss became {loss} at step {step}. Lower --optimizer.lr, lengthen "
        f"--lr_schedule.warmup_steps or check the data; {skip}"
    )


def rank_batch(batch: Batch, dims: ParallelDims, device: torch.device) -> Batch:
    """The batch on this rank's device; under context parallelism, this rank's tokens."""
    batch = batch.to(device, non_blocking=True)
    if dims.degrees.cp > 1:
        rank, size = dims.local_rank("cp"), dims.size("cp")
        batch = batch.map_tokens(lambda t: shard_sequence(t, rank, size))
    return batch


@torch.no_grad()
def validation_loss(parts: StepParts, batches: Iterable[Batch]) -> float:
    """The objective's mean over held-out batches, without the layers' auxiliary terms (nan
    without any batch), on every rank."""
    total = torch.zeros((), device=parts.device)
    count = torch.zeros((), dtype=torch.int64, device=parts.device)
    parts.model.eval()
    for batch in batches:
        if parts.pipeline is not None:
            with parts.autocast():
                total += parts.pipeline.eval_loss_sum(batch)
        else:
            with loss_context(parts.dims):
                total += as_local(without_auxiliary(parts.forward(batch)))
        count += parts.objective.normalizer(batch)
    parts.model.train()
    # Every rank of a data group counts the same labels, so counts sum over data ranks only.
    total, count = parts.sum_over_ranks(total), sum_over_data_ranks(count, parts.dims)
    if not count:
        return float("nan")
    return (total / count).item()
