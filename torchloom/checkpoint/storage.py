"""Where step checkpoints live: DCP's files in ``<root>/step-12/`` and, written last, a
``COMPLETE.json`` marker; on a local disk or at any fsspec URL (``memory://``, ``s3://``, ...).

A step folder without a marker is an interrupted save: never loaded, only cleaned up. A marker
that exists but does not read as one is damage (the marker is written atomically), never
cleaned up. The marker lists every file with its size (and optionally crc32), so ``verify``
names a truncated or damaged file before DCP fails somewhere inside unpickling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import re
import threading
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchloom.config.errors import ConfigError, warn

# A single process saves and loads without a process group, which is what DCP warns about.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")

MARKER = "COMPLETE.json"
MARKER_FORMAT = "torchloom-dcp-step"
MARKER_VERSION = 1
DCP_METADATA = ".metadata"
_STEP_DIR = re.compile(r"step-(\d+)")
_CRC_CHUNK_BYTES = 8 << 20
_RECOVERY_HINT = (
    "Resume from an older step with --checkpoint.load_step N, or pass --checkpoint.fallback "
    "true to fall back to the previous complete checkpoint automatically."
)


class ParallelRead:
    """DCP's file reader, reading its files on several threads at once (DCP reads them one
    after the other); each rank writes --checkpoint.writer_threads files, so a load of one
    rank's shards reads that many files in parallel."""

    read_threads = 8

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, []).append(item)
        read_file = super().read_data  # one file's requests, as DCP reads them
        with ThreadPoolExecutor(max(1, min(self.read_threads, len(per_file)))) as pool:
            for future in [
                pool.submit(read_file, dataclasses.replace(plan, items=items), planner)
                for items in per_file.values()
            ]:
                future.result().wait()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


class _LocalReader(ParallelRead, FileSystemReader):
    pass


class _FsspecReader(ParallelRead, FsspecReader):
    pass


# DCP runs a writer's extra threads (thread_count > 1) on this function.
_DCP_WRITER_THREAD = "_write_files_from_queue"


@contextlib.contextmanager
def _writer_thread_errors() -> Iterator[list[BaseException]]:
    """Collect the exceptions of DCP's extra writer threads. Left alone, each failing thread
    prints its own traceback (one per thread when a disk fills up) and its files silently drop
    out of the save while the save carries on; collected, the save fails once, in its caller.
    The hook is process-wide only while a save writes, and passes every other thread on."""
    errors: list[BaseException] = []
    previous = threading.excepthook
    before = set(threading.enumerate())

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and args.thread.name.endswith(f"({_DCP_WRITER_THREAD})"):
            errors.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = hook
    try:
        yield errors
    finally:
        # When the calling thread's own share failed, DCP raised without joining its threads.
        for thread in set(threading.enumerate()) - before:
            if thread.name.endswith(f"({_DCP_WRITER_THREAD})"):
                thread.join()
        threading.excepthook = previous


class CollectThreadErrors:
    """A DCP writer whose writer threads' errors fail the save once (``_writer_thread_errors``)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with _writer_thread_errors() as errors:
            written = super().write_data(plan, planner)
        if errors:
            raise errors[0]
        return written


class _LocalWriter(CollectThreadErrors, FileSystemWriter):
    pass


class _FsspecWriter(CollectThreadErrors, FsspecWriter):
    pass


class CheckpointError(RuntimeError):
    """A checkpoint operation that cannot go ahead; the message says why and what to do."""


class CheckpointCorruptError(CheckpointError):
    """A step marked complete whose files do not match its marker."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"Checkpoint file {path} {reason}. {_RECOVERY_HINT}")
        self.path = path
        self.reason = reason


def step_folder_name(step: int) -> str:
    """``step-12`` (the documented layout, ``<output_dir>/checkpoints/step-N/``)."""
    return f"step-{step}"


