"""Training checkpoints on torch.distributed.checkpoint (DCP): save (sync, async, async with
pinned staging), mark complete, keep the newest k, and resume exactly, on any layout.

What one checkpoint holds (``STATE_PARTS``): the model and optimizer under the single-process
parameter names (DCP reshards DTensors, so FSDP, TP and PP layouts load each other's
checkpoints), the lr schedule, the data loader's position, the step and tokens seen, and the
RNG state. The data loader's state is the same on every data rank (each rank derives its rows
from the global step), so one copy serves any number of data ranks. Every rank seeds alike and
nothing draws per-rank random numbers, so one RNG state does too.

A save is complete only when rank 0 has written ``COMPLETE.json`` after DCP's own finish step
(which waits for every rank's files, written and fsynced); anything else is an interrupted save,
removed at the next start and never loaded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from torchloom.checkpoint.config import STATE_PARTS, CheckpointConfig
from torchloom.checkpoint.staging import PinnedStager
from torchloom.checkpoint.storage import CheckpointCorruptError, CheckpointError, CheckpointStorage


class _Part:
    """A DCP Stateful made of a getter and a setter."""

    def __init__(self, get: Callable[[], dict], set_: Callable[[dict], None]) -> None:
        self.state_dict, self.load_state_dict = get, set_


@dataclass
class _PendingSave:
    step: int
    start: float
    blocking_s: float
    upload: Future | None = None
    staging: Future | None = None
    done_at: float | None = None
    error: BaseException | None = None
    finalized: threading.Event = field(default_factory=threading.Event)
    """Set once the marker is written (or the save failed): after the future's callbacks."""


