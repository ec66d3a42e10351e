"""Sources: .txt, .jsonl and directories become documents; mistakes name file and fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data.sources import iter_documents, resolve_sources


def documents(sources: list[str], tmp_path: Path, text_field: str = "text") -> list[str]:
    return list(iter_documents(resolve_sources(sources, text_field, tmp_path / "cache")))


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_txt_is_one_document(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("line one\nline two\n", encoding="utf-8")
    assert documents([str(tmp_path / "a.txt")], tmp_path) == ["line one\nline two\n"]


def test_jsonl_one_document_per_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "first"}, {"body": ""}, {"body": "ü 2"}])
    with path.open("a") as f:
        f.write("\n")  # blank lines are skipped, as are empty documents
    assert documents([str(path)], tmp_path, text_field="body") == ["first", "ü 2"]


def test_directory_takes_sorted_txt_and_jsonl(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    write_jsonl(root / "b" / "z.jsonl", [{"text": "b/z 1"}, {"text": "b/z 2"}])
    (root / "a.txt").write_text("a", encoding="utf-8")
    (root / "c.md").write_text("ignored", encoding="utf-8")
    assert documents([str(root)], tmp_path) == ["a", "b/z 1", "b/z 2"]


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2: not a valid JSON line")):
        documents([str(path)], tmp_path)


def test_missing_text_field_suggests_the_close_one(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"txt": "hello"}])
    with pytest.raises(ConfigError, match=r"d.jsonl:1: no field 'text'.*Did you mean 'txt'"):
        documents([str(path)], tmp_path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'nope.jsonl' does not exist"):
        documents(["nope.jsonl"], tmp_path)


def test_unsupported_extension_and_unknown_builtin(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(ConfigError, match="unsupported extension '.csv'"):
        documents([str(tmp_path / "data.csv")], tmp_path)
    with pytest.raises(ConfigError, match="Did you mean 'builtin:stdlib_docs'"):
        documents(["builtin:stdlib_doc"], tmp_path)
