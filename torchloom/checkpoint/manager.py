"""Training checkpoints on torch.distributed.checkpoint (DCP): save (sync, async, async with
pinned staging), mark complete, keep the newest k, and resume exactly, on any layout.

What one checkpoint holds is a registry of parts the trainer hands over (checkpoint/stateful.py),
plus the step and tokens seen and the RNG state, which the manager keeps itself. A training run's
parts are the model and optimizer under the single-process parameter names (DCP reshards
DTensors, so FSDP, TP and PP layouts load each other's checkpoints), the lr schedule and the
data loader's position; other jobs add theirs. The data loader's state is the same on every data rank (each rank derives its rows
from the global step), so one copy serves any number of data ranks. Every rank seeds alike and
nothing draws per-rank random numbers, so one RNG state does too.

A save is complete only when rank 0 has written ``COMPLETE.json`` after DCP's own finish step
(which waits for every rank's files, written and fsynced); a step folder without one is an
interrupted save, removed at the next start and never loaded. A marker that does not read as
one is damage: refused (or, with fallback, skipped), never taken for an interrupted save.
Every removal is printed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import resource
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.checkpoint.staging import PinnedStager
from torchloom.checkpoint.stateful import Stateful
from torchloom.checkpoint.storage import (
    MARKER,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorage,
)
from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.models.config import ModelConfig


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
    """Saves and restores one training run's state; the trainer calls ``choose``,
    ``clean_interrupted`` and ``load`` (or ``resume``, all three) once, then
    ``wait_for_staging`` before each optimizer step, ``save`` when ``should_save``, ``poll``
    for finished saves to log, and ``finish`` at the end."""

    def __init__(
        self,
        config: CheckpointConfig,
        output_dir: Path,
        *,
        parts: dict[str, Stateful],
        device: torch.device,
        marker_extra: dict[str, Any],
        is_rank0: bool,
    ) -> None:
        """``parts``: what the checkpoint holds besides the step and the RNG state (which the
        manager keeps itself as ``train_state`` and ``rng``), by name: the trainer's model,
        optimizer, lr_scheduler and dataloader, and whatever else joins (ModelState and
        OptimizerState wrap the first two)."""
        self.config = config
        folder = config.folder
        if "://" not in folder and not Path(folder).is_absolute():
            folder = str(Path(output_dir) / folder)
        self.storage = CheckpointStorage.for_path(folder)
        own = {"train_state": _Part(self._train_state, self._load_train_state),
               "rng": _Part(self._rng_state, self._load_rng_state)}  # fmt: skip
        clash = own.keys() & parts.keys()
        if clash:
            raise ValueError(f"checkpoint part names {sorted(clash)} are the manager's own")
        self.parts: dict[str, Stateful] = {**parts, **own}
        unknown = [p for p in config.exclude_from_loading if p not in self.parts]
        if unknown:
            raise ConfigError(
                f"--checkpoint.exclude_from_loading: unknown part {unknown[0]!r}."
                f"{did_you_mean(unknown[0], self.parts)} Parts: {', '.join(self.parts)}."
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

    def _state(self, names: list[str] | None = None) -> dict[str, Stateful]:
        """The parts to save or load (all of them by default), by name."""
        return {name: self.parts[name] for name in (names or self.parts)}

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
        the step to continue from (0: a fresh start). The Trainer calls these parts itself, to
        check its output folder before anything is removed or loaded."""
        step = self.choose()
        self.clean_interrupted()
        return 0 if step is None else self.load(step)

    def choose(self, last_step: int | None = None) -> int | None:
        """The step ``resume`` loads (None: start fresh) to train up to ``last_step``, chosen on
        rank 0 and known to every rank. Raises CheckpointError on every rank for a damaged
        checkpoint (without fallback) or a checkpoint of another model than this run's;
        ConfigError for a load_step that is not there and one past ``last_step``."""
        if not self.config.resume:
            return None
        step = on_rank0(self.is_rank0, self._choose_step)
        past = last_step is not None and step is not None and step > last_step
        if past and "train_state" not in self._excluded:
            raise ConfigError(
                f"The checkpoint to resume ({self.storage.step_dir(step)}) is at step {step}, "
                f"past --training.steps {last_step}: there is nothing to train. Pass "
                f"--training.steps above {step} to train further, or --checkpoint.load_step N "
                f"with N <= {last_step} to redo steps from an older checkpoint."
            )
        return step

    def _saved_parts(self, step: int) -> set[str] | None:
        """The parts (first key components) the checkpoint of ``step`` holds; None if its
        metadata cannot be read."""
        try:
            keys = self.storage.reader(step).read_metadata().state_dict_metadata
        except Exception:  # the load's own error is the one to report
            return None
        return {key.split(".", 1)[0] for key in keys}

    def load(self, step: int) -> int:
        """Load ``step`` (every rank); returns the step to continue from."""
        parts = [p for p in self.parts if p not in self._excluded]
        start = time.perf_counter()
        try:
            dcp.load(self._state(parts), storage_reader=self.storage.reader(step))
        except (ConfigError, CheckpointError):  # already one line that says what to do
            raise
        except (Exception, CheckpointException) as err:  # one line instead of pages
            raise CheckpointError(
                f"Loading the checkpoint {self.storage.step_dir(step)} failed: "
                f"{_one_line(_root_error(err))}"
                f"{_missing_key_hint(_root_error(err), parts, self._saved_parts(step))}"
            ) from err
        self.load_seconds = time.perf_counter() - start
        self.loaded_step = step
        if self.is_rank0:
            # Newer checkpoints belong to the history this run replaces (a fallback past a
            # damaged step, or an explicit load_step); the resumed run saves those steps again.
            for newer in self.storage.steps_on_disk():
                if newer > step:
                    self._remove(newer, f"newer than the loaded step {step}, replaced by this run")
        _barrier()
        if "train_state" in self._excluded:
            self.step = 0
        return self.step

    @property
    def _excluded(self) -> list[str]:
        return self.config.exclude_from_loading

    def latest_step_dir(self) -> str | None:
        """Rank 0: the newest complete checkpoint's folder, or None."""
        step = self.storage.latest_complete()
        return None if step is None else self.storage.step_dir(step)

    def clean_interrupted(self) -> None:
        """Rank 0: remove step folders that have no marker (saves cut short)."""
        if self.is_rank0:
            for step in self.storage.interrupted_steps():
                self._remove(step, f"an interrupted save (no {MARKER})")
        _barrier()

    def check_unused(self) -> None:
        """Rank 0: refuse a folder holding checkpoints (complete or damaged) that this run would
        mix its own saves into; for a run that neither resumes them nor deletes them."""
        steps = self.storage.marked_steps()
        if steps:
            raise CheckpointError(
                f"The checkpoint folder {self.storage.root_url} already holds checkpoints of "
                f"another run (steps {', '.join(map(str, steps))}); pass --checkpoint.resume "
                "true to continue that run, or choose an empty --checkpoint.folder."
            )

    def _remove(self, step: int, why: str) -> None:
        print(f"removed checkpoint {self.storage.step_dir(step)}: {why}", flush=True)
        self.storage.remove(step)

    def _choose_step(self) -> int | None:
        """Rank 0: the newest usable step (or load_step), None when there is none."""
        steps = self.storage.marked_steps()  # complete or damaged; interrupted saves aside
        wanted = self.config.load_step
        if wanted >= 0:
            if wanted not in steps:
                complete = self.storage.complete_steps()
                raise ConfigError(  # the flag names a step that is not there: bad input
                    f"--checkpoint.load_step {wanted} has no complete checkpoint in "
                    f"{self.storage.root_url}; complete steps: {complete or 'none'}."
                )
            steps = [s for s in steps if s <= wanted]
        for step in reversed(steps):
            try:
                self.storage.verify(step, checksums=self.config.checksums)
            except CheckpointCorruptError as err:
                if not self.config.fallback and step == steps[0]:  # nothing older to load
                    raise CheckpointError(
                        f"Checkpoint file {err.path} {err.reason}, and no older step is there "
                        f"to fall back to. {self._afresh()}"
                    ) from None
                if not self.config.fallback:
                    raise
                name = err.path.rsplit("/", 1)[-1]
                print(
                    f"checkpoint step {step} is damaged ({name} {err.reason}): trying an older one"
                )
                continue
            saved = self.storage.read_marker(step).get("extra", {})
            self._check_run(step, saved)
            self._check_model(step, saved)
            self._check_settings(step, saved)
            return step
        if steps:
            raise CheckpointError(
                f"No undamaged checkpoint in {self.storage.root_url} (tried steps {steps}). "
                f"{self._afresh()}"
            )
        return None

    def _afresh(self) -> str:
        return (
            "Start the run afresh with --output.overwrite true and no --checkpoint.resume (it "
            "removes the run's files and "
            f"{self.storage.root_url}), or in a new --output.dir."
        )

    def _check_run(self, step: int, saved: dict[str, Any]) -> None:
        """Refuse a checkpoint saved by the other command (``torchloom train`` against
        ``torchloom rl``): its optimizer, schedule and loader or rollout state belong to a
        different loop. A marker from before the kind was recorded is an RL run's when it
        records RL's settings."""
        now = self.marker_extra.get("run")
        if now is None:
            return
        then = saved.get("run") or ("rl" if saved.get("settings") else "train")
        if then != now:
            step_dir = self.storage.step_dir(step)
            raise CheckpointError(
                f"The checkpoint {step_dir} was saved by `torchloom {then}`, and `torchloom "
                f"{now}` does not continue another kind of run (its optimizer, schedule and "
                f"{'data loader' if then == 'train' else 'rollout'} state belong to that loop). "
                f"Start from its weights instead, in a new --output.dir: torchloom convert "
                f"--from {step_dir} --to-hf DIR, then --checkpoint.initial_load_hf DIR."
            )

    def _check_model(self, step: int, saved: dict[str, Any]) -> None:
        """Refuse a checkpoint whose marker (its ``saved`` extra) records another architecture
        than this run's."""
        if "model" in self._excluded:
            return
        differences = model_differences(saved, self.marker_extra)
        if differences:
            step_dir = self.storage.step_dir(step)
            raise CheckpointError(
                f"The checkpoint {step_dir} holds another model than this run builds: "
                f"{'; '.join(differences)}. Resume with the checkpoint's --model settings, or "
                f"start a new run from its weights (torchloom convert --from {step_dir} --to-hf "
                "DIR, then --checkpoint.initial_load_hf DIR)."
            )

    def _check_settings(self, step: int, extra: dict[str, Any]) -> None:
        """Refuse a checkpoint whose marker (its ``extra``) records other values of the
        settings this run's ``marker_extra["settings"]`` names ({flag: value}, e.g. RL's task),
        unless the run restarts its step count (train_state excluded). Markers without them
        pass."""
        saved, now = extra.get("settings"), self.marker_extra.get("settings")
        if not saved or not now or "train_state" in self._excluded:
            return
        changed = [
            f"{flag} was {saved[flag]!r} there and is {value!r} now"
            for flag, value in now.items()
            if flag in saved and saved[flag] != value
        ]
        if changed:
            raise CheckpointError(
                f"The checkpoint {self.storage.step_dir(step)} continues another run: "
                f"{'; '.join(changed)}. Resume with its settings, or start a new run from its "
                "weights in a new --output.dir."
            )

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
        on_rank0(self.is_rank0, lambda: self._prepare(step))
        writer = self.storage.writer(step, thread_count=self.config.writer_threads, prepare=False)
        # The state as nested dicts of tensors, taken now, before anything is copied.
        state = {name: part.state_dict() for name, part in self._state().items()}
        pending = _PendingSave(step, start, 0.0)
        if self._stager is None:
            try:
                dcp.save(state, storage_writer=writer)
                pending.blocking_s = time.perf_counter() - start
                pending.done_at = time.perf_counter()
                self._complete(pending)
            except (Exception, CheckpointException) as err:  # one line instead of pages
                if _interrupted(err):
                    raise KeyboardInterrupt from None  # Ctrl-C during the save: no failure
                raise CheckpointError(self._save_failed(step, err)) from err
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

    def _prepare(self, step: int) -> None:
        try:
            self.storage.prepare(step)
        except OSError as err:
            raise CheckpointError(self._save_failed(step, err)) from err

    def _save_failed(self, step: int, err: BaseException) -> str:
        cause = _root_error(err)
        full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "Free space there or choose another --checkpoint.folder" if full else "Fix that"
        what = _one_line(cause)
        capped = _file_at_size_limit(self.storage.step_dir(step))
        if capped is not None:  # torch's writers report EFBIG as an "enforce fail"
            what = (
                f"{capped.name} reached this process's file-size limit of "
                f"{capped.stat().st_size} bytes (ulimit -f)"
            )
            fix = (
                "Raise that limit (or --checkpoint.writer_threads: more threads write more, "
                "smaller files)"
            )
        return (
            f"Saving the checkpoint of step {step} to {self.storage.step_dir(step)} failed: "
            f"{what}. {fix}, then run again with --checkpoint.resume true to "
            "continue from the last complete checkpoint."
        )

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
                    self._remove(old, f"--checkpoint.keep_latest_k {keep}")
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
            if pending.error is not None and _interrupted(pending.error):
                raise KeyboardInterrupt
            if pending.error is not None:
                raise CheckpointError(self._save_failed(pending.step, pending.error)) from (
                    pending.error
                )
            records.append(
                {
                    "step": pending.step,
                    "ckpt_blocking_s": round(pending.blocking_s, 4),
                    "ckpt_write_s": round((pending.done_at or pending.start) - pending.start, 4),
                }
            )
        return records

    def wait(self) -> None:
        """Wait for the save in flight without meeting the other ranks (after Ctrl-C)."""
        self._wait_for_upload(stalls_training=False)

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the save in flight; its record (and any others not yet polled)."""
        self._wait_for_upload(stalls_training=False)  # training is over: no step waits
        _barrier()
        return self.poll()


def model_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'field is A there and B here' for each architecture field in which the model recorded in
    a marker's extra (``family``, ``model_config``) differs from the current one. The fields a
    job's model section chooses per run (attention backend, kernels, float8, ...) change how the
    model computes, not what it is, and init_std only the weights a checkpoint replaces."""
    if "model_config" not in saved or "model_config" not in current:
        return []  # a marker from before the model was recorded
    if saved.get("family") != current.get("family"):
        return [f"the model family is {saved.get('family')} there and {current.get('family')} here"]
    per_run = {f.name for f in fields(ModelConfig)} | {"init_std"}
    before = _flat(saved["model_config"])
    now = _flat(json.loads(json.dumps(current["model_config"])))  # as a marker stores it
    return [
        f"{name} is {before.get(name)!r} there and {now.get(name)!r} here"
        for name in sorted(before.keys() | now.keys())
        if name.split(".")[0] not in per_run and before.get(name) != now.get(name)
    ]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _file_at_size_limit(folder: str | Path) -> Path | None:
    """A file in ``folder`` (a local step folder) as large as this process may write one
    (RLIMIT_FSIZE, ``ulimit -f``), or None: no limit, no such file, or not a local folder."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    folder = Path(folder)
    if limit == resource.RLIM_INFINITY or not folder.is_dir():
        return None
    return next((p for p in sorted(folder.rglob("*")) if p.is_file() and p.stat().st_size >= limit),
                None)  # fmt: skip


_STATE_SHAPED_BY = {"dataloader": " (it changes with --data.streaming and --data.format)"}
_STATE_KEPT_WHEN = {"reference": " (a run keeps a reference model with --rl.kl_coef > 0)"}


def _missing_key_hint(err: BaseException, parts: list[str], saved: set[str] | None) -> str:
    """For a key of one part that the checkpoint lacks: which part, whether the checkpoint
    has none of it (``saved``: its parts, None when unknown) or keeps it in another shape
    than this run, and how to resume anyway."""
    found = re.search(r"Missing key in checkpoint state_dict: (\w+)\.", str(err))
    if found is None or found.group(1) not in parts:
        return ""
    part = found.group(1)
    without = f"--checkpoint.exclude_from_loading '[\"{part}\"]'"
    if saved is not None and part not in saved:
        return (
            f". The checkpoint holds no {part} state: the run that saved it had none"
            f"{_STATE_KEPT_WHEN.get(part, '')}. Resume with its settings, or without that "
            f"state: {without}."
        )
    return (
        f". The checkpoint's {part} state has another shape than this run's"
        f"{_STATE_SHAPED_BY.get(part, '')}: resume with the saved run's settings, or without "
        f"that state: {without}."
    )


def _root_error(err: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (whose text holds every
    rank's traceback), or ``err`` itself."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def _interrupted(err: BaseException) -> bool:
    """Whether a save failed because of Ctrl-C: the KeyboardInterrupt itself, or an error a
    writer raised while unwinding from one (torch's zip writer: "unexpected pos ...")."""
    seen: set[int] = set()
    pending = [_root_error(err), err]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        pending += [error.__context__, error.__cause__]
    return False


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(err).__name__


def on_rank0(is_rank0: bool, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 and its result on every rank. A ConfigError or CheckpointError it
    raises is raised on every rank, so no rank waits for a peer that has stopped."""
    outcome: tuple[Any, type[Exception] | None, str] = (None, None, "")
    if is_rank0:
        try:
            outcome = (fn(), None, "")
        except (ConfigError, CheckpointError) as err:
            if not dist.is_initialized():
                raise
            _broadcast(
                (None, ConfigError if isinstance(err, ConfigError) else CheckpointError, str(err))
            )
            raise
    result, error, message = _broadcast(outcome)
    if error is not None:
        raise error(message)
    return result


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
