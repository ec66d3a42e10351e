"""Tokenizer: round trip, deterministic builtin training, HF folder loading, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data.corpus import builtin_corpus_path, python_tag
from torchloom.data.sources import SourceFile, iter_documents
from torchloom.data.tokenizer import (
    BOS_TOKEN,
    BUILTIN_SPECIAL_TOKENS,
    EOS_TOKEN,
    Tokenizer,
    builtin_tokenizer_path,
    load_tokenizer,
    train_byte_level_bpe,
)

TRICKY_TEXT = "Hello  wörld\n\tdef f(x):\r\n    return x ** 2  # 🤗 \x00 <|endoftext|> trailing "


def test_builtin_round_trip_and_special_ids(builtin_tokenizer: Tokenizer) -> None:
    tok = builtin_tokenizer
    assert tok.vocab_size == 4096
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (0, 1, 0)
    assert [tok.backend.token_to_id(t) for t in BUILTIN_SPECIAL_TOKENS] == [0, 1, 2, 3]
    ids = tok.encode(TRICKY_TEXT)
    assert tok.decode(ids) == TRICKY_TEXT
    # The eos string inside text is plain text: documents cannot forge a boundary.
    assert tok.eos_id not in ids
    framed = tok.encode("hi", add_bos=True, add_eos=True)
    assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id, framed
    assert tok.encode_batch(["hi", TRICKY_TEXT]) == [tok.encode("hi"), ids]


def test_builtin_compresses_english(builtin_tokenizer: Tokenizer) -> None:
    text = "Return a new list containing all items from the iterable in ascending order."
    chars_per_token = len(text) / len(builtin_tokenizer.encode(text))
    assert chars_per_token > 3.0, f"only {chars_per_token:.2f} characters per token"


def test_builtin_training_is_deterministic(builtin_cache: Path) -> None:
    corpus = SourceFile(builtin_corpus_path(builtin_cache), "text")
    texts = list(iter_documents([corpus]))
    cached = builtin_tokenizer_path(builtin_cache, 4096).read_text()
    retrained = train_byte_level_bpe(texts, 4096).to_str()
    assert retrained == cached, "retraining on the same corpus gave a different tokenizer"


def test_builtin_cache_reused(builtin_cache: Path) -> None:
    path = builtin_tokenizer_path(builtin_cache, 4096)
    assert path.name == f"stdlib_bpe-v2-{python_tag()}-V4096.json"
    before = path.stat().st_mtime_ns
    load_tokenizer("builtin:stdlib_bpe", builtin_cache, 4096)
    assert path.stat().st_mtime_ns == before


def test_hf_folder_with_tokenizer_config(builtin_cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hf_tokenizer"
    folder.mkdir()
    shutil.copy(builtin_tokenizer_path(builtin_cache, 4096), folder / "tokenizer.json")
    config = {
        "bos_token": {"content": BOS_TOKEN, "special": True},  # AddedToken form
        "eos_token": BOS_TOKEN,  # deliberately unusual, to prove the config wins
        "pad_token": EOS_TOKEN,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_file(folder)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 1, 0)
    assert tok.decode(tok.encode(TRICKY_TEXT)) == TRICKY_TEXT
    # A tokenizer.json path also picks up the config beside it.
    assert Tokenizer.from_file(folder / "tokenizer.json").eos_id == 1


def test_save_then_load_keeps_special_tokens(builtin_tokenizer: Tokenizer, tmp_path: Path) -> None:
    builtin_tokenizer.save(tmp_path / "tokenizer.json")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    named = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    assert named == {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    assert config["chat_template"] == builtin_tokenizer.chat_template
    declared = {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()}
    assert declared == dict(enumerate(BUILTIN_SPECIAL_TOKENS))
    loaded = Tokenizer.from_file(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 0, 0)
    assert loaded.encode(TRICKY_TEXT) == builtin_tokenizer.encode(TRICKY_TEXT)
    assert loaded.chat_template == builtin_tokenizer.chat_template


def test_tokenizer_json_without_config_uses_known_names(tiny_tokenizer: Tokenizer) -> None:
    assert (tiny_tokenizer.eos_id, tiny_tokenizer.bos_id, tiny_tokenizer.pad_id) == (0, 1, None)


def test_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found: expected a tokenizer.json"):
        Tokenizer.from_file(tmp_path / "nope")
    with pytest.raises(ConfigError, match="Did you mean 'builtin:stdlib_bpe'"):
        load_tokenizer("builtin:stdlib_bp", tmp_path, 4096)
    slow = tmp_path / "slow"  # a SentencePiece model's folder, as older checkpoints ship it
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(b"")
    (slow / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ConfigError, match=r"no tokenizer.json, only tokenizer.model .*"
                       r"AutoTokenizer.from_pretrained\('.*slow'\).save_pretrained"):  # fmt: skip
        Tokenizer.from_file(slow)


def test_tokenizer_without_eos_is_a_config_error(tmp_path: Path) -> None:
    backend = train_byte_level_bpe(["some text"] * 5, vocab_size=270)
    raw = json.loads(backend.to_str())
    raw["added_tokens"] = []  # drop the special tokens' names
    raw["model"]["vocab"] = {
        ("<x>" if t == EOS_TOKEN else "<y>" if t == BOS_TOKEN else t): i
        for t, i in raw["model"]["vocab"].items()
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no recognizable end-of-text token"):
        Tokenizer.from_file(path)


def test_tokenizer_config_naming_unknown_token(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    assert tiny_tokenizer.path is not None
    shutil.copy(tiny_tokenizer.path, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ConfigError, match="eos token '</s>' is not in its vocabulary"):
        Tokenizer.from_file(tmp_path)


def test_a_file_that_is_no_tokenizer_and_one_that_cannot_encode(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(ConfigError, match="other.json is not a Hugging Face tokenizer.json"):
        Tokenizer.from_file(tmp_path / "other.json")
    import tokenizers

    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({"</s>": 0, "zzz": 1}))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    word_level.add_special_tokens(["</s>"])
    word_level.save(str(tmp_path / "no_unk.json"))  # no [UNK]: unknown words cannot encode
    tokenizer = Tokenizer.from_file(tmp_path / "no_unk.json")
    with pytest.raises(ConfigError, match="no_unk.json could not encode the data's text .*UNK"):
        tokenizer.encode_batch(["hello world"])


def test_a_tokenizer_that_makes_most_text_unknown_warns_once(tmp_path: Path, capsys) -> None:
    import tokenizers

    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"</s>": 0, "[UNK]": 1, "fox": 2}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["</s>"])
    backend.save(str(tmp_path / "unk.json"))
    tokenizer = Tokenizer.from_file(tmp_path / "unk.json")
    assert tokenizer.encode_batch(["the quick brown fox"]) == [[1, 1, 1, 2]]
    tokenizer.encode_batch(["jumps over"])
    err = capsys.readouterr().err
    assert err.count("75% of the first 4 tokens of the data are the unknown token [UNK]") == 1
    fitting = Tokenizer.from_file(tmp_path / "unk.json")
    fitting.encode_batch(["fox fox fox"])
    assert "unknown token" not in capsys.readouterr().err
