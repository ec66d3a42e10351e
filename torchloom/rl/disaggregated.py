"""Disaggregated placement: generator ranks and trainer ranks under one torchrun.

The first ``world - rl.generator_ranks`` processes train (a mesh over them alone: FSDP
``dp_shard``, ``tp``, ``cp``, ``ep``); the last ``rl.generator_ranks`` each hold a whole copy
of the model in the trainer's compute dtype and generate their share of every step's groups
(prompts are addressed by step and group, torchloom/rl/sources.py, so nothing sends them).
What travels:

- rollouts, from the generator ranks to every rank, as pickled objects on a gloo group of the
  whole world (``Link.objects``), sent from a thread of each generator rank so that it goes on
  generating the next batch meanwhile;
- weights, after an update, as full tensors (each gathered from the trainer's layout by the
  trainer ranks together) packed into flat buckets and broadcast from trainer rank 0 to the
  generator ranks (``Link.weights``, the job's backend: NCCL between GPUs). The sends are
  asynchronous, up to ``max_offpolicy_steps + 1`` versions in flight, so the trainer goes on to
  the next batch while they travel; the generator copies each bucket into its parameters in
  place when the lag bound needs that version.

Both sides follow one schedule (``policy_needed``), so every collective is met: the generator
generates batch s once it holds version ``max(start, s - 1 - max_offpolicy_steps)``; with
``max_offpolicy_steps`` 0 that is the policy trained on batch s - 1: synchronous, exactly
on-policy, and with k the generator runs up to k + 1 batches ahead. Checkpoints are taken by
every rank together (the generator ranks save only the step), each generator rank saving step
s before it receives version s + 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.generate.weights import copy_weights_
from torchloom.rl.config import RLConfig
from torchloom.rl.rollout import RolloutBatch


def trainer_ranks(rl: RLConfig) -> int:
    """How many processes of this torchrun job train (the first ones); 0 for colocated
    placement, where every process does both."""
    if rl.placement != "disaggregated":
        return 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world <= rl.generator_ranks:
        raise ConfigError(
            f"Disaggregated RL needs trainer ranks beside its --rl.generator_ranks "
            f"{rl.generator_ranks} generator ranks, but torchrun launched {world} process(es); "
            f"launch at least {rl.generator_ranks + 1} (torchrun --nproc-per-node N -m "
            "torchloom rl ...)."
        )
    return world - rl.generator_ranks


def policy_needed(step: int, start: int, lag: int) -> int:
    """The oldest policy version that may generate batch ``step`` of a run resumed at
    ``start`` (batch s trains version s - 1, at most ``lag`` updates behind it)."""
    return max(start, step - 1 - lag)


def last_version_sent(steps: int, lag: int) -> int:
    """The newest version the generator ever needs (the trainer sends versions up to it)."""
    return steps - 1 - lag


class Link:
    """The trainer ranks' and the generator ranks' side of the traffic between them. Every
    process creates it, at the same point (the groups are created collectively). ``in_flight``:
    how many versions the trainer may have on their way at once."""

    def __init__(self, trainers: int, device: torch.device, dtype: torch.dtype,
                 bucket_mb: int, in_flight: int = 1) -> None:  # fmt: skip
        world = dist.get_world_size()
        self.trainers, self.rank = trainers, dist.get_rank()
        self.generators = list(range(trainers, world))
        self.device, self.dtype = device, dtype
        self.bucket_bytes = bucket_mb * 2**20
        self.objects = dist.new_group(backend="gloo")
        self.weights = dist.new_group([0, *self.generators])
        self.max_in_flight = in_flight
        self._in_flight: list[list[Any]] = []  # per version sent: its works and buffers

    @property
    def is_generator(self) -> bool:
        return self.rank >= self.trainers

    @property
    def share_index(self) -> int:
        """This generator rank's place among the generator ranks."""
        return self.rank - self.trainers

    # -- prompts and rollouts -------------------------------------------------------------------

    def rollouts(self, part: RolloutBatch | None = None) -> RolloutBatch:
        """The generator ranks' parts of one batch, merged in group order, on every rank."""
        parts: list[RolloutBatch | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, part, group=self.objects)
        shares = [p for p in parts if p is not None]
        rollouts = sorted((r for p in shares for r in p.rollouts), key=lambda r: r.group)
        stats: dict[str, float] = {}
        for p in shares:
            for key, value in p.stats.items():
                combine = max if key == "refill_rounds" else sum
                stats[key] = combine((stats.get(key, 0), value))
        return RolloutBatch(rollouts, min(p.version for p in shares),
                            max(p.seconds for p in shares),
                            max(p.sync_seconds for p in shares), stats)  # fmt: skip

    # -- weights --------------------------------------------------------------------------------

    def send_weights(self, model: nn.Module) -> float:
        """Trainer ranks: gather every parameter whole and start sending it from rank 0 (the
        sends finish in the background); seconds spent here."""
        start = time.perf_counter()
        self.wait_sent(keep=self.max_in_flight - 1)
        params = dict(model.named_parameters())
        sends = []
        for names in self._buckets(model):
            fulls = [_full(params[n].detach()) for n in names]  # collective over the trainers
            if self.rank == 0:
                flat = torch.cat([t.reshape(-1).to(self.dtype) for t in fulls])
                work = dist.broadcast(flat, src=0, group=self.weights, async_op=True)
                sends.append((work, flat))
        self._in_flight.append(sends)
        return time.perf_counter() - start

    def wait_sent(self, keep: int = 0) -> None:
        """Trainer rank 0: wait until at most ``keep`` of the versions sent are still on their
        way (0: all have arrived)."""
        while len(self._in_flight) > keep:
            for work, _ in self._in_flight.pop(0):
                work.wait()

    def receive_weights(self, model: nn.Module) -> float:
        """Generator ranks: receive one version of every parameter into ``model`` in place;
        seconds spent (waiting included)."""
        start = time.perf_counter()
        params = dict(model.named_parameters())
        for names in self._buckets(model):
            flat = torch.empty(sum(params[n].numel() for n in names), dtype=self.dtype,
                               device=self.device)  # fmt: skip
            dist.broadcast(flat, src=0, group=self.weights)
            values = flat.split([params[n].numel() for n in names])
            copy_weights_(model, [(n, v.view(params[n].shape)) for n, v in zip(names, values)],
                          partial=True)  # fmt: skip
        return time.perf_counter() - start

    def _buckets(self, model: nn.Module) -> Iterator[list[str]]:
        """Parameter names in order, in runs of at most ``bucket_bytes`` (one parameter larger
        than that travels alone); the same on both sides, which hold the same names and
        shapes."""
        bucket, size, itemsize = [], 0, self.dtype.itemsize
        for name, param in model.named_parameters():
            nbytes = param.numel() * itemsize
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(name)
            size += nbytes
        if bucket:
            yield bucket


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly DTensor-sharded) parameter."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param
