"""Builtin corpus: extraction rules on a fake stdlib, and the real one built once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torchloom.data.corpus import (
    MIN_DOC_CHARS,
    builtin_corpus_path,
    ensure_builtin_corpus,
    extract_stdlib_docs,
)

LONG = "Explains what this does. " * 10  # 250 characters, above MIN_DOC_CHARS


def write_module(path: Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def test_extracts_docstrings_without_importing(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    write_module(
        tmp_path / "b_mod.py",
        f'"""Module b. {LONG}"""\n'
        f"open({str(marker)!r}, 'w')  # a side effect that must never run\n"
        f'class C:\n    """Class C.\n\n        {LONG}\n    """\n'
        f'    def f(self):\n        """Method f. {LONG}"""\n'
        f'async def g():\n    """Short."""\n',
    )
    write_module(tmp_path / "a_pkg" / "__init__.py", f'"""Package a. {LONG}"""')
    docs = extract_stdlib_docs(tmp_path)
    assert not marker.exists(), "extraction imported a module"
    ours = [d for d in docs if d.split(".")[0] in {"Package a", "Module b", "Class C", "Method f"}]
    # Sorted paths (a_pkg before b_mod), docstrings cleaned of their indentation, short ones dropped.
    assert [d.split(".")[0] for d in ours] == ["Package a", "Module b", "Class C", "Method f"]
    assert ours[2] == f"Class C.\n\n{LONG.strip()}"
    assert all(len(d) >= MIN_DOC_CHARS for d in docs)


def test_skips_tests_tooling_and_duplicates(tmp_path: Path) -> None:
    for skipped in (
        "test/x.py",
        "idlelib/x.py",
        "lib2to3/x.py",
        "site-packages/x.py",
        "tests/x.py",
    ):
        write_module(tmp_path / skipped, f'"""Skipped {skipped}. {LONG}"""')
    write_module(tmp_path / "one.py", f'"""Kept twice. {LONG}"""')
    write_module(tmp_path / "two.py", f'"""Kept twice. {LONG}"""')
    write_module(tmp_path / "three.py", f'"""Unparsable. {LONG}"""\ndef broken(:\n')
    docs = extract_stdlib_docs(tmp_path)
    assert not [d for d in docs if d.startswith(("Skipped", "Unparsable"))]
    assert [d for d in docs if d.startswith("Kept")] == [f"Kept twice. {LONG.strip()}"]


def test_real_corpus_is_cached_versioned_and_sizable(builtin_cache: Path) -> None:
    path = builtin_corpus_path(builtin_cache)
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    assert path.name == f"stdlib_docs-v1-{version}.jsonl"
    assert not list(path.parent.glob(".*.tmp")), "a temporary file was left behind"
    lines = path.read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line)["text"] for line in lines]
    megabytes = sum(len(d.encode()) for d in docs) / 1e6
    assert len(docs) > 1000 and megabytes > 1.0, f"{len(docs)} docs, {megabytes:.2f} MB"
    assert len(set(docs)) == len(docs), "duplicates in the corpus"
    before = path.stat().st_mtime_ns
    assert ensure_builtin_corpus(builtin_cache) == path
    assert path.stat().st_mtime_ns == before, "the cached corpus was rebuilt"
