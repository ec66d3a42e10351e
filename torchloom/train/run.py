"""The run scaffold every job shares (`torchloom train` and `torchloom rl`): choosing and
loading the checkpoint to start from, the output folder's checks, the resolved config.json, the
per-step save-when-due, the end of the saves, and the final model export.
A job supplies its steps; this supplies everything around them, so a rule about outputs or
checkpoints holds for every kind of run at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from torchloom.checkpoint.hf import save_hf
from torchloom.checkpoint.manager import CheckpointManager, on_rank0
from torchloom.checkpoint.model_io import write_model_folder
from torchloom.checkpoint.stateful import OptimizerState
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.config.paths import check_can_create
from torchloom.train.job import JobConfig
from torchloom.train.metrics import MetricsLogger
from torchloom.train.optim import ResumedSettings
from torchloom.train.output import (
    BEFORE_FIRST_STEP,
    check_output_dir,
    remove_outputs,
    truncate_metrics,
)


class NothingToTrain(Exception):
    """The checkpoint to resume is already at --training.steps: the run ends at its start,
    having written and removed nothing (the commands exit 0 with this message)."""


class RunScaffold:
    """Start (or resume), log, save and export one job's run: ``job``'s output and checkpoint
    settings, ``checkpointer`` over what the job's checkpoints hold (its state registry)."""

    def __init__(self, job: JobConfig, checkpointer: CheckpointManager, is_rank0: bool) -> None:
        self.job, self.checkpointer, self.is_rank0 = job, checkpointer, is_rank0
        self.output_dir = Path(job.output.dir)
        self.changed_settings: list[str] = []  # set by a resume whose flags differ (start)
        self._fresh_folder: bool | None = None  # start(): None until then; whether it made it

    def start(self) -> int:
        """Choose the checkpoint and check the folders before any file is written or removed;
        then clean up, load, and record the resolved config. Returns the step to continue from.
        NothingToTrain (on every rank) when the
        checkpoint to resume is at the last step."""
        job, ckpt = self.job, self.checkpointer
        step = ckpt.choose(job.training.steps)
        continues = "train_state" not in job.checkpoint.exclude_from_loading
        if step is not None and continues and step == job.training.steps:
            raise NothingToTrain(
                f"Nothing to train: the checkpoint to resume ({ckpt.storage.step_dir(step)}) is "
                f"already at --training.steps {step}; raise --training.steps to train further."
            )
        replaced = on_rank0(self.is_rank0, lambda: self._check_folders(step, continues))
        if self.is_rank0:
            remove_outputs(self.output_dir, replaced)
        if job.checkpoint.resume or job.checkpoint.interval:  # else the folder is not this run's
            ckpt.clean_interrupted()
        if step is not None:
            settings = self._resumed_settings()
            step = ckpt.load(step)
            self.changed_settings = settings.reapply() if settings is not None else []
            if self.is_rank0:
                truncate_metrics(self.output_dir / "metrics.jsonl", step)
        if self.is_rank0:  # only now: a refused resume must not replace the run's config
            if step is None:  # a fresh run: what it writes is its own until a step completes
                self._fresh_folder = not self.output_dir.exists()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(to_dict(job), indent=2) + "\n")
        return step or 0

    def discard_unstarted(self) -> None:
        """After a fresh run failed before its first step completed: remove what it wrote
        (config.json, metrics.jsonl with at most its step-0 validation, tb, profile), and the
        folder if this run made it and nothing else is in it, so the corrected command runs
        again without --output.overwrite. Rank 0; a resumed run keeps its folder as it is."""
        if self._fresh_folder is None:
            return
        for name in BEFORE_FIRST_STEP:
            target = self.output_dir / name
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            elif target.exists():
                target.unlink()
        if self._fresh_folder and not any(self.output_dir.iterdir()):
            self.output_dir.rmdir()
        self._fresh_folder = None

    def _resumed_settings(self) -> ResumedSettings | None:
        """This run's optimizer and schedule settings, captured before a load overwrites them:
        those of the parts the checkpoint loads (None when it loads neither)."""
        parts, excluded = self.checkpointer.parts, self.job.checkpoint.exclude_from_loading
        optimizer, scheduler = parts.get("optimizer"), parts.get("lr_scheduler")
        optimizers = []
        if isinstance(optimizer, OptimizerState) and "optimizer" not in excluded:
            optimizers = optimizer.optimizers
        if scheduler is None or "lr_scheduler" in excluded:
            scheduler = None
        return ResumedSettings(optimizers, scheduler) if optimizers or scheduler else None

    def _check_folders(self, step: int | None, continues: bool) -> list[str]:
        """Rank 0: refuse an output or checkpoint folder this run may not write into (``step``:
        the checkpoint to load, if any; ``continues``: its step count too); returns the earlier
        run's outputs that --output.overwrite replaces."""
        job, storage = self.job, self.checkpointer.storage
        if job.checkpoint.interval or job.checkpoint.resume:
            _check_checkpoint_folder(storage.root_url)
        resuming = step is not None
        if resuming and not continues:
            self._check_restart()
        replaced = check_output_dir(
            self.output_dir, job.output.overwrite, resuming, job.checkpoint.resume, storage.root_url
        )
        # The output folder's own checkpoints/ is the output rules' (refused or replaced).
        own = storage.root_url == os.path.abspath(self.output_dir / "checkpoints")
        if job.checkpoint.interval and not job.checkpoint.resume and not own:
            self.checkpointer.check_unused()
        return replaced

    def _check_restart(self) -> None:
        """Rank 0: a checkpoint loaded without its train_state restarts the step count; refuse
        it where the steps counted again would collide with that run's checkpoints or metrics."""
        storage = self.checkpointer.storage
        if self.job.checkpoint.interval or (self.output_dir / "metrics.jsonl").exists():
            raise ConfigError(
                "--checkpoint.exclude_from_loading train_state restarts the step count at 1, "
                f"while {storage.root_url} holds checkpoints up to step "
                f"{max(storage.marked_steps())}; use a new --output.dir (or --checkpoint.folder) "
                "for a run that counts from 1."
            )

    def resumed_line(self, step: int) -> str | None:
        """What to print after a resume (None when the run started fresh)."""
        ckpt = self.checkpointer
        if ckpt.loaded_step is None:
            return None
        line = (
            f"resumed from {ckpt.storage.step_dir(ckpt.loaded_step)} in {ckpt.load_seconds:.2f} s; "
            f"continuing at step {step + 1}"
        )
        if self.changed_settings:  # the optimizer's moments are the checkpoint's, these are not
            line += "; with this run's settings: " + ", ".join(self.changed_settings)
        return line

    def save_if_due(
        self,
        metrics: MetricsLogger,
        step: int,
        tokens_seen: int = 0,
        hold: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        """Save a checkpoint when one is due after ``step`` (inside ``hold()``: e.g. with a
        generator thread paused between batches), and log the saves that completed."""
        ckpt = self.checkpointer
        if ckpt.should_save(step, self.job.training.steps):
            with hold() if hold is not None else contextlib.nullcontext():
                ckpt.save(step, tokens_seen)
        for record in ckpt.poll():
            metrics.log(record)

    def finish(self, metrics: MetricsLogger) -> None:
        """Wait for the saves in flight and log them."""
        for record in self.checkpointer.finish():
            metrics.log(record)

    def export(
        self,
        metrics: MetricsLogger,
        config: Any,
        tokenizer: Any,
        state_items: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    ) -> Path | None:
        """The final model folder and Hugging Face export (``export_final_model``)."""
        return export_final_model(self.job, self.output_dir, config, tokenizer, self.is_rank0,
                                  metrics.print, state_items)  # fmt: skip


def _check_checkpoint_folder(root: str) -> None:
    """Refuse a local --checkpoint.folder that is a file or cannot be created, before the first
    save would find out."""
    if "://" in root:
        return
    if os.path.exists(root) and not os.path.isdir(root):
        raise ConfigError(
            f"--checkpoint.folder {root} is a file, not a folder; choose another path."
        )
    check_can_create(Path(root))


def export_final_model(
    job: JobConfig, output_dir: Path, config: Any, tokenizer: Any, is_rank0: bool,
    say: Callable[[str], None], state_items: Callable[[], Iterable[tuple[str, torch.Tensor]]],
) -> Path | None:  # fmt: skip
    """Write the final model folder (--checkpoint.save_final_model) and a Hugging Face folder
    (--checkpoint.export_hf) under ``output_dir``; returns the model folder, if written. Every
    rank takes part in gathering the full tensors (``state_items()``, one at a time); rank 0
    alone writes."""
    family = job.model.name
    model_dir = output_dir / "model"
    writes = []
    if job.checkpoint.save_final_model:
        writes.append((lambda items: write_model_folder(model_dir, family, config, items,
                                                        tokenizer),
                       f"saved the model to {model_dir}"))  # fmt: skip
    if job.checkpoint.export_hf:
        hf_dir = output_dir / "hf"
        writes.append((lambda items: save_hf(hf_dir, family, config, items, tokenizer,
                                             overwrite=True),
                       f"exported a Hugging Face folder to {hf_dir}"))  # fmt: skip
    for write, done in writes:
        items = state_items()
        if is_rank0:
            write(items)
        for _ in items:  # the other ranks still take part in every gather
            pass
        say(done)
    return model_dir if job.checkpoint.save_final_model else None


def resume_command(command: str, argv: list[str]) -> str:
    """``torchloom <command>`` with its arguments ``argv`` and --checkpoint.resume true,
    loading the newest checkpoint: any --checkpoint.resume / load_step given is dropped. Under
    torchrun the launcher's own options are left for the user to repeat."""
    dropped = ("checkpoint.resume", "checkpoint.load_step")
    kept, i = [], 0
    while i < len(argv):
        name, has_value = argv[i][2:].split("=", 1)[0].replace("-", "_"), "=" in argv[i]
        takes_next = not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if argv[i].startswith("--") and name in dropped:
            i += 2 if takes_next else 1
            continue
        kept.append(argv[i])
        i += 1
    launcher = ["torchloom"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        launcher = ["torchrun", "<the same torchrun options>", "-m", "torchloom"]
    return shlex.join([*launcher, command, *kept, "--checkpoint.resume", "true"])
