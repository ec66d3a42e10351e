"""The builtin English corpus: documentation prose shipped with the Python standard library.

No text corpus is installable offline, but every Python has megabytes of English in its
docstrings and in ``pydoc_data``. We extract them once into a versioned JSONL file in the cache.
"""

from __future__ import annotations

import ast
import json
import logging
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from torchloom.config.errors import ConfigError
from torchloom.data.cache import atomic_write_text

log = logging.getLogger(__name__)

# Bump when the extraction rules change, so old cached corpora are not reused.
EXTRACTOR_VERSION = 1
MIN_DOC_CHARS = 200
# Directories whose docstrings are test scaffolding, tooling or third-party code, not docs.
SKIPPED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "turtledemo",
        "__pycache__",
        "__phello__",
        "ensurepip",
    }
)


def python_tag() -> str:
    """``py3.11``: docstrings change between Python versions, so caches are keyed by it."""
    return f"py{sys.version_info.major}.{sys.version_info.minor}"


def builtin_corpus_path(cache_dir: Path) -> Path:
    """Where the builtin corpus lives in ``cache_dir`` (it may not exist yet)."""
    return cache_dir / "builtin" / f"stdlib_docs-v{EXTRACTOR_VERSION}-{python_tag()}.jsonl"


def ensure_builtin_corpus(cache_dir: Path) -> Path:
    """Path of the builtin corpus JSONL (field ``text``), extracting it on first use."""
    path = builtin_corpus_path(cache_dir)
    if path.exists():
        return path
    start = time.perf_counter()
    docs = extract_stdlib_docs()
    if not docs:
        raise ConfigError(
            "The builtin corpus is empty: this Python ships no pydoc topics or stdlib .py "
            f"sources under {sysconfig.get_paths()['stdlib']}. Use --data.sources with your "
            "own .txt/.jsonl files instead of builtin:stdlib_docs."
        )
    atomic_write_text(path, "".join(json.dumps({"text": d}) + "\n" for d in docs))
    seconds = time.perf_counter() - start
    megabytes = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    log.info("Built %s: %d documents, %.2f MB in %.1fs", path, len(docs), megabytes, seconds)
    return path


def extract_stdlib_docs(stdlib_dir: Path | None = None) -> list[str]:
    """All builtin-corpus documents in a fixed order: pydoc topics, then stdlib docstrings."""
    seen: set[str] = set()
    docs: list[str] = []
    for text in _iter_pydoc_topics():
        if len(text) >= MIN_DOC_CHARS and text not in seen:
            seen.add(text)
            docs.append(text)
    root = stdlib_dir or Path(sysconfig.get_paths()["stdlib"])
    for path in _iter_stdlib_sources(root):
        for text in _iter_docstrings(path):
            if len(text) >= MIN_DOC_CHARS and text not in seen:
                seen.add(text)
                docs.append(text)
    return docs


def _iter_pydoc_topics() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics  # a plain dict of strings: safe to import
    except ImportError:
        return
    for name in sorted(topics):
        yield topics[name].strip()


def _iter_stdlib_sources(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if SKIPPED_DIRS.isdisjoint(parts[:-1]) and not parts[0].startswith("config-"):
            yield path


def _iter_docstrings(path: Path) -> Iterator[str]:
    """Docstrings of the module, classes and functions in ``path``, parsed, never imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences in old sources
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)  # clean=True applies inspect.cleandoc
            if text:
                yield text.strip()
