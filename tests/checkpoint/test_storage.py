"""Step checkpoint storage on a local folder and on fsspec's memory://: DCP round trip, which
steps count as complete, cleanup of interrupted saves, and what verify catches."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchloom.checkpoint.storage import (
    MARKER,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorage,
)

DATA_FILE = "__0_0.distcp"  # rank 0's file with single_file_per_rank


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        yield CheckpointStorage.for_path(tmp_path / "checkpoints")
        return
    storage = CheckpointStorage.for_path(f"memory://test-storage-{uuid.uuid4().hex}/checkpoints")
    yield storage
    memory = fsspec.filesystem("memory")
    top = storage.root.rsplit("/", 1)[0]
    if memory.exists(top):
        memory.rm(top, recursive=True)


def tiny_state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=generator), "nested": {"b": torch.arange(5) + seed}}


def save(storage: CheckpointStorage, step: int, complete: bool = True, **marker_kwargs) -> dict:
    state = tiny_state(step)
    dcp.save(state, storage_writer=storage.writer(step), no_dist=True)
    if complete:
        storage.mark_complete(step, **marker_kwargs)
    return state


def rewrite(storage: CheckpointStorage, step: int, name: str, edit) -> None:
    path = f"{storage.step_dir(step)}/{name}"
    storage.fs.pipe_file(path, edit(storage.fs.cat_file(path)))


def test_round_trip_is_bitwise(storage):
    saved = save(storage, 3, extra={"tokens_seen": 123})
    loaded = {"w": torch.zeros(4, 3), "nested": {"b": torch.zeros(5, dtype=torch.long)}}
    dcp.load(loaded, storage_reader=storage.reader(3), no_dist=True)
    for got, want in [(loaded["w"], saved["w"]), (loaded["nested"]["b"], saved["nested"]["b"])]:
        print(f"max |loaded - saved| = {(got - want).abs().max().item()}")
        assert torch.equal(got, want)
    marker = storage.read_marker(3)
    print(f"{storage.step_dir(3)}: {marker['files']}")
    assert marker["step"] == 3 and marker["extra"] == {"tokens_seen": 123}
    assert {".metadata", DATA_FILE} <= marker["files"].keys() and "crc32" not in marker
    assert not storage.fs.exists(f"{storage.step_dir(3)}/{MARKER}.tmp")


def test_complete_steps_are_sorted_and_skip_unmarked_and_unrelated(storage):
    assert storage.steps_on_disk() == [] and storage.latest_complete() is None  # no root yet
    for step in (12, 4, 8):
        save(storage, step)
    save(storage, 16, complete=False)
    storage.fs.makedirs(f"{storage.root}/step-abc", exist_ok=True)
    storage.fs.makedirs(f"{storage.root}/step-020", exist_ok=True)  # not the name of step 20
    storage.fs.pipe_file(f"{storage.root}/notes.txt", b"unrelated")
    print(f"on disk {storage.steps_on_disk()}, complete {storage.complete_steps()}")
    assert storage.steps_on_disk() == [4, 8, 12, 16]
    assert storage.complete_steps() == [4, 8, 12] and storage.latest_complete() == 12
    assert storage.incomplete_steps() == [16]


def test_unmarked_step_is_incomplete_until_removed(storage):
    save(storage, 5, complete=False)
    assert storage.incomplete_steps() == [5] and storage.complete_steps() == []
    with pytest.raises(CheckpointError, match="did not finish"):
        storage.reader(5)
    storage.remove(5)
    assert storage.steps_on_disk() == [] and not storage.fs.exists(storage.step_dir(5))
    storage.remove(5)  # already gone: no error


def test_garbage_marker_counts_as_incomplete(storage):
    save(storage, 7)
    rewrite(storage, 7, MARKER, lambda data: data[: len(data) // 2])
    assert storage.complete_steps() == [] and storage.incomplete_steps() == [7]
    with pytest.raises(CheckpointCorruptError, match=MARKER):
        storage.verify(7)


def test_verify_names_a_truncated_file(storage, capsys):
    save(storage, 9)
    storage.verify(9)
    assert capsys.readouterr().err == ""
    storage.verify(9, checksums=True)  # no checksums recorded: sizes only, and a warning
    assert "was saved without checksums: only its files' sizes are checked" in (
        capsys.readouterr().err
    )
    rewrite(storage, 9, DATA_FILE, lambda data: data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError) as caught:
        storage.verify(9)
    print(caught.value)
    assert DATA_FILE in str(caught.value) and "--checkpoint.load_step" in str(caught.value)
    assert caught.value.path == f"{storage.step_dir(9)}/{DATA_FILE}"


def test_flipped_byte_is_caught_by_the_recorded_checksums(storage):
    """Recorded at save, checked by every load (the loader need not ask for them again)."""
    save(storage, 10, checksums=True)
    marker = storage.read_marker(10)
    print(f"crc32 recorded: {marker['crc32']}")
    assert marker["crc32"].keys() == marker["files"].keys()

    def flip_middle_byte(data: bytes) -> bytes:
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]

    rewrite(storage, 10, DATA_FILE, flip_middle_byte)
    for checksums in (True, False):  # same size: only the crc32 finds it
        with pytest.raises(CheckpointCorruptError, match="crc32") as caught:
            storage.verify(10, checksums=checksums)
        print(caught.value)
        assert DATA_FILE in str(caught.value)


def test_mark_complete_refuses_a_step_missing_a_dcp_file(storage):
    save(storage, 11, complete=False)
    storage.fs.rm(f"{storage.step_dir(11)}/{DATA_FILE}")
    with pytest.raises(CheckpointError, match=DATA_FILE):
        storage.mark_complete(11)
    assert storage.complete_steps() == []


def test_writer_refuses_a_complete_step_and_clears_an_incomplete_one(storage):
    save(storage, 2)
    with pytest.raises(CheckpointError, match="already saved and complete"):
        storage.writer(2)
    save(storage, 6, complete=False)
    stale = f"{storage.step_dir(6)}/stale.bin"
    storage.fs.pipe_file(stale, b"from the interrupted save")
    save(storage, 6)
    marker = json.loads(storage.fs.cat_file(f"{storage.step_dir(6)}/{MARKER}"))
    print(f"files after re-save: {sorted(marker['files'])}")
    assert not storage.fs.exists(stale) and "stale.bin" not in marker["files"]
    assert storage.complete_steps() == [2, 6]


def test_a_url_fsspec_cannot_open_is_one_error() -> None:
    """An unknown protocol, or a known one whose package is missing (s3fs on this machine), is
    one ConfigError naming the folder, not fsspec's traceback."""
    import importlib.util

    from torchloom.checkpoint.storage import CheckpointStorage
    from torchloom.config.errors import ConfigError

    with pytest.raises(ConfigError, match="nosuch://b/x: Protocol not known"):
        CheckpointStorage.for_path("nosuch://b/x")
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(ConfigError, match="s3://b/x needs a package: Install s3fs"):
            CheckpointStorage.for_path("s3://b/x")
