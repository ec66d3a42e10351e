"""Shared fixtures: a tiny tokenizer for fast tests, and the real builtin one built once."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchloom.data.chat import CHATML_TEMPLATE, DEFAULT_TEMPLATE_NAME
from torchloom.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MEDIA_SPECIAL_TOKENS,
    Tokenizer,
    ensure_builtin_tokenizer,
    load_tokenizer,
    train_byte_level_bpe,
)

TINY_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Packing puts many short documents into one sequence.",
    "Every document ends with an end-of-text token.",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A 300-id byte-level BPE trained in milliseconds, saved like a user's tokenizer.json."""
    path = tmp_path_factory.mktemp("tiny_tokenizer") / "tokenizer.json"
    path.write_text(train_byte_level_bpe(TINY_TEXTS, vocab_size=300).to_str())
    return Tokenizer.from_file(path)


@pytest.fixture(scope="session")
def vl_tokenizer() -> Tokenizer:
    """The tiny BPE with the media tokens appended, and ChatML."""
    backend = train_byte_level_bpe(TINY_TEXTS, vocab_size=300)
    backend.add_special_tokens(list(MEDIA_SPECIAL_TOKENS))
    return Tokenizer(backend, EOS_TOKEN, BOS_TOKEN, pad_token=EOS_TOKEN,
                     chat_templates={DEFAULT_TEMPLATE_NAME: CHATML_TEMPLATE})  # fmt: skip


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir holding the real builtin corpus and 4096-id tokenizer (a few seconds)."""
    cache_dir = tmp_path_factory.mktemp("torchloom_cache")
    ensure_builtin_tokenizer(cache_dir, 4096)
    return cache_dir


@pytest.fixture(scope="session")
def builtin_tokenizer(builtin_cache: Path) -> Tokenizer:
    return load_tokenizer("builtin:stdlib_bpe", builtin_cache, 4096)
