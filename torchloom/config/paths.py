"""Checks on a path a command will write, made before the command's work rather than after."""

from __future__ import annotations

import os
from pathlib import Path

from torchloom.config.errors import ConfigError


def check_can_create(path: Path) -> None:
    """Refuse ``path`` (a file or folder to write) when its nearest existing parent is a file or
    is not writable, so a command fails before its work rather than at the end of it."""
    parent = Path(path).absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"Cannot create {path}: {parent} is a file, not a folder; choose another path."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"Cannot create {path}: the folder {parent} is not writable; choose another path."
        )
