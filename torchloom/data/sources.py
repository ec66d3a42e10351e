"""Turn ``--data.sources`` entries into files, and files into documents (or JSON records)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.chat_tasks import ensure_builtin_chat
from torchloom.data.config import (
    BUILTIN_CHAT,
    BUILTIN_CORPUS,
    BUILTIN_SHAPES_CHAT,
    BUILTIN_SHAPES_CHAT_TEST,
    BUILTIN_TONES_CHAT,
    BUILTIN_TONES_CHAT_TEST,
    BUILTIN_WORD_PROBLEMS,
    BUILTIN_WORD_PROBLEMS_CHAT,
    BUILTIN_WORD_PROBLEMS_CHAT_MIXED,
)
from torchloom.data.corpus import ensure_builtin_corpus
from torchloom.data.readers import Document, read_documents, source_suffix
from torchloom.data.shapes_chat import ensure_shapes_chat, ensure_shapes_chat_test
from torchloom.data.tones_chat import ensure_tones_chat, ensure_tones_chat_test
from torchloom.data.word_problems import (
    ensure_word_problem_chat,
    ensure_word_problem_chat_mixed,
    ensure_word_problem_corpus,
)

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow", ".npy")
"""What a text source directory expands to (.npy: token ids, documents ending with eos)."""
HF_DATASET_STATE = "state.json"
"""The file ``datasets.Dataset.save_to_disk`` writes beside its arrow shards, listing them."""
HF_DATASET_DICT = "dataset_dict.json"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
MESSAGES_FIELD = "messages"
"""The JSONL field of a chat source that holds a conversation's messages."""
# Each builtin source: the function that returns its file in the cache, generating it if needed.
BUILTIN_TEXT = {BUILTIN_CORPUS: ensure_builtin_corpus,
                BUILTIN_WORD_PROBLEMS: ensure_word_problem_corpus}  # fmt: skip
BUILTIN_CHATS = {BUILTIN_CHAT: ensure_builtin_chat,
                 BUILTIN_WORD_PROBLEMS_CHAT: ensure_word_problem_chat,
                 BUILTIN_WORD_PROBLEMS_CHAT_MIXED: ensure_word_problem_chat_mixed}  # fmt: skip
BUILTIN_MULTIMODAL = {BUILTIN_SHAPES_CHAT: ensure_shapes_chat,
                      BUILTIN_SHAPES_CHAT_TEST: ensure_shapes_chat_test,
                      BUILTIN_TONES_CHAT: ensure_tones_chat,
                      BUILTIN_TONES_CHAT_TEST: ensure_tones_chat_test}  # fmt: skip


@dataclass(frozen=True)
class SourceFile:
    """One file of documents: a .txt file is one document, a .jsonl file one per line, a
    .parquet or .arrow file one per row, a .npy token array one per eos-terminated run."""

    path: Path
    text_field: str | None
    """JSONL field or column holding the text; None for .txt and .npy files."""

    def fingerprint(self) -> list[str | int]:
        """Path, size and mtime: changes whenever the file is edited, without reading it."""
        stat = self.path.stat()
        return [str(self.path.resolve()), self.text_field or "", stat.st_size, stat.st_mtime_ns]


def resolve_sources(sources: list[str], text_field: str, cache_dir: Path) -> list[SourceFile]:
    """The text files behind ``sources``, in order; directories expand to their sorted files."""
    files: list[SourceFile] = []
    for source in sources:
        if source.startswith("builtin:"):
            _check_builtin(source, BUILTIN_TEXT)
            files.append(SourceFile(BUILTIN_TEXT[source](cache_dir), "text"))
        else:
            files.extend(_source_file(p, text_field) for p in _expand(source, TEXT_SUFFIXES))
    return files


def resolve_chat_sources(
    sources: list[str], cache_dir: Path, multimodal: bool = False
) -> list[SourceFile]:
    """The chat JSONL files behind ``sources``, in order; directories expand to their .jsonl.
    With ``multimodal``, the builtin sources are the multimodal ones."""
    builtins = BUILTIN_MULTIMODAL if multimodal else BUILTIN_CHATS
    files: list[SourceFile] = []
    for source in sources:
        if source.startswith("builtin:"):
            _check_builtin(source, builtins)
            files.append(SourceFile(builtins[source](cache_dir), MESSAGES_FIELD))
            continue
        for path in _expand(source, (".jsonl",)):
            if source_suffix(path) != ".jsonl":
                raise ConfigError(
                    f"Chat source '{path}' is not a .jsonl file: chats are JSONL lines like "
                    '{"messages": [{"role": "user", "content": "..."}, ...]}.'
                )
            files.append(SourceFile(path, MESSAGES_FIELD))
    return files


