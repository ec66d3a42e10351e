"""Read the documents of one source file from a position, and say where each one ends.

Every format yields ``(document, position after it)``. A position is two integers whose meaning
depends on the format, so a stream can stop anywhere and resume at the next document:

| format    | position (a, b)                  | document                                  |
| --------- | -------------------------------- | ----------------------------------------- |
| .txt      | (0, 0) before, (1, 0) after      | the whole file (text)                     |
| .jsonl    | (byte offset of the next line, 0) | ``text_field`` of each line (text)       |
| .parquet  | (row group, row inside it)       | ``text_field`` of each row (text)         |
| .arrow    | (record batch, row inside it)    | ``text_field`` of each row (text)         |
| .npy      | (token offset, 0)                | token ids up to and with each eos (array) |

Parquet is read one row group at a time in record batches, arrow files are memory-mapped:
neither is ever loaded whole. Empty documents (and null rows) are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchloom.config.errors import ConfigError, did_you_mean

Position = tuple[int, int]
Document = str | np.ndarray
"""Text to tokenize, or (from .npy files) token ids ending with eos."""
READ_ROWS = 1024
"""Rows per record batch read from a parquet row group."""
NPY_CHUNK = 1 << 16
"""Tokens of a .npy source scanned for eos at a time."""
NPY_DTYPES = (np.uint16, np.int32, np.uint32, np.int64)


def import_pyarrow() -> Any:
    """pyarrow (a runtime dependency), or a ConfigError saying how to install it."""
    try:  # imported here: only parquet and arrow sources pay its import time
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(
            "Parquet and arrow data sources need pyarrow, which is not installed: "
            "pip install pyarrow"
        ) from None
    return pyarrow


def source_suffix(path: Path) -> str:
    """A source file's extension in lower case, so that ``part-0.PARQUET`` reads as parquet
    (and a folder of such shards is not skipped)."""
    return path.suffix.lower()


def read_documents(
    path: Path,
    text_field: str | None,
    start: Position = (0, 0),
    eos_id: int | None = None,
    vocab_size: int | None = None,
) -> Iterator[tuple[Document, Position]]:
    """The documents of ``path`` from ``start`` on, each with the position after it.

    ``text_field`` names the JSON field or column (None for .txt); ``eos_id`` is required for
    .npy files (it separates their documents), whose ids must be below ``vocab_size``.
    """
    suffix = source_suffix(path)
    if suffix == ".txt":
        return _read_txt(path, start)
    if suffix == ".jsonl":
        return _read_jsonl(path, text_field or "text", start)
    if suffix == ".parquet":
        return _read_parquet(path, text_field or "text", start)
    if suffix == ".arrow":
        return _read_arrow(path, text_field or "text", start)
    if suffix == ".npy":
        if eos_id is None:
            raise ValueError("reading a .npy token source needs the tokenizer's eos id")
        return _read_npy(path, eos_id, start, vocab_size)
    raise ConfigError(f"Data source '{path}' has an unsupported extension '{suffix}'.")


def _past_the_end(path: Path, where: str) -> ConfigError:
    """The error for a resumed stream whose saved position lies past what ``path`` now holds."""
    return ConfigError(
        f"{path}: the loader state points at {where}, past what the file now holds: the source "
        "changed since the checkpoint. Resume with the data the run was reading, or restore "
        "everything but the data position with --checkpoint.exclude_from_loading dataloader."
    )


def _read_txt(path: Path, start: Position) -> Iterator[tuple[Document, Position]]:
    if start[0] > 0:
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not valid UTF-8 at byte {e.start}. Re-encode the file as UTF-8."
        ) from None
    if text:
        yield text, (1, 0)


def _read_jsonl(path: Path, text_field: str, start: Position) -> Iterator[tuple[str, Position]]:
    offset = start[0]
    if offset > path.stat().st_size:
        raise _past_the_end(path, f"byte {offset}")
    with path.open("rb") as f:
        line_number = _count_lines(f, offset)  # for messages: resumed streams start mid-file
        while raw := f.readline():
            offset += len(raw)
            line_number += 1
            if not raw.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(
                    f"{where}: not a valid JSON line ({e}). Each line of a .jsonl source must "
                    f'be one JSON object such as {{"{text_field}": "..."}}.'
                ) from None
            text = record_text(where, record, text_field)
            if text:
                yield text, (offset, 0)


def _count_lines(f: Any, end: int) -> int:
    """Newlines in the first ``end`` bytes of ``f``, read in chunks; leaves ``f`` at ``end``."""
    count = 0
    while f.tell() < end and (chunk := f.read(min(1 << 20, end - f.tell()))):
        count += chunk.count(b"\n")
    return count


def record_text(where: str, record: object, text_field: str) -> str:
    """The document text of a parsed JSONL ``record``; ConfigError naming ``where`` if absent."""
    if not isinstance(record, dict):
        kind = "null" if record is None else f"a {type(record).__name__}"
        raise ConfigError(
            f"{where}: the line is {kind}, not a JSON object; each line of a .jsonl source must "
            f'be an object such as {{"{text_field}": "..."}}.'
        )
    chat = CHAT_HINT if "messages" in record else ""
    if text_field not in record:
        keys = list(record)
        raise ConfigError(
            f"{where}: no field '{text_field}' (found {keys}).{did_you_mean(text_field, keys)}"
            f" Set --data.text_field to the field holding the text.{chat}"
        )
    text = record[text_field]
    if text is None:  # a null text is an empty document, skipped like a null parquet row
        return ""
    if not isinstance(text, str):
        raise ConfigError(
            f"{where}: field '{text_field}' is a {type(text).__name__}, not a string.{chat}"
        )
    return text


CHAT_HINT = (
    " The line holds chat 'messages': to train on conversations, use --data.format chat "
    "(docs/sft.md)."
)


def check_text_column(path: Path, schema: Any, text_field: str) -> None:
    """ConfigError unless ``schema`` has a string column ``text_field``, naming the columns."""
    pa = import_pyarrow()
    names = list(schema.names)
    if text_field not in names:
        raise ConfigError(
            f"{path}: no column '{text_field}' (columns: {', '.join(names)})."
            f"{did_you_mean(text_field, names)} Set --data.text_field to the column holding "
            "the text."
        )
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):  # dictionary-encoded strings read as the strings
        kind = kind.value_type
    # string_view exists from pyarrow 16 (the floor is 15); a column of nulls only (all its
    # rows skipped, as null rows are) reads as type null.
    is_view = getattr(pa.types, "is_string_view", lambda kind: False)
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)
            or _is_binary(pa, kind) or pa.types.is_null(kind)):  # fmt: skip
        raise ConfigError(
            f"{path}: column '{text_field}' holds {kind}, not strings; set --data.text_field to "
            "the column holding the text."
        )


def _is_binary(pa: Any, kind: Any) -> bool:
    """Bytes columns: parquet writers that leave out the UTF-8 annotation store text so."""
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _column_texts(path: Path, column: Any, where: str) -> list[str | None]:
    """A text column's values as Python strings; bytes are decoded as UTF-8, and bytes that
    are not UTF-8 are a ConfigError naming ``where`` (the row group or record batch)."""
    pa = import_pyarrow()
    if pa.types.is_dictionary(column.type) and _is_binary(pa, column.type.value_type):
        column = column.dictionary_decode()
    if _is_binary(pa, column.type):
        try:
            column = column.cast(pa.large_string())
        except pa.ArrowInvalid as e:
            raise ConfigError(
                f"{path}: {where} of the text column holds bytes that are not UTF-8 text ({e})."
            ) from None
    return column.to_pylist()


def _read_parquet(path: Path, text_field: str, start: Position) -> Iterator[tuple[str, Position]]:
    pa = import_pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(path, memory_map=True)
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{path}: not a readable parquet file ({e}).") from None
    check_text_column(path, parquet.schema_arrow, text_field)
    first_group, skip = start
    groups = parquet.num_row_groups
    rows = parquet.metadata.row_group(first_group).num_rows if first_group < groups else 0
    if first_group > groups or skip > rows:
        raise _past_the_end(path, f"row {skip} of row group {first_group}")
    for group in range(first_group, groups):
        to_skip = skip if group == first_group else 0
        row = 0  # rows of the group before the current batch
        batches = parquet.iter_batches(
            batch_size=READ_ROWS, row_groups=[group], columns=[text_field], use_threads=False
        )
        for batch in batches:
            first, row = row, row + batch.num_rows
            if row <= to_skip:
                continue
            begin = max(to_skip - first, 0)
            texts = _column_texts(path, batch.column(0).slice(begin), f"row group {group}")
            for after, text in enumerate(texts, first + begin + 1):
                if text:
                    yield text, (group, after)


def _read_arrow(path: Path, text_field: str, start: Position) -> Iterator[tuple[str, Position]]:
    """Arrow IPC files or streams (``Dataset.save_to_disk`` writes streams), memory-mapped."""
    pa = import_pyarrow()
    source = pa.memory_map(str(path))
    try:
        try:
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            schema = reader.schema
            batches = iter(reader)
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"{path}: not a readable arrow file ({e}).") from None
    check_text_column(path, schema, text_field)
    column = schema.get_field_index(text_field)
    first_batch, skip = start
    index = -1
    for index, batch in enumerate(batches):
        if index < first_batch:
            continue
        begin = skip if index == first_batch else 0
        if begin > batch.num_rows:
            raise _past_the_end(path, f"row {skip} of record batch {first_batch}")
        texts = _column_texts(path, batch.column(column).slice(begin), f"record batch {index}")
        for row, text in enumerate(texts, begin + 1):
            if text:
                yield text, (index, row)
    if first_batch > index and (first_batch, skip) != (0, 0):
        raise _past_the_end(path, f"record batch {first_batch}")


def _read_npy(
    path: Path, eos_id: int, start: Position, vocab_size: int | None
) -> Iterator[tuple[np.ndarray, Position]]:
    """Documents of a 1-D token array: the runs ending with eos (the last one may lack it)."""
    tokens = load_token_array(path)
    if vocab_size is not None:
        for doc, position in _read_npy(path, eos_id, start, None):
            if int(doc.max()) >= vocab_size or int(doc.min()) < 0:
                bad = int(doc.max()) if int(doc.max()) >= vocab_size else int(doc.min())
                raise ConfigError(
                    f"{path}: token id {bad} is outside the tokenizer's vocabulary of "
                    f"{vocab_size}; a .npy source must hold ids of the configured "
                    "--data.tokenizer."
                )
            yield doc, position
        return
    pos, total = start[0], len(tokens)
    if pos > total:
        raise _past_the_end(path, f"token {pos}")
    while pos < total:
        window = np.asarray(tokens[pos : pos + NPY_CHUNK])
        ends = np.flatnonzero(window == eos_id) + 1
        if ends.size == 0:  # a document longer than the window, or the unterminated tail
            end = _next_eos_end(tokens, pos + len(window), eos_id)
            doc = np.asarray(tokens[pos:end], dtype=np.int64)
            if doc[-1] != eos_id:
                doc = np.append(doc, eos_id)
            pos = end
            if len(doc) > 1:
                yield doc, (pos, 0)
            continue
        begin = 0
        for end in ends.tolist():
            if end - begin > 1:  # a lone eos is an empty document
                yield window[begin:end].astype(np.int64), (pos + end, 0)
            begin = end
        pos += int(ends[-1])


def _next_eos_end(tokens: np.ndarray, search: int, eos_id: int) -> int:
    """One past the first eos at or after ``search``, or the array's end."""
    while search < len(tokens):
        hits = np.flatnonzero(np.asarray(tokens[search : search + NPY_CHUNK]) == eos_id)
        if hits.size:
            return search + int(hits[0]) + 1
        search += NPY_CHUNK
    return len(tokens)