class CheckpointStorage:
    """Step checkpoints under one root on an fsspec filesystem (``for_path`` picks the backend).

    ``fs`` and ``root`` are what fsspec calls take; ``step_dir`` is what DCP's writer and reader
    take. The root must be storage every rank sees (the marker lists rank 0's view of it).
    """

    writer_class: type[FileSystemWriter] = _FsspecWriter
    reader_class: type[FileSystemReader] = _FsspecReader

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, root_url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.root_url = root_url.rstrip("/")
        self._folder_names: dict[int, str] = {}
        """Steps whose folder is not named step-N (see ``for_step_folder``)."""

    @staticmethod
    def for_path(root: str | os.PathLike[str]) -> CheckpointStorage:
        """A local path gives the local backend; a URL (``memory://x``, ``s3://b/x``) fsspec's."""
        root = os.fspath(root)
        if "://" not in root:
            return LocalCheckpointStorage(os.path.abspath(root))
        try:
            fs, path = fsspec.core.url_to_fs(root)
        except ImportError as err:  # fsspec knows the protocol; its package is not installed
            raise ConfigError(
                f"The checkpoint folder {root} needs a package: {err} (pip install it)."
            ) from None
        except ValueError as err:  # a protocol fsspec does not know
            raise ConfigError(
                f"The checkpoint folder {root}: {err}. Use a local path, or a URL whose "
                "protocol fsspec knows (s3://, gs://, memory://) with its package installed."
            ) from None
        return CheckpointStorage(fs, path, root)

    @staticmethod
    def for_step_folder(folder: str | os.PathLike[str]) -> tuple[CheckpointStorage, int]:
        """The storage holding one step folder, whatever the folder is called (a copy named
        ``mycopy`` works too), and the step its marker records."""
        folder = os.fspath(folder).rstrip("/")
        storage = CheckpointStorage.for_path(os.path.dirname(folder) or ".")
        name = os.path.basename(folder)
        marker_path = f"{storage.root}/{name}/{MARKER}"
        try:
            marker = json.loads(storage.fs.cat_file(marker_path))
            step = marker["step"]
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            step = None
        if not isinstance(step, int) or isinstance(step, bool):
            raise CheckpointError(
                f"{folder} has no readable {MARKER} recording its step, so it is not a complete "
                "training checkpoint step; pass a complete <output_dir>/checkpoints/step-N folder."
            )
        storage._folder_names[step] = name
        return storage, step

    def _folder_name(self, step: int) -> str:
        return self._folder_names.get(step, step_folder_name(step))

    def step_dir(self, step: int) -> str:
        """Path or URL of ``step``'s folder."""
        return f"{self.root_url}/{self._folder_name(step)}"

    def _fs_dir(self, step: int) -> str:
        return f"{self.root}/{self._folder_name(step)}"

    def steps_on_disk(self) -> list[int]:
        """Every step with a folder under the root, complete or not, ascending."""
        self.fs.invalidate_cache(self.root)  # other ranks and processes write here too
        if not self.fs.isdir(self.root):
            return []
        steps = []
        for entry in self.fs.ls(self.root, detail=True):
            name = posixpath.basename(entry["name"].rstrip("/"))
            match = _STEP_DIR.fullmatch(name)
            if match and entry["type"] == "directory" and step_folder_name(int(match[1])) == name:
                steps.append(int(match[1]))
        return sorted(steps)

    def complete_steps(self) -> list[int]:
        """Steps with a valid marker, ascending."""
        return [step for step in self.steps_on_disk() if self._marker_or_none(step) is not None]

    def incomplete_steps(self) -> list[int]:
        """Step folders without a valid marker: interrupted saves and damaged markers."""
        return [step for step in self.steps_on_disk() if self._marker_or_none(step) is None]

    def marked_steps(self) -> list[int]:
        """Step folders with a marker file, valid (complete) or not (damaged), ascending."""
        return [step for step in self.steps_on_disk() if self._has_marker_file(step)]

    def interrupted_steps(self) -> list[int]:
        """Step folders with no marker file at all: saves cut short, safe to remove (while no
        save is in flight, since a save in progress looks the same)."""
        return [step for step in self.steps_on_disk() if not self._has_marker_file(step)]

    def latest_complete(self) -> int | None:
        """The highest complete step, or None."""
        for step in reversed(self.steps_on_disk()):
            if self._marker_or_none(step) is not None:
                return step
        return None

    def remove(self, step: int) -> None:
        """Delete ``step``'s folder if there is one (an interrupted save, or keep_latest_k)."""
        folder = self._fs_dir(step)
        # Marker first: a removal cut short then leaves an incomplete step, not a corrupt one.
        for path, recursive in ((f"{folder}/{MARKER}", False), (folder, True)):
            with contextlib.suppress(FileNotFoundError):  # or another rank removed it first
                self.fs.rm(path, recursive=recursive)

    def prepare(self, step: int) -> None:
        """Make ``step``'s folder ready for a save: clear an interrupted save there and create
        it. Refuses a step that is complete already (``remove`` it first). One process does
        this (rank 0 of a multi-rank save, the others waiting): a rank clearing the folder
        while another creates it can fail on the half-made folder."""
        if self._marker_or_none(step) is not None:
            raise CheckpointError(
                f"Step {step} is already saved and complete at {self.step_dir(step)}; remove it "
                f"first (storage.remove({step})) to save that step again."
            )
        self.remove(step)
        self.fs.makedirs(self._fs_dir(step), exist_ok=True)

    def writer(
        self, step: int, thread_count: int = 1, sync_files: bool = True, prepare: bool = True
    ) -> FileSystemWriter:
        """A DCP StorageWriter into ``step``'s folder, ``prepare``-d first unless told not to
        (every rank of a multi-rank save calls this with ``prepare=False`` after rank 0 has
        prepared the folder; DCP writes no file before every rank has planned)."""
        if prepare:
            self.prepare(step)
        return self.writer_class(
            self.step_dir(step),
            single_file_per_rank=True,
            sync_files=sync_files,
            thread_count=thread_count,
        )

    def reader(self, step: int) -> FileSystemReader:
        """A DCP StorageReader for ``step``, which must be complete."""
        self.read_marker(step)
        return self.reader_class(self.step_dir(step))

    def mark_complete(
        self, step: int, extra: dict[str, Any] | None = None, checksums: bool = False
    ) -> dict[str, Any]:
        """Write ``step``'s marker (rank 0, once every rank's files are written) and return it.

        ``extra`` (JSON-able) is stored as-is; ``checksums`` also records each file's crc32,
        which reads every byte back once.
        """
        folder = self._fs_dir(step)
        files = self._files(folder)
        if DCP_METADATA not in files:
            raise CheckpointError(
                f"{self.step_dir(step)} has no {DCP_METADATA}, so DCP's save has not finished; "
                "call mark_complete after dcp.save returns (or async_save's future completes)."
            )
        missing = self._dcp_files(step) - files.keys()
        if missing:
            raise CheckpointError(
                f"{self.step_dir(step)} lacks {sorted(missing)}, which DCP's {DCP_METADATA} names; "
                "is the checkpoint root on storage that every rank (on every node) writes to?"
            )
        marker = {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "step": step,
            "time_utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "extra": extra or {},
            "files": files,
        }
        if checksums:
            marker["crc32"] = {name: self._crc32(f"{folder}/{name}") for name in files}
        self._write_marker(folder, json.dumps(marker, indent=2) + "\n")
        return marker

    def read_marker(self, step: int) -> dict[str, Any]:
        """``step``'s marker; a CheckpointError when the step is not complete."""
        marker = self._marker_or_none(step)
        if marker is None:
            raise CheckpointError(
                f"{self.step_dir(step)} has no valid {MARKER}: the save of step {step} did not "
                f"finish. Complete steps here: {self.complete_steps()}."
            )
        return marker

    def verify(self, step: int, checksums: bool = False) -> None:
        """Raise CheckpointCorruptError naming the first file that does not match the marker.

        Checks sizes, that every file DCP's metadata names is there, and the crc32s when
        ``mark_complete`` recorded them (reading every byte): a checkpoint saved with checksums
        is checked whoever loads it. ``checksums`` (asked for by the loader) warns when the
        step has none to check.
        """
        url = self.step_dir(step)
        marker = self._marker_or_none(step)
        if marker is None and self._has_marker_file(step):
            reason = (
                f"is not a valid marker: unreadable, or not written by torchloom for step {step}"
            )
            raise CheckpointCorruptError(f"{url}/{MARKER}", reason)
        if marker is None:
            raise CheckpointCorruptError(f"{url}/{MARKER}", "is missing")
        listed: dict[str, int] = marker["files"]
        if DCP_METADATA not in listed:
            raise CheckpointCorruptError(f"{url}/{DCP_METADATA}", f"is not listed in {MARKER}")
        on_disk = self._files(self._fs_dir(step))
        for name, size in listed.items():
            if name not in on_disk:
                raise CheckpointCorruptError(f"{url}/{name}", "is missing")
            if on_disk[name] != size:
                reason = f"has {on_disk[name]} bytes where {MARKER} recorded {size}"
                raise CheckpointCorruptError(f"{url}/{name}", reason)
        try:
            dcp_files = self._dcp_files(step)
        except Exception as err:  # whatever unpickling a damaged file raises
            raise CheckpointCorruptError(
                f"{url}/{DCP_METADATA}", f"cannot be read ({err})"
            ) from err
        unlisted = sorted(dcp_files - listed.keys())
        if unlisted:
            reason = f"is named by {DCP_METADATA} but not by {MARKER}"
            raise CheckpointCorruptError(f"{url}/{unlisted[0]}", reason)
        if "crc32" not in marker:
            if checksums:
                warn(f"{url} was saved without checksums: only its files' sizes are checked.")
            return
        for name, expected in marker["crc32"].items():
            actual = self._crc32(f"{self._fs_dir(step)}/{name}")
            if actual != expected:
                reason = f"has crc32 {actual:#010x} where {MARKER} recorded {expected:#010x}"
                raise CheckpointCorruptError(f"{url}/{name}", reason)

    def _files(self, folder: str) -> dict[str, int]:
        """{name relative to ``folder``: size in bytes} of the files under it, marker aside."""
        self.fs.invalidate_cache(folder)
        found = self.fs.find(folder, withdirs=False, detail=True)
        sizes = {posixpath.relpath(path, folder): info["size"] for path, info in found.items()}
        return {name: size for name, size in sorted(sizes.items()) if not name.startswith(MARKER)}

    def _dcp_files(self, step: int) -> set[str]:
        """The data files DCP's ``.metadata`` for ``step`` refers to."""
        metadata = self.reader_class(self.step_dir(step)).read_metadata()
        return {info.relative_path for info in (metadata.storage_data or {}).values()}

    def _crc32(self, path: str) -> int:
        crc = 0
        with self.fs.open(path, "rb") as file:
            while chunk := file.read(_CRC_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
        return crc

    def _has_marker_file(self, step: int) -> bool:
        folder = self._fs_dir(step)
        self.fs.invalidate_cache(folder)
        return self.fs.exists(f"{folder}/{MARKER}")

    def _marker_or_none(self, step: int) -> dict[str, Any] | None:
        try:
            marker = json.loads(self.fs.cat_file(f"{self._fs_dir(step)}/{MARKER}"))
        except (FileNotFoundError, ValueError):
            # Only "absent" and "garbage" mean incomplete: an I/O or permission error must not
            # make a good checkpoint look like one to clean up.
            return None
        valid = (
            isinstance(marker, dict)
            and marker.get("format") == MARKER_FORMAT
            and marker.get("step") == step
            and isinstance(marker.get("files"), dict)
        )
        return marker if valid else None

    def _write_marker(self, folder: str, text: str) -> None:
        self.fs.pipe_file(f"{folder}/{MARKER}", text.encode())  # one object: atomic on stores


class LocalCheckpointStorage(CheckpointStorage):
    """Step checkpoints under a local (or network-mounted) directory."""

    writer_class = _LocalWriter
    reader_class = _LocalReader

    def __init__(self, root: str) -> None:
        super().__init__(LocalFileSystem(), root, root)

    def _write_marker(self, folder: str, text: str) -> None:
        # Rename over a synced temp file, then sync the folder: after a crash the marker is
        # either absent or whole, never a torn file that happens to parse.
        tmp = os.path.join(folder, MARKER + ".tmp")
        with open(tmp, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, os.path.join(folder, MARKER))
        folder_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(folder_fd)
        finally:
            os.close(folder_fd)
