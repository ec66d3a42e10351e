"""build_dataloaders end to end, on the builtin corpus and on a user's JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data import DataConfig, build_dataloaders, build_tokenizer
from torchloom.data.chat import CHATML_TEMPLATE
from torchloom.data.tokenizer import Tokenizer


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


def test_a_chat_template_file_that_is_not_utf8_is_refused(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00\x01garbage")
    cfg = DataConfig(format="chat", sources=["builtin:chat_tasks"], tokenizer=str(tiny_tokenizer.path),
                     chat_template=str(tmp_path / "binary.jinja"), cache_dir=str(tmp_path / "c"))  # fmt: skip
    with pytest.raises(ConfigError, match="binary.jinja is not UTF-8 text.*save the chat template"):
        build_tokenizer(cfg)


def chat_config(tmp_path: Path, tokenizer: str, template: str = "") -> DataConfig:
    """Chat data of 30 short exchanges in tmp_path, with ``template`` as --data.chat_template."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                 {"role": "assistant", "content": f"{i}"}]}) + "\n"
        for i in range(30)
    ))  # fmt: skip
    if template:
        (tmp_path / "t.jinja").write_text(template)
    return DataConfig(format="chat", sources=[str(chats)], tokenizer=tokenizer, val_fraction=0.0,
                      chat_template=str(tmp_path / "t.jinja") if template else "",
                      cache_dir=str(tmp_path / "cache"))  # fmt: skip


def refusal(cfg: DataConfig, seq_len: int) -> str:
    """The one error building ``cfg``'s loaders raises (printed, for the reader of a run)."""
    with pytest.raises(ConfigError) as caught:
        build_dataloaders(cfg, seq_len=seq_len, global_batch_size=2, micro_batch_size=2)
    print(caught.value)
    return str(caught.value)


@pytest.mark.parametrize(
    "template",
    [
        '{"chat_template": "x"}',  # a JSON file given as the template: constant text
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}",
    ],
)
def test_a_template_without_the_replies_is_refused_before_tokenizing(
    tmp_path: Path, tiny_tokenizer: Tokenizer, template: str
) -> None:
    error = refusal(chat_config(tmp_path, str(tiny_tokenizer.path), template), seq_len=64)
    assert error.startswith(f"{tmp_path / 'chats.jsonl'}:1: the chat template (from ")
    assert f"--data.chat_template {tmp_path / 't.jinja'}) renders this conversation as " in error
    assert "without its assistant messages" in error
    assert not (tmp_path / "cache" / "tokens").exists()  # refused before the set was tokenized
    # A tokenizer folder whose own template is empty: refused at once too, naming the folder.
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(str(tiny_tokenizer.path)).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": ""}))
    error = refusal(chat_config(tmp_path, str(folder)), seq_len=64)
    assert f"chat template (from tokenizer {folder}) is" in error
    assert not (tmp_path / "cache" / "tokens").exists()


def test_chat_data_that_fits_no_sequence_says_why(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    error = refusal(chat_config(tmp_path, str(tiny_tokenizer.path), CHATML_TEMPLATE), seq_len=8)
    assert error.startswith("All 30 training conversations were left out")
    assert "30 longer than seq_len + 1 = 9 tokens" in error and "raise --training.seq_len" in error