class CheckpointManager:
    """Saves and restores one training run's state; the trainer calls ``resume`` once, then
    ``wait_for_staging`` before each optimizer step, ``maybe_save`` after it, ``poll`` for
    finished saves to log, and ``finish`` at the end."""

    def __init__(
        self,
        config: CheckpointConfig,
        output_dir: Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loader: Any,
        device: torch.device,
        marker_extra: dict[str, Any],
        is_rank0: bool,
    ) -> None:
        self.config = config
        folder = config.folder
        if "://" not in folder and not Path(folder).is_absolute():
            folder = str(Path(output_dir) / folder)
        self.storage = CheckpointStorage.for_path(folder)
        self.model, self.optimizer, self.scheduler, self.loader = (
            model,
            optimizer,
            scheduler,
            loader,
        )
        self.device = device
        self.marker_extra = marker_extra
        self.is_rank0 = is_rank0
        self.step = 0
        self.tokens_seen = 0
        self.loaded_step: int | None = None
        self.load_seconds = 0.0
        self._pending: _PendingSave | None = None
        self._finished: list[_PendingSave] = []
        self._lock = threading.Lock()
        self._stager: PinnedStager | BlockingAsyncStager | None = None
        self._group = None
        if config.interval and config.mode != "sync":
            if config.mode == "async_pinned" and device.type == "cuda":
                self._stager = PinnedStager(device)
            else:
                # A blocking copy into host memory. On the CPU there is no device copy to
                # overlap, so async_pinned is async there.
                self._stager = BlockingAsyncStager(cache_staged_state_dict=False)
            if dist.is_initialized():
                # The background writer's collectives run on their own gloo group, never
                # interleaved with the training's collectives on the main group.
                self._group = dist.new_group(backend="gloo")

    # -- what is saved ----------------------------------------------------------------------

    def _state(self, parts: tuple[str, ...]) -> dict[str, Any]:
        model, optimizer = self.model, self.optimizer
        makers = {
            "model": lambda: _Part(
                lambda: get_model_state_dict(model),
                lambda sd: set_model_state_dict(model, sd),
            ),
            "optimizer": lambda: _Part(
                lambda: get_optimizer_state_dict(model, optimizer),
                lambda sd: set_optimizer_state_dict(model, optimizer, sd),
            ),
            "lr_scheduler": lambda: _Part(
                self.scheduler.state_dict, self.scheduler.load_state_dict
            ),
            "dataloader": lambda: _Part(self.loader.state_dict, self.loader.load_state_dict),
            "train_state": lambda: _Part(self._train_state, self._load_train_state),
            "rng": lambda: _Part(self._rng_state, self._load_rng_state),
        }
        return {part: makers[part]() for part in parts}

    def _train_state(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def _load_train_state(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _load_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    # -- resume -----------------------------------------------------------------------------

    def resume(self) -> int:
        """Clean up interrupted saves and, with ``resume``, load the chosen checkpoint; returns
        the step to continue from (0 for a fresh start)."""
        self.step = 0
        if self.is_rank0:
            for step in self.storage.incomplete_steps():
                self.storage.remove(step)
        if not self.config.resume:
            _barrier()
            return 0
        choice = self._choose_step() if self.is_rank0 else None
        choice = _broadcast(choice)
        if isinstance(choice, str):
            raise CheckpointError(choice)
        if choice is None:
            return 0
        parts = tuple(p for p in STATE_PARTS if p not in self.config.exclude_from_loading)
        start = time.perf_counter()
        dcp.load(self._state(parts), storage_reader=self.storage.reader(choice))
        self.load_seconds = time.perf_counter() - start
        self.loaded_step = choice
        if self.is_rank0:
            # Newer checkpoints belong to the history this run replaces (a fallback past a
            # damaged step, or an explicit load_step); the resumed run saves those steps again.
            for newer in self.storage.steps_on_disk():
                if newer > choice:
                    self.storage.remove(newer)
        _barrier()
        if "train_state" in self.config.exclude_from_loading:
            self.step = 0
        return self.step

    def _choose_step(self) -> int | str | None:
        """Rank 0: the step to load, None for none, or an error message."""
        steps = self.storage.complete_steps()
        wanted = self.config.load_step
        if wanted >= 0:
            if wanted not in steps:
                return (
                    f"--checkpoint.load_step {wanted} has no complete checkpoint in "
                    f"{self.storage.root_url}; complete steps: {steps or 'none'}."
                )
            steps = [s for s in steps if s <= wanted]
        for step in reversed(steps):
            try:
                self.storage.verify(step, checksums=self.config.checksums)
                return step
            except CheckpointCorruptError as err:
                if not self.config.fallback:
                    return str(err)
                print(f"checkpoint step {step} is damaged ({err.reason}): trying an older one")
        if steps:
            return f"No undamaged checkpoint in {self.storage.root_url} (tried steps {steps})."
        return None

    # -- save -------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        interval = self.config.interval
        return bool(interval) and (step % interval == 0 or step == last_step)

    @property
    def saving(self) -> bool:
        """Whether a save is still being written (its marker not yet written)."""
        return self._pending is not None and not self._pending.finalized.is_set()

    def wait_for_staging(self) -> float:
        """Block until the pending save's copy of the state is taken (async_pinned); call it
        before the optimizer changes the parameters. Returns the seconds waited."""
        pending = self._pending
        if pending is None or pending.staging is None or pending.staging.done():
            return 0.0
        start = time.perf_counter()
        pending.staging.result()
        waited = time.perf_counter() - start
        pending.blocking_s += waited
        return waited

    def save(self, step: int, tokens_seen: int) -> None:
        """Checkpoint the state after ``step`` (every rank calls it)."""
        self._wait_for_upload(stalls_training=True)  # one save in flight at a time
        self.step, self.tokens_seen = step, tokens_seen
        start = time.perf_counter()
        # Rank 0 alone clears and creates the step's folder; the broadcast holds the others
        # back until it has (and carries a refusal to every rank, not to rank 0 alone).
        problem = None
        if self.is_rank0:
            try:
                self.storage.prepare(step)
            except CheckpointError as err:
                problem = str(err)
        if (problem := _broadcast(problem)) is not None:
            raise CheckpointError(problem)
        writer = self.storage.writer(step, thread_count=self.config.writer_threads, prepare=False)
        # The state as nested dicts of tensors, taken now, before anything is copied.
        state = {name: part.state_dict() for name, part in self._state(STATE_PARTS).items()}
        pending = _PendingSave(step, start, 0.0)
        if self._stager is None:
            dcp.save(state, storage_writer=writer)
            pending.blocking_s = time.perf_counter() - start
            pending.done_at = time.perf_counter()
            self._complete(pending)
            return
        response = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=self._group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
        )
        if isinstance(response, Future):
            pending.upload = response
        else:
            pending.upload, pending.staging = (
                response.upload_completion,
                response.staging_completion,
            )
        pending.blocking_s = time.perf_counter() - start
        self._pending = pending
        pending.upload.add_done_callback(lambda future: self._uploaded(pending, future))

    def _uploaded(self, pending: _PendingSave, future: Future) -> None:
        """Runs in the writer thread when this rank's part (and on rank 0, DCP's metadata after
        every rank's part) is written."""
        pending.done_at = time.perf_counter()
        try:
            future.result()
            self._complete(pending)
        except BaseException as err:  # surfaced by poll / finish on the training thread
            pending.error = err
            with self._lock:
                self._finished.append(pending)
            pending.finalized.set()

    def _complete(self, pending: _PendingSave) -> None:
        if self.is_rank0:
            extra = {**self.marker_extra, "tokens_seen": self.tokens_seen}
            self.storage.mark_complete(pending.step, extra=extra, checksums=self.config.checksums)
            pending.done_at = time.perf_counter()
            keep = self.config.keep_latest_k
            if keep:
                for old in self.storage.complete_steps()[:-keep]:
                    self.storage.remove(old)
        with self._lock:
            self._finished.append(pending)
        pending.finalized.set()

    def _wait_for_upload(self, stalls_training: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.upload is not None:
            start = time.perf_counter()
            with contextlib.suppress(BaseException):  # a failure is reported by poll
                pending.upload.result()
            pending.finalized.wait()
            if stalls_training:
                pending.blocking_s += time.perf_counter() - start

    def poll(self) -> list[dict[str, Any]]:
        """Records of saves finished since the last call: step, blocking and write seconds."""
        with self._lock:
            finished, self._finished = self._finished, []
        records = []
        for pending in finished:
            if pending.error is not None:
                raise CheckpointError(
                    f"Saving the checkpoint of step {pending.step} to "
                    f"{self.storage.step_dir(pending.step)} failed: {pending.error}"
                ) from pending.error
            records.append(
                {
                    "step": pending.step,
                    "ckpt_blocking_s": round(pending.blocking_s, 4),
                    "ckpt_write_s": round((pending.done_at or pending.start) - pending.start, 4),
                }
            )
        return records

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the save in flight; its record (and any others not yet polled)."""
        self._wait_for_upload(stalls_training=False)  # training is over: no step waits
        _barrier()
        return self.poll()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
