"""build_dataloaders end to end, on the builtin corpus and on a user's JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data import DataConfig, build_dataloaders, build_tokenizer


def test_builtin_corpus_end_to_end(builtin_cache: Path) -> None:
    cfg = DataConfig(cache_dir=str(builtin_cache))
    tokenizer, train, val = build_dataloaders(
        cfg, seq_len=64, global_batch_size=8, micro_batch_size=2, dp_rank=1, dp_size=2, seed=3
    )
    assert tokenizer.vocab_size == build_tokenizer(cfg).vocab_size == 4096
    batches = train.next_step()
    assert len(batches) == 2 and batches[0].tokens.shape == (2, 64)
    assert int(batches[0].tokens.max()) < tokenizer.vocab_size
    assert val is not None and val.num_batches >= 1
    assert train.num_rows > 5000, train.num_rows


def test_user_jsonl_with_own_tokenizer(tmp_path: Path, tiny_tokenizer) -> None:
    path = tmp_path / "my.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(30)))
    cfg = DataConfig(
        sources=[str(path)],
        tokenizer=str(tiny_tokenizer.path),
        val_fraction=0.0,
        shuffle=False,
        document_mask=False,
        cache_dir=str(tmp_path / "cache"),
    )
    tokenizer, train, val = build_dataloaders(
        cfg, seq_len=16, global_batch_size=4, micro_batch_size=4
    )
    assert val is None
    (batch,) = train.next_step()
    assert batch.doc_ids is None
    assert tokenizer.decode(batch.tokens[0].tolist()).startswith("doc 0 doc 0")


def test_an_empty_chat_template_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jinja").write_text("\n")
    cfg = DataConfig(format="chat", sources=["builtin:chat_tasks"],
                     chat_template=str(tmp_path / "empty.jinja"), cache_dir=str(tmp_path / "c"))  # fmt: skip
    with pytest.raises(ConfigError, match="empty.jinja' is empty, so every conversation"):
        build_tokenizer(cfg)
