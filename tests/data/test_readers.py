"""Readers: every format resumes at the position after any document with the documents that
follow it, whatever the record batches and scan windows are."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.data.stream_files import (
    write_arrow,
    write_hf_dataset,
    write_jsonl,
    write_npy,
    write_parquet,
)
from torchloom.data import readers
from torchloom.data.readers import read_documents

DOCS = [f"doc {i} " + "x" * (i % 5) for i in range(30)]
WITH_GAPS = [*DOCS[:7], "", None, *DOCS[7:]]  # skipped rows in the middle


@pytest.fixture(autouse=True)
def small_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several parquet batches per row group, several .npy windows per document."""
    monkeypatch.setattr(readers, "READ_ROWS", 3)
    monkeypatch.setattr(readers, "NPY_CHUNK", 4)


def files(tmp_path: Path, tokenizer) -> dict[str, tuple[Path, str | None]]:
    hf = write_hf_dataset(tmp_path / "hf", DOCS, num_shards=1)
    return {
        "jsonl": (write_jsonl(tmp_path / "a.jsonl", DOCS), "text"),
        "parquet": (write_parquet(tmp_path / "a.parquet", WITH_GAPS, rows_per_group=8), "text"),
        "arrow file": (write_arrow(tmp_path / "a.arrow", WITH_GAPS, rows_per_batch=4), "text"),
        "arrow stream": (write_arrow(tmp_path / "s.arrow", WITH_GAPS, stream=True), "text"),
        "datasets shard": (next(hf.glob("*.arrow")), "text"),
        "npy": (write_npy(tmp_path / "a.npy", DOCS, tokenizer), None),
    }


def as_text(doc, tokenizer) -> str:
    return doc if isinstance(doc, str) else tokenizer.decode(doc[:-1].tolist())


def test_every_position_resumes_with_the_next_document(tmp_path: Path, tiny_tokenizer) -> None:
    eos = tiny_tokenizer.eos_id
    for name, (path, field) in files(tmp_path, tiny_tokenizer).items():
        found = list(read_documents(path, field, eos_id=eos))
        assert [as_text(d, tiny_tokenizer) for d, _ in found] == DOCS, name
        if name == "npy":
            assert all(d[-1] == eos for d, _ in found)
        expected = [(as_text(d, tiny_tokenizer), after) for d, after in found]
        for k, (_, after) in enumerate(found):
            rest = [(as_text(d, tiny_tokenizer), position)
                    for d, position in read_documents(path, field, after, eos)]  # fmt: skip
            assert rest == expected[k + 1 :], f"{name}: resuming after document {k} at {after}"


def test_npy_without_a_final_eos_gets_one(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.array([5, 6, 0, 0, 7, 8, 9, 10, 11], dtype=np.int32))
    found = [d.tolist() for d, _ in read_documents(tmp_path / "t.npy", None, eos_id=0)]
    assert found == [[5, 6, 0], [7, 8, 9, 10, 11, 0]]  # the lone eos (empty document) skipped