def token_arrays(docs: list[Document], tokenizer: Any) -> list[np.ndarray]:
    """Each document's token ids followed by eos: the texts encoded in one parallel batch,
    token documents (which end with eos already) as they are."""
    texts = [d for d in docs if isinstance(d, str)]
    encoded = iter(tokenizer.encode_batch(texts) if texts else ())
    eos = tokenizer.eos_id
    return [
        np.array([*next(encoded), eos], dtype=np.int64) if isinstance(d, str) else d for d in docs
    ]


NPY_MAGIC = b"\x93NUMPY"


def load_token_array(path: Path) -> np.ndarray:
    """A .npy token source memory-mapped; ConfigError unless it is 1-D integer token ids."""
    with path.open("rb") as f:
        header = f.read(len(NPY_MAGIC))
    if header != NPY_MAGIC:
        raise ConfigError(
            f"{path}: not a NumPy .npy file (it does not start with the .npy header); write "
            "token ids with numpy.save."
        )
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path}: not a readable .npy array ({e}).") from None
    if tokens.ndim != 1 or tokens.dtype not in NPY_DTYPES:
        raise ConfigError(
            f"{path}: a token source must be a 1-D array of uint16, int32, uint32 or int64 token "
            f"ids (documents separated by the tokenizer's eos id); it is {tokens.ndim}-D "
            f"{tokens.dtype}."
        )
    return tokens


def check_source_file(path: Path, text_field: str | None) -> None:
    """Fail now, not at step 1, on a file the streaming loader could not read: a parquet or
    arrow file without the text column (only its schema is read), a malformed .npy array."""
    suffix = source_suffix(path)
    if suffix == ".npy":
        load_token_array(path)
    elif suffix in (".parquet", ".arrow"):
        documents = read_documents(path, text_field)
        next(documents, None)  # opens the file and checks the column before the first row
        documents.close()
