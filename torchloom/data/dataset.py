"""Documents -> train/val token arrays, tokenized once and cached on disk as ``.npy``."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from torchloom.config.errors import ConfigError
from torchloom.data.cache import atomic_write, atomic_write_text
from torchloom.data.readers import token_arrays
from torchloom.data.sources import SourceFile, check_entries_have_documents, iter_documents
from torchloom.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when the tokenization or split rules change, so old token caches are not reused.
DATASET_VERSION = 1
# Fixed, not the training seed: the validation documents stay the same across runs.
SPLIT_SEED = 1234
ENCODE_CHUNK_DOCS = 1024
T = TypeVar("T")


@dataclass
class TokenDataset:
    """All documents as two flat token streams, each document followed by ``eos``."""

    train_tokens: np.ndarray
    """1-D uint16/uint32 array (memory-mapped) of the training documents."""
    val_tokens: np.ndarray
    """1-D array of the held-out documents (empty when val_fraction is 0)."""
    eos_id: int
    num_docs: int
    num_val_docs: int

    @classmethod
    def build(
        cls,
        files: list[SourceFile],
        tokenizer: Tokenizer,
        val_fraction: float,
        cache_dir: Path,
        sources: list[tuple[str, int]] | None = None,
    ) -> TokenDataset:
        """Load the token arrays for ``files`` from the cache, tokenizing them first if needed.
        ``sources``: the --data.sources entries the files came from, (entry, its number of
        files) in order; an entry without a document is refused, naming it."""
        key = _cache_key(files, tokenizer, val_fraction)
        stem = cache_dir / "tokens" / key[:20]
        meta_path = stem.with_suffix(".json")
        train_path, val_path = stem.with_suffix(".train.npy"), stem.with_suffix(".val.npy")
        if not meta_path.exists():
            _tokenize_to_cache(
                files, tokenizer, val_fraction, train_path, val_path, meta_path, sources
            )
        meta = json.loads(meta_path.read_text())
        return cls(
            train_tokens=np.load(train_path, mmap_mode="r"),
            val_tokens=np.load(val_path, mmap_mode="r"),
            eos_id=meta["eos_id"],
            num_docs=meta["num_docs"],
            num_val_docs=meta["num_val_docs"],
        )


def num_val_docs(num_docs: int, val_fraction: float) -> int:
    """Held-out document count: at least one when validating, never all of them."""
    if val_fraction <= 0 or num_docs < 2:
        return 0
    return min(max(round(num_docs * val_fraction), 1), num_docs - 1)


def held_out_mask(num_docs: int, val_fraction: float) -> np.ndarray:
    """Which documents are validation documents: chosen by a fixed seed, not the training one."""
    rng = np.random.default_rng(SPLIT_SEED)
    is_val = np.zeros(num_docs, dtype=bool)
    is_val[rng.choice(num_docs, num_val_docs(num_docs, val_fraction), replace=False)] = True
    return is_val


def _cache_key(files: list[SourceFile], tokenizer: Tokenizer, val_fraction: float) -> str:
    parts = {
        "version": DATASET_VERSION,
        "sources": [f.fingerprint() for f in files],
        "tokenizer": tokenizer.fingerprint(),
        "val_fraction": val_fraction,
        "split_seed": SPLIT_SEED,
    }
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


def _tokenize_to_cache(
    files: list[SourceFile],
    tokenizer: Tokenizer,
    val_fraction: float,
    train_path: Path,
    val_path: Path,
    meta_path: Path,
    sources: list[tuple[str, int]] | None = None,
) -> None:
    start = time.perf_counter()
    # Two passes over the files (count, then tokenize) keep only one chunk of text in memory.
    eos, vocab = tokenizer.eos_id, tokenizer.vocab_size
    docs_per_file = [sum(1 for _ in iter_documents([f], eos, vocab)) for f in files]
    if sources is not None:
        check_entries_have_documents(sources, docs_per_file)
    num_docs = sum(docs_per_file)
    if num_docs == 0:
        raise ConfigError(f"The data sources {[str(f.path) for f in files]} contain no text.")
    is_val = held_out_mask(num_docs, val_fraction)

    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    splits: dict[bool, list[np.ndarray]] = {False: [], True: []}
    doc_index = 0
    for docs in chunked(iter_documents(files, eos, vocab), ENCODE_CHUNK_DOCS):
        flat: dict[bool, list[np.ndarray]] = {False: [], True: []}
        for ids in token_arrays(docs, tokenizer):  # each ends with eos
            flat[bool(is_val[doc_index])].append(ids)
            doc_index += 1
        for split, arrays in flat.items():
            if arrays:
                splits[split].append(np.concatenate(arrays).astype(dtype))
    empty = [np.zeros(0, dtype)]
    train, val = np.concatenate(splits[False] or empty), np.concatenate(splits[True] or empty)

    atomic_write(train_path, lambda f: np.save(f, train))
    atomic_write(val_path, lambda f: np.save(f, val))
    meta = {
        "eos_id": tokenizer.eos_id,
        "num_docs": num_docs,
        "num_val_docs": int(is_val.sum()),
        "train_tokens": len(train),
        "val_tokens": len(val),
        "sources": [str(f.path) for f in files],
        "tokenizer": str(tokenizer.path),
    }
    # The meta file is written last: its presence means both arrays are complete.
    atomic_write_text(meta_path, json.dumps(meta, indent=1))
    log.info(
        "Tokenized %d documents into %d train + %d val tokens in %.1fs (cached in %s)",
        num_docs,
        len(train),
        len(val),
        time.perf_counter() - start,
        meta_path.parent,
    )


def chunked(items: Iterator[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of ``size`` (the last may be shorter)."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
