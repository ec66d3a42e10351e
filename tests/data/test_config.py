"""DataConfig.validate: impossible values fail with an actionable message."""

from __future__ import annotations

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data.config import DataConfig

STREAM = {"streaming": True, "val_fraction": 0.0}
TWO = {"sources": ["a.parquet", "b.arrow"]}


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
        ({"streaming": True}, "no validation split .* add --data.val_fraction 0"),
        (
            {"streaming": True, "format": "chat", "sources": ["builtin:chat_tasks"]},
            "--data.streaming applies to --data.format text, not chat",
        ),
        ({"mix": [1.0], "val_fraction": 0.0}, "--data.mix needs --data.streaming true"),
        (STREAM | {"mix": [0.5, 0.5]}, "--data.mix has 2 weight.* for 1 source"),
        (STREAM | TWO | {"mix": [1.2, -0.2]}, "every weight must be a number >= 0"),
        (STREAM | TWO | {"mix": [0.5, 0.4]}, r"sums to 0.9, not 1"),
        (STREAM | {"prefetch_steps": 0}, "--data.prefetch_steps=0 must be at least 1"),
    ],
)
def test_invalid_values(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(**overrides).validate()


def test_vocab_size_only_matters_for_the_builtin_tokenizer() -> None:
    DataConfig(tokenizer="my/tokenizer.json", vocab_size=0).validate()


def test_a_streamed_mix_is_valid() -> None:
    DataConfig(**STREAM, **TWO, mix=[0.7, 0.3]).validate()
    DataConfig(**STREAM, **TWO, mix=[1.0, 0.0]).validate()
