"""TokenDataset: documents + eos in two splits, cached on disk and reused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from torchloom.config.errors import ConfigError
from torchloom.data.dataset import TokenDataset, num_val_docs
from torchloom.data.sources import SourceFile
from torchloom.data.tokenizer import Tokenizer

DOCS = [f"Document number {i} says {'hello ' * (i % 5)}." for i in range(50)]


def jsonl_source(tmp_path: Path, docs: list[str] = DOCS) -> list[SourceFile]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return [SourceFile(path, "text")]


def split_documents(tokens: np.ndarray, tok: Tokenizer) -> list[str]:
    """Decode a token stream back into its eos-terminated documents."""
    assert len(tokens) == 0 or tokens[-1] == tok.eos_id, "every document must end with eos"
    ends = np.flatnonzero(tokens == tok.eos_id)
    return [tok.decode(d[:-1].tolist()) for d in np.split(np.asarray(tokens), ends + 1)[:-1]]


def test_documents_split_into_train_and_val(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    ds = TokenDataset.build(jsonl_source(tmp_path), tiny_tokenizer, 0.1, tmp_path / "cache")
    train, val = (
        split_documents(ds.train_tokens, tiny_tokenizer),
        split_documents(ds.val_tokens, tiny_tokenizer),
    )
    assert (ds.num_docs, ds.num_val_docs, len(val)) == (50, 5, 5)
    assert sorted(train + val) == sorted(DOCS)
    assert [d for d in DOCS if d in train] == train, "train documents keep their order"
    assert ds.train_tokens.dtype == np.uint16 and isinstance(ds.train_tokens, np.memmap)
    assert ds.eos_id == tiny_tokenizer.eos_id


def test_split_is_deterministic(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    a = TokenDataset.build(jsonl_source(tmp_path / "a"), tiny_tokenizer, 0.1, tmp_path / "ca")
    b = TokenDataset.build(jsonl_source(tmp_path / "b"), tiny_tokenizer, 0.1, tmp_path / "cb")
    np.testing.assert_array_equal(a.val_tokens, b.val_tokens)


@pytest.mark.parametrize(
    ("num_docs", "fraction", "expected"),
    [(1, 0.5, 0), (2, 0.01, 1), (100, 0.02, 2), (3, 0.9, 2), (10, 0.0, 0)],
)
def test_num_val_docs(num_docs: int, fraction: float, expected: int) -> None:
    assert num_val_docs(num_docs, fraction) == expected


def test_cache_is_reused_without_retokenizing(
    tiny_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files, cache = jsonl_source(tmp_path), tmp_path / "cache"
    first = TokenDataset.build(files, tiny_tokenizer, 0.1, cache)
    cached = sorted((cache / "tokens").iterdir())
    mtimes = [p.stat().st_mtime_ns for p in cached]
    assert [p.suffixes[-2:] for p in cached] == [[".json"], [".train", ".npy"], [".val", ".npy"]]

    def fail(texts: list[str]) -> list[list[int]]:
        raise AssertionError("the second build re-tokenized instead of using the cache")

    monkeypatch.setattr(tiny_tokenizer, "encode_batch", fail)
    second = TokenDataset.build(files, tiny_tokenizer, 0.1, cache)
    np.testing.assert_array_equal(second.train_tokens, first.train_tokens)
    assert [p.stat().st_mtime_ns for p in cached] == mtimes


def test_editing_a_source_invalidates_the_cache(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    files, cache = jsonl_source(tmp_path), tmp_path / "cache"
    before = TokenDataset.build(files, tiny_tokenizer, 0.1, cache)
    jsonl_source(tmp_path, DOCS[:10])
    os.utime(files[0].path, ns=(1, 1))  # a distinct mtime even on coarse-clock filesystems
    after = TokenDataset.build(files, tiny_tokenizer, 0.1, cache)
    assert (before.num_docs, after.num_docs) == (50, 10)


def test_empty_sources_are_a_config_error(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contain no text"):
        TokenDataset.build(jsonl_source(tmp_path, []), tiny_tokenizer, 0.1, tmp_path / "c")
