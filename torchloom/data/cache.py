"""Where the data layer caches its files, and how it writes them safely."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from torchloom.config.errors import ConfigError
from torchloom.config.paths import check_can_create

log = logging.getLogger(__name__)


def resolve_cache_dir(cache_dir: str = "") -> Path:
    """``cache_dir`` if set, else ``$TORCHLOOM_CACHE``, else ``~/.cache/torchloom``; a
    ConfigError when that is a file or cannot be created."""
    env = os.environ.get("TORCHLOOM_CACHE", "")
    chosen = cache_dir or env or "~/.cache/torchloom"
    path = Path(chosen).expanduser()
    source = "--data.cache_dir" if cache_dir else "$TORCHLOOM_CACHE" if env else "the cache"
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{source} {path} is a file, not a folder; point --data.cache_dir at a folder."
        )
    if not path.exists():
        check_can_create(path)
    return path


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through ``write(file)`` so readers see the whole file or nothing.

    Several processes (torchrun ranks) may build the same cache file at once: each writes its
    own temporary file in the same directory and ``os.replace`` swaps it in, which is atomic,
    so the last writer wins with identical content and nobody reads a half-written file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp_name, 0o644)  # mkstemp makes 0600; a shared cache should stay readable
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write`` for UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def ensure_generated_jsonl(path: Path, generate: Callable[[], list[dict]]) -> Path:
    """``path``, a JSONL of generated samples made on first use: ``generate()`` writes the
    samples' media files beside it and returns their records. The JSONL is written last, so its
    existence means every media file is there."""
    if not path.exists():
        records = generate()
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        log.info("Generated %s: %d samples", path, len(records))
    return path
