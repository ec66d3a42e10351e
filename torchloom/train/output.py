"""The run's output folder: refusing to mix two runs in one (or to replace one by accident),
and trimming the metrics a resumed run writes again."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from torchloom.config.errors import ConfigError
from torchloom.config.paths import check_can_create
from torchloom.train.metrics import read_records

# Files a run owns in its output folder; --output.overwrite removes exactly these.
_RUN_OUTPUTS = (
    "config.json", "metrics.jsonl", "tb", "model", "hf", "metrics.png", "checkpoints", "profile",
)  # fmt: skip
BEFORE_FIRST_STEP = ("config.json", "metrics.jsonl", "tb", "profile")
"""The run outputs a run writes before its first step completes (``discard_unstarted``)."""


def check_output_dir(
    path: Path, overwrite: bool, resuming: bool, resume: bool, checkpoint_folder: str
) -> list[str]:
    """Refuse an output folder (``check_writable`` already) this run may not write into, before
    anything is written, and return the earlier run's outputs that --output.overwrite replaces.
    ``resuming``: a checkpoint is being loaded, so the run continues the one there; ``resume``:
    one was asked for (found or not) in ``checkpoint_folder``."""
    if resuming:
        return []
    existing = [name for name in _RUN_OUTPUTS if (path / name).exists()]
    # With resume, the checkpoint folder holds no checkpoint (only interrupted saves, removed).
    earlier = [name for name in existing if not (resume and name == "checkpoints")]
    if earlier and not overwrite and resume:
        raise ConfigError(
            f"--checkpoint.resume true found no complete checkpoint in {checkpoint_folder}, and "
            f"{path} holds an earlier run ({', '.join(earlier)}) that starting afresh would "
            "replace; pass --output.overwrite true to replace it, or choose another --output.dir."
        )
    if earlier and not overwrite:
        raise ConfigError(
            f"The output folder {path} already holds a run ({', '.join(earlier)}). Choose another "
            "--output.dir, pass --output.overwrite true to replace those files, or "
            "--checkpoint.resume true to continue it."
        )
    return existing if overwrite else []


def check_writable(path: Path) -> None:
    """Refuse an output folder that is a file, or that cannot be created or written to. Creates
    nothing: a run refused later, before training, leaves no empty folder behind (the folder is
    made once the run's checks pass, ``RunScaffold.start``)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--output.dir {path} is a file, not a folder; choose another path.")
    if not path.exists():
        check_can_create(path)
        return
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"The output folder {path} is not writable; choose another --output.dir.")


def remove_outputs(path: Path, names: list[str]) -> None:
    """Delete the earlier run's ``names`` (from ``check_output_dir``), saying so."""
    if not names:
        return
    print(f"--output.overwrite true: removing {', '.join(names)} from {path}", flush=True)
    for name in names:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records a run resumed after ``step`` writes again (those after it; all of them
    for step 0, whose validation is logged again)."""
    if not path.is_file():
        return
    records = read_records(path)
    kept = [r for r in records if r["step"] <= step] if step else []
    if len(kept) < len(records):
        print(
            f"{path}: dropping {len(records) - len(kept)} record(s) after step {step}, which "
            "this run writes again",
            flush=True,
        )
    # A temporary file renamed over the old one: a kill or a full disk leaves either.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(tmp, path)
