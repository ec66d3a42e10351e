"""build_dataloaders and DataConfig refuse wrong types and values from Python callers up front,
with a ConfigError naming the argument, instead of failing deep in packing or validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data import DataConfig, build_dataloaders
from torchloom.data.tokenizer import Tokenizer


def _config(tmp_path: Path, tokenizer: Tokenizer, **fields: Any) -> DataConfig:
    path = tmp_path / "ok.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(20)))
    fields.setdefault("sources", [str(path)])
    return DataConfig(tokenizer=str(tokenizer.path), cache_dir=str(tmp_path / "cache"), **fields)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("seq_len", [0, 32.5, "32", True])
def test_seq_len_must_be_a_positive_int(
    tmp_path: Path, tiny_tokenizer: Tokenizer, seq_len: Any, streaming: bool
) -> None:
    cfg = _config(tmp_path, tiny_tokenizer, streaming=streaming, val_fraction=0.0)
    with pytest.raises(ConfigError, match=f"seq_len={seq_len!r} must be an integer of at least 1"):
        build_dataloaders(cfg, seq_len=seq_len, global_batch_size=4, micro_batch_size=2)


def test_a_numpy_int_seq_len_is_accepted(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    np = pytest.importorskip("numpy")
    cfg = _config(tmp_path, tiny_tokenizer, val_fraction=0.0)
    _, train, _ = build_dataloaders(
        cfg, seq_len=np.int64(16), global_batch_size=2, micro_batch_size=2
    )
    assert train.next_step()[0].tokens.shape == (2, 16)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sources": "ok.jsonl"}, r"--data.sources takes a list of sources; got a string: "
                                  r"use sources=\['ok.jsonl'\]"),
        ({"sources": [None]}, r"--data.sources must be a list of .*\(str\); got \[None\]"),
        ({"sources": None}, r"--data.sources must be a list of .*\(str\); got None"),
        ({"format": "csv"}, "Unknown --data.format 'csv'. Choose text, chat, multimodal"),
        ({"format": "chats"}, "Unknown --data.format 'chats'. Did you mean 'chat'"),
    ],
)  # fmt: skip
def test_bad_sources_and_format_are_refused(
    tmp_path: Path,
    tiny_tokenizer: Tokenizer,
    capsys: pytest.CaptureFixture[str],
    fields: dict[str, Any],
    message: str,
) -> None:
    cfg = _config(tmp_path, tiny_tokenizer, **fields)
    with pytest.raises(ConfigError, match=message):
        build_dataloaders(cfg, seq_len=16, global_batch_size=2, micro_batch_size=2)
    assert "warning" not in capsys.readouterr().err  # no "names a, o more than once"
