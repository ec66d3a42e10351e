"""The run's output folder: refusing to mix two runs in one, and trimming the metrics a resumed
run writes again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torchloom.config.errors import ConfigError

# Files a run owns in its output folder; --output.overwrite removes exactly these.
_RUN_OUTPUTS = (
    "config.json", "metrics.jsonl", "tb", "model", "hf", "metrics.png", "checkpoints", "profile",
)  # fmt: skip


def prepare_output_dir(path: Path, overwrite: bool, resume: bool = False) -> None:
    """Create the run folder; refuse to mix with an earlier run unless asked to replace it (or
    to resume it)."""
    existing = [name for name in _RUN_OUTPUTS if (path / name).exists()]
    if resume and not overwrite:
        path.mkdir(parents=True, exist_ok=True)
        return
    if existing and not overwrite:
        raise ConfigError(
            f"The output folder {path} already holds a run ({', '.join(existing)}). Choose another "
            "--output.dir, pass --output.overwrite true to replace those files, or "
            "--checkpoint.resume true to continue it."
        )
    for name in existing:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    path.mkdir(parents=True, exist_ok=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records a resumed run will write again (those after ``step``)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    if step == 0:
        kept = []
    path.write_text("".join(line + "\n" for line in kept))
