"""Where a step's rollouts come from, and when: the three placements' rollout sources, and
dynamic sampling (``collect``), which all of them share.

Prompts are addressed, not streamed: group ``j`` of step ``s`` is prompt ``prompt_index(s, j)``
of the task's seeded source, so any rank can draw any step's prompts and a resumed run draws
the same ones without saved stream state. Groups ``0 .. prompts_per_step - 1`` come first;
dynamic sampling's refills continue at ``prompts_per_step``, ``prompts_per_step + 1``, ...

- ``OnPolicy`` (colocated, ``max_offpolicy_steps`` 0): the trainer's own modules generate
  step s's batch right before step s trains.
- ``Lagged`` (colocated, k > 0): a generator thread on a copy of the weights generates batch s
  once the policy is at most k updates behind step s's, pulling the newest policy first.
- ``Remote`` (disaggregated, trainer side) and ``serve`` (generator side): the generator ranks
  run up to k + 1 batches ahead, each handing its batches over from a sender thread while it
  generates the next, and receive the versions they need as they need them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from torchloom.rl.batches import informative, shaped_reward
from torchloom.rl.config import RLConfig
from torchloom.rl.disaggregated import last_version_sent, policy_needed
from torchloom.rl.rollout import Rollout, RolloutBatch

if TYPE_CHECKING:
    from torchloom.rl.loop import RLRunner

_STEP_STRIDE = 2**20
"""Prompt indices per step: room for every group a step could ever draw."""


def prompt_index(step: int, group: int) -> int:
    """The source index of group ``group``'s prompt at step ``step``."""
    return step * _STEP_STRIDE + group


def step_stats(rollouts: list[Rollout], cfg: RLConfig, groups: int) -> dict[str, float]:
    """Sums over a round of generation (merged parts and refill rounds add up)."""
    return {
        "rollouts": len(rollouts), "groups_generated": groups,
        "reward_sum": sum(r.reward for r in rollouts),
        "shaped_reward_sum": sum(shaped_reward(r, cfg) for r in rollouts),
        "correct_sum": sum(float(r.info.get("correct", r.reward >= 1.0)) for r in rollouts),
        "generated_tokens": sum(r.generated for r in rollouts),
        "truncated": sum(r.truncated for r in rollouts),
    }  # fmt: skip


