"""Turn ``--data.sources`` entries into files, and files into documents."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.config import BUILTIN_CORPUS
from torchloom.data.corpus import ensure_builtin_corpus

TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass(frozen=True)
class SourceFile:
    """One file of documents: a .txt file is one document, a .jsonl file one per line."""

    path: Path
    text_field: str | None
    """JSONL field holding the text; None for .txt files."""

    def fingerprint(self) -> list[str | int]:
        """Path, size and mtime: changes whenever the file is edited, without reading it."""
        stat = self.path.stat()
        return [str(self.path.resolve()), self.text_field or "", stat.st_size, stat.st_mtime_ns]


def resolve_sources(sources: list[str], text_field: str, cache_dir: Path) -> list[SourceFile]:
    """The files behind ``sources``, in order; directories expand to their sorted files."""
    files: list[SourceFile] = []
    for source in sources:
        if source.startswith("builtin:"):
            if source != BUILTIN_CORPUS:
                raise ConfigError(
                    f"Unknown builtin data source '{source}'.{did_you_mean(source, [BUILTIN_CORPUS])}"
                    f" The builtin corpus is '{BUILTIN_CORPUS}'."
                )
            files.append(SourceFile(ensure_builtin_corpus(cache_dir), "text"))
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(
                f"Data source '{source}' does not exist (looked for {path.resolve()}). Give an "
                f"existing .txt/.jsonl file or directory, or '{BUILTIN_CORPUS}'."
            )
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
            if not found:
                raise ConfigError(
                    f"Data source directory '{source}' contains no .txt or .jsonl files."
                )
            files.extend(_source_file(p, text_field) for p in found)
        else:
            files.append(_source_file(path, text_field))
    return files


def _source_file(path: Path, text_field: str) -> SourceFile:
    if path.suffix == ".txt":
        return SourceFile(path, None)
    if path.suffix == ".jsonl":
        return SourceFile(path, text_field)
    raise ConfigError(
        f"Data source '{path}' has an unsupported extension '{path.suffix}': use .txt (whole "
        "file is one document) or .jsonl (one JSON object per line)."
    )


def iter_documents(files: list[SourceFile]) -> Iterator[str]:
    """Every non-empty document of ``files``, in order."""
    for file in files:
        if file.text_field is None:
            text = _read_text(file.path)
            if text:
                yield text
        else:
            yield from _iter_jsonl(file.path, file.text_field)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not valid UTF-8 at byte {e.start}. Re-encode the file as UTF-8."
        ) from None


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
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
            if not isinstance(record, dict) or text_field not in record:
                keys = list(record) if isinstance(record, dict) else []
                raise ConfigError(
                    f"{where}: no field '{text_field}' (found {keys or type(record).__name__})."
                    f"{did_you_mean(text_field, keys)} Set --data.text_field to the field "
                    "holding the text."
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ConfigError(
                    f"{where}: field '{text_field}' is a {type(text).__name__}, not a string."
                )
            if text:
                yield text