def _check_builtin(source: str, builtins: dict[str, object]) -> None:
    if source not in builtins:
        raise ConfigError(
            f"Unknown builtin data source '{source}'.{did_you_mean(source, builtins)}"
            f" The builtin sources of this data format are {', '.join(builtins)}."
        )


def _expand(source: str, suffixes: tuple[str, ...]) -> list[Path]:
    """``source`` itself, or the sorted files with one of ``suffixes`` under the directory
    (hidden ones, whose name or a folder's on the way starts with '.', left out)."""
    if not source.strip():
        raise ConfigError(
            "A --data.sources entry is an empty string; give a file, a directory or a builtin "
            "source."
        )
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(
            f"Data source '{source}' does not exist (looked for {path.resolve()}). Give an "
            f"existing {'/'.join(suffixes)} file or directory, or a builtin source."
        )
    if not path.is_dir():
        return [path]
    if ".arrow" in suffixes and (path / HF_DATASET_DICT).is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ConfigError(
            f"Data source '{source}' is a datasets DatasetDict folder (splits: "
            f"{', '.join(splits)}): point --data.sources at one split, e.g. '{path / 'train'}'."
        )
    if ".arrow" in suffixes and (path / HF_DATASET_STATE).is_file():
        return _dataset_shards(path)
    found = sorted(
        p
        for p in path.rglob("*")
        if source_suffix(p) in suffixes
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not found:
        raise ConfigError(
            f"Data source directory '{source}' contains no {' or '.join(suffixes)} files."
        )
    return found


def _dataset_shards(path: Path) -> list[Path]:
    """The arrow shards of a ``Dataset.save_to_disk`` folder, in the order its state lists."""
    state_path = path / HF_DATASET_STATE
    try:
        names = [f["filename"] for f in json.loads(state_path.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{state_path}: not a datasets save_to_disk state file ({e!r}); remove it to read "
            "the folder's .arrow/.parquet files in sorted order."
        ) from None
    shards = [path / name for name in names]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ConfigError(
            f"{state_path} lists {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
            " missing from the folder; save the dataset again (Dataset.save_to_disk), or remove "
            "state.json to read the .arrow files that are there in sorted order."
        )
    return shards


def _source_file(path: Path, text_field: str) -> SourceFile:
    suffix = source_suffix(path)
    if suffix in (".txt", ".npy"):
        return SourceFile(path, None)
    if suffix in (".jsonl", ".parquet", ".arrow"):
        return SourceFile(path, text_field)
    raise ConfigError(
        f"Data source '{path}' has an unsupported extension '{path.suffix}': use .txt (whole "
        "file is one document), .jsonl (one JSON object per line), .parquet or .arrow (one row "
        "per document), .npy (token ids, documents ending with eos) or a directory of them."
    )


def check_entries_have_documents(sources: list[tuple[str, int]], docs_per_file: list[int]) -> None:
    """ConfigError naming the first source entry (entry, its number of files) whose files
    hold no document, given each file's document count."""
    first = 0
    for name, count in sources:
        if sum(docs_per_file[first : first + count]) == 0:
            raise ConfigError(f"The data source '{name}' contains no documents.")
        first += count


def iter_documents(
    files: list[SourceFile], eos_id: int | None = None, vocab_size: int | None = None
) -> Iterator[Document]:
    """Every non-empty document of ``files``, in order: text, or for .npy token sources (which
    need the tokenizer's ``eos_id`` and ``vocab_size``) token ids ending with eos."""
    for file in files:
        for doc, _ in read_documents(file.path, file.text_field, (0, 0), eos_id, vocab_size):
            yield doc


def iter_jsonl_records(path: Path, example: str) -> Iterator[tuple[str, object]]:
    """``("file:line", parsed JSON)`` for each non-blank line; ``example`` shows a good line in
    the error for a bad one."""
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_number}"
            if line_number == 1 and raw.startswith(UTF16_BOMS):
                raise ConfigError(f"{path} is UTF-16 text; save it as UTF-8 (JSON Lines is UTF-8).")
            try:
                record = json.loads(raw.decode("utf-8-sig"))  # a BOM may open the file
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start} of "
                    "the line); save the file as UTF-8."
                ) from None
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{where}: not a valid JSON line ({e}). Each line of a .jsonl source must "
                    f"be one JSON object such as {example}."
                ) from None
            yield where, record
