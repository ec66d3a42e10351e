"""Checks on a path a command will read or write, made before the command's work rather than
after."""

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


def require_folder(path: Path, what: str, holds: str) -> None:
    """Refuse ``path`` unless it is a folder: ``what`` (e.g. "Hugging Face model folder")
    names it, ``holds`` is a file such a folder has (e.g. config.json): given a file inside
    one, the error names the folder."""
    path, what = Path(path), what[:1].upper() + what[1:]
    if path.is_dir():
        return
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist.")
    hint = (
        f"pass the folder that holds it ({path.parent})"
        if (path.parent / holds).is_file()
        else f"pass a folder holding {holds}"
    )
    raise ConfigError(f"{what} {path} is a file, not a folder; {hint}.")
