"""DataConfig.validate: impossible values fail with an actionable message."""

from __future__ import annotations

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data.config import DataConfig


def test_defaults_are_valid() -> None:
    DataConfig().validate()
    DataConfig(format="chat", sources=["builtin:chat_tasks"]).validate()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sources": []}, "--data.sources is empty"),
        ({"sources": ["builtin:stdlib"]}, "Did you mean 'builtin:stdlib_docs'"),
        ({"tokenizer": "builtin:gpt2"}, "Unknown builtin tokenizer 'builtin:gpt2'"),
        ({"vocab_size": 200}, "--data.vocab_size=200 is too small"),
        ({"val_fraction": 1.0}, r"--data.val_fraction=1.0 must be in \[0, 1\)"),
        ({"text_field": ""}, "--data.text_field is empty"),
        ({"format": "chat"}, "'builtin:stdlib_docs' holds text data but --data.format is chat"),
        (
            {"format": "chat", "sources": ["builtin:chat_tasks"], "document_mask": False},
            "--data.document_mask false does not apply to --data.format chat",
        ),
        ({"sources": ["builtin:chat_tasks"]}, "use --data.format chat"),
    ],
)
def test_invalid_values(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(**overrides).validate()


def test_vocab_size_only_matters_for_the_builtin_tokenizer() -> None:
    DataConfig(tokenizer="my/tokenizer.json", vocab_size=0).validate()
