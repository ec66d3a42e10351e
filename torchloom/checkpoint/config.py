"""The `checkpoint` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from torchloom.config.errors import ConfigError

SaveMode = Literal["sync", "async", "async_pinned"]
STATE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
"""What a `torchloom train` checkpoint holds (other jobs register more parts, such as an RL
run's rollout buffer); names usable in exclude_from_loading."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save a training checkpoint (model, optimizer, lr schedule, data position, step, RNG)
    every this many steps and at the last step; 0 saves none."""
    mode: SaveMode = "sync"
    """sync: training waits until the files are written. async: training waits only for a copy
    of the state to host memory, a background thread writes it. async_pinned: the copy goes
    to reused pinned host buffers and overlaps the next step's forward and backward; training
    waits, if at all, before the next optimizer step."""
    resume: bool = False
    """Continue from the newest complete checkpoint in the checkpoint folder (or
    --checkpoint.load_step) up to --training.steps. With none there it starts fresh, unless the
    output folder holds an earlier run: that is refused without --output.overwrite true."""
    folder: str = "checkpoints"
    """Where checkpoints go: relative to --output.dir, an absolute path, or an fsspec URL
    (memory://..., s3://..., gs://...). Each step is a folder step-N, complete only once its
    COMPLETE.json marker exists."""
    load_step: int = -1
    """With resume (refused without it): the step to load (-1: the newest complete one)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints, deleting older ones (0: keep all)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of the checkpoint not to restore on resume, e.g. [optimizer, dataloader] to
    continue training the weights on new data with a fresh optimizer; any of model, optimizer,
    lr_scheduler, dataloader, train_state, rng."""
    fallback: bool = False
    """With resume: if the chosen checkpoint is damaged (a file missing, truncated or, with
    checksums, altered), load the newest older complete one instead of stopping."""
    checksums: bool = False
    """Record a crc32 of every file in the marker (reads every byte once more); a checkpoint
    that has them is checked against them before loading, with or without this flag. Sizes
    are always checked."""
    writer_threads: int = 4
    """Threads each rank writes its checkpoint files with."""
    save_final_model: bool = True
    """At the end of training write the model (safetensors + config.json + tokenizer.json) to
    <output_dir>/model, loadable with `torchloom.checkpoint.model_io.load_model` (which returns
    the model, its family and its architecture)."""
    initial_load_hf: str = ""
    """Start from a Hugging Face model folder (config.json + safetensors) instead of random
    weights. The architecture then comes from its config.json (--model.name must name its
    family; --model.flavor is not used; --model.overrides must be empty); --model.attn_backend,
    --model.norm_impl and --model.transforms still apply."""
    export_hf: bool = False
    """At the end of training also write a Hugging Face folder (config.json, safetensors and the
    run's tokenizer) to <output_dir>/hf, loadable with transformers' from_pretrained."""

    def validate(self) -> None:
        if self.mode not in get_args(SaveMode):
            raise ConfigError(
                f"--checkpoint.mode must be one of {', '.join(get_args(SaveMode))}; "
                f"got {self.mode!r}."
            )
        if not self.folder.strip():
            raise ConfigError(
                "--checkpoint.folder is empty: checkpoints would land in the output folder's "
                "root beside the model; give a folder (default: checkpoints)."
            )
        for name in ("interval", "keep_latest_k"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--checkpoint.{name} must be >= 0; got {getattr(self, name)}.")
        if self.writer_threads < 1:
            raise ConfigError(
                f"--checkpoint.writer_threads must be >= 1; got {self.writer_threads}."
            )
        if self.load_step < -1:
            raise ConfigError(f"--checkpoint.load_step must be a step or -1; got {self.load_step}.")
        if self.load_step >= 0 and not self.resume:
            raise ConfigError(
                f"--checkpoint.load_step {self.load_step} applies only when resuming; add "
                "--checkpoint.resume true (or drop load_step to start afresh)."
            )
        for part in self.exclude_from_loading:
            if not part.isidentifier():
                raise ConfigError(
                    f"--checkpoint.exclude_from_loading: {part!r} is not a part name; parts of "
                    f"a training checkpoint: {', '.join(STATE_PARTS)}."
                )
        if "model" in self.exclude_from_loading and "optimizer" not in self.exclude_from_loading:
            raise ConfigError(
                "--checkpoint.exclude_from_loading has model but not optimizer: the optimizer's "
                "moments belong to the saved weights; exclude both or neither."
            )
