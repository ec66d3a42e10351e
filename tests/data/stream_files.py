"""Real source files for the streaming tests: the same numbered documents written as JSONL,
parquet (several row groups, several shards), arrow IPC files and streams, a datasets
save_to_disk folder and pre-tokenized .npy arrays."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchloom.data.tokenizer import Tokenizer

DOC_ID = re.compile(r"^(\w+) (\d+):")


def texts(name: str, count: int) -> list[str]:
    """Documents ``"<name> <i>: ..."`` of varied length, so each can be told apart when decoded."""
    return [f"{name} {i}: " + "the quick fox " * (i % 13 + 1) for i in range(count)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs), encoding="utf-8")
    return path


def write_parquet(path: Path, docs: list[str], rows_per_group: int = 7, field: str = "text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


def write_arrow(path: Path, docs: list[str], stream: bool = False, rows_per_batch: int = 5):
    """An arrow IPC file (random access), or an IPC stream as datasets writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    open_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, open_writer(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=rows_per_batch):
            writer.write_batch(batch)
    return path


def write_hf_dataset(path: Path, docs: list[str], num_shards: int = 2) -> Path:
    import datasets  # a dev dependency: only the tests write these folders

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path), num_shards=num_shards)
    return path


def write_npy(path: Path, docs: list[str], tokenizer: Tokenizer, dtype=np.uint16) -> Path:
    """The documents pre-tokenized: ids of each, then eos, back to back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [i for d in tokenizer.encode_batch(docs) for i in [*d, tokenizer.eos_id]]
    np.save(path, np.array(ids, dtype=dtype))
    return path


def stream_tokens(steps: list[list]) -> np.ndarray:
    """The packed stream behind served steps: each step's micro-batches' input tokens, rows in
    order (list every rank's steps in rank order to rebuild a data-parallel run's stream)."""
    return np.concatenate([b.tokens.reshape(-1).numpy() for step in steps for b in step])


def document_ids(tokens: np.ndarray, tokenizer: Tokenizer) -> list[tuple[str, int]]:
    """``(source name, number)`` of every whole document in ``tokens``, in order."""
    ends = np.flatnonzero(tokens == tokenizer.eos_id)
    found = []
    for begin, end in zip([-1, *ends[:-1].tolist()], ends.tolist()):
        match = DOC_ID.match(tokenizer.decode(tokens[begin + 1 : end].tolist()))
        if match and begin >= 0:  # the first document may have started before the tokens
            found.append((match.group(1), int(match.group(2))))
    return found