def add_stats(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    return {k: total.get(k, 0) + more.get(k, 0) for k in {*total, *more}}


REFILL_MARGIN = 1.5
"""A refill round generates this many times the groups the rate kept so far says are missing:
sized exactly, a round falls short about half the time (the kept count is binomial) and the
batch then needs another round or stays short; the surplus groups cost little, decoded in the
same batch."""

REFILL_ROUND_GROUPS = 16
"""A refill round generates at most this many times prompts_per_step groups (while none has
been kept, the rate is taken as 1 in all generated so far, which reaches the cap at once):
late in countdown ~2% of groups vary, and rounds capped at 4x could then find only ~13 of 16
in ten rounds; early, at ~1%, first rounds of 4x left 27 of 200 simulated batches short. A round decodes in waves of the generator's
slots, so its size bounds the step's time, not its memory."""


def collect(
    generate: Callable[[list[int]], RolloutBatch], first: list[int], more: Iterator[int],
    cfg: RLConfig,
) -> RolloutBatch:  # fmt: skip
    """The groups ``first`` generated; with ``cfg.filter_zero_variance``, only those whose
    rewards differ, refilled from the groups ``more`` yields (each round sized by the rate
    kept so far, with REFILL_MARGIN to spare) until there are ``len(first)`` or
    ``cfg.max_refill_rounds`` rounds were run.
    ``stats`` counts every rollout generated; ``reward_*`` of the first round alone is the
    policy's unbiased reward."""
    batch = generate(first)
    first_round = step_stats(batch.rollouts, cfg, len(first))
    stats = dict(first_round) | {f"first_{k}": v for k, v in first_round.items()}
    if not cfg.filter_zero_variance or not first:
        batch.stats = stats | {"refill_rounds": 0}
        return batch
    want, rounds, generated = len(first), 0, len(first)
    kept = sorted(informative(batch.rollouts, cfg))
    rollouts = [r for r in batch.rollouts if r.group in set(kept)]
    while len(kept) < want and rounds < cfg.max_refill_rounds:
        rounds += 1
        # Sized by the rate kept so far, unfloored (late in countdown ~2% of groups vary).
        needed = math.ceil(REFILL_MARGIN * (want - len(kept)) * generated / max(len(kept), 1))
        count = min(needed, REFILL_ROUND_GROUPS * want)
        extra = generate([next(more) for _ in range(count)])
        generated += count
        batch.seconds += extra.seconds
        stats = add_stats(stats, step_stats(extra.rollouts, cfg, count))
        new = sorted(informative(extra.rollouts, cfg))[: want - len(kept)]
        kept += new
        rollouts += [r for r in extra.rollouts if r.group in set(new)]
    batch.rollouts = sorted(rollouts, key=lambda r: r.group)
    batch.stats = stats | {"refill_rounds": rounds}
    return batch


def group_plan(cfg: RLConfig, share: int = 0, shares: int = 1) -> tuple[list[int], Iterator[int]]:
    """The groups a generator (share ``share`` of ``shares``) generates first, and those it
    refills from."""
    first = list(range(share, cfg.prompts_per_step, shares))
    more = (j for j in itertools.count(cfg.prompts_per_step) if j % shares == share)
    return first, more


class OnPolicy:
    """Colocated, synchronous: the batch for step s is generated when step s asks for it."""

    def __init__(self, runner: RLRunner) -> None:
        self.runner = runner

    def start(self, step: int) -> None:
        pass

    def next(self) -> RolloutBatch:
        return self.runner.rollouts(self.runner.step + 1)

    def updated(self) -> None:
        pass

    def hold(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def stop(self) -> None:
        pass


class Lagged:
    """The generator thread of a colocated off-policy run: batch s is generated by the newest
    policy once that policy is at most ``max_offpolicy_steps`` updates behind step s's.

    Generated batches wait in the runner's ``RolloutBuffer`` (the one queue, so a checkpoint
    taken while the thread is held holds exactly the batches not yet trained on; a resumed run
    trains on those first and generates from the next step on)."""

    def __init__(self, runner: RLRunner) -> None:
        self.runner = runner
        self.lag = runner.job.rl.max_offpolicy_steps
        self.pending = runner.buffer.batches
        self.cond = threading.Condition()
        self.paused = self.stopping = self.busy = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        first = step + 1 + len(self.pending)  # a resumed run's buffer holds the next batches
        self.thread = threading.Thread(target=self._run, args=(first,), daemon=True)
        self.thread.start()

    def _run(self, first: int) -> None:
        # On a GPU the thread launches on a stream of its own, so its decode kernels run beside
        # the trainer's instead of queueing behind them on the default stream.
        device = self.runner.device
        own = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else None
        with own if own is not None else contextlib.nullcontext():
            self._generate_from(first)

    def _generate_from(self, first: int) -> None:
        runner, steps = self.runner, self.runner.job.training.steps
        try:
            for step in range(first, steps + 1):
                with self.cond:
                    # Batch `step` trains policy version step - 1; it may be generated by
                    # version step - 1 - lag at the oldest.
                    self.cond.wait_for(lambda s=step: self.stopping or (
                        not self.paused and runner.version >= s - 1 - self.lag))  # fmt: skip
                    if self.stopping:
                        return
                    self.busy = True
                batch = None
                try:
                    sync_s = runner.sync_generator()
                    batch = runner.rollouts(step)
                    batch.sync_seconds = sync_s
                finally:
                    with self.cond:
                        self.busy = False
                        if batch is not None:
                            self.pending.append(batch)
                        self.cond.notify_all()
        except BaseException as err:  # handed to the trainer thread
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def updated(self) -> None:
        """The trainer's version moved: the generator may go on."""
        with self.cond:
            self.cond.notify_all()

    def next(self) -> RolloutBatch:
        """The oldest batch not trained on yet (waits for the generator)."""
        with self.cond:
            self.cond.wait_for(lambda: self.pending or self.error is not None)
            if self.error is not None:
                raise self.error
            return self.pending.pop(0)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the generator between batches (for a consistent checkpoint)."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: not self.busy)
        try:
            yield
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)


class Remote:
    """The trainer ranks' side of disaggregated placement: send the policies the generator
    ranks need, take their batches (torchloom/rl/disaggregated.py)."""

    def __init__(self, runner: RLRunner) -> None:
        self.runner = runner
        assert runner.link is not None
        self.link = runner.link
        self.sync_s = 0.0

    def start(self, step: int) -> None:
        self.sync_s = self.link.send_weights(self.runner.model)

    def next(self) -> RolloutBatch:
        batch = self.link.rollouts()
        batch.sync_seconds = self.sync_s  # what sending the weights cost the trainer
        return batch

    def updated(self) -> None:
        """The policy moved: send it if the generator ranks will ever use it."""
        runner, r = self.runner, self.runner.job.rl
        self.sync_s = 0.0
        if runner.version <= last_version_sent(runner.job.training.steps, r.max_offpolicy_steps):
            self.sync_s = self.link.send_weights(runner.model)

    def hold(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def stop(self) -> None:
        self.link.wait_sent()


def serve(runner: RLRunner, start: int) -> list[float]:
    """A generator rank's run: generate its share of every step from ``start`` on with the
    policy the lag bound allows, as far ahead as that allows, handing the batches over in order
    from a sender thread; receive each version the trainer sends in order, checkpointing each
    step alongside the trainer before receiving the next version (so every collective meets).
    Returns the mean reward of each step's share."""
    job, link = runner.job, runner.link
    t, r = job.training, job.rl
    assert link is not None
    ckpt = runner.checkpointer
    saved = start  # steps up to this one are checkpointed (or need none)

    def save_through(step: int) -> None:
        nonlocal saved
        for s in range(saved + 1, step + 1):
            if ckpt.should_save(s, t.steps):
                ckpt.save(s, 0)
        saved = max(saved, step)

    outbox: queue.Queue[RolloutBatch | None] = queue.Queue()
    failed: list[BaseException] = []

    def send() -> None:
        try:
            while (part := outbox.get()) is not None:
                link.rollouts(part)
        except BaseException as err:
            failed.append(err)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    version = start
    link.receive_weights(runner.gen_model)
    share, shares = link.share_index, len(link.generators)
    rewards = []
    try:
        for step in range(start + 1, t.steps + 1):
            sync_s = 0.0
            while version < policy_needed(step, start, r.max_offpolicy_steps):
                save_through(version)  # the trainer saves step v before it can send v + 1
                sync_s += link.receive_weights(runner.gen_model)
                version += 1
            first, more = group_plan(r, share, shares)
            part = collect(lambda groups, v=version, s=step: runner.generate(s, groups, v),
                           first, more, r)  # fmt: skip
            part.sync_seconds = sync_s
            rewards.append(part.stats["first_reward_sum"] / max(part.stats["first_rollouts"], 1))
            if failed:
                raise failed[0]
            outbox.put(part)
        save_through(t.steps)
    finally:
        outbox.put(None)
        sender.join()
    if failed:
        raise failed[0]
    ckpt.finish()
    return rewards


__all__ = ["Lagged", "OnPolicy", "Remote", "collect", "group_plan", "prompt_index", "serve"]
