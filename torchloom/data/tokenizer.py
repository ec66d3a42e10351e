"""Text <-> token ids: our builtin byte-level BPE, or any Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.cache import atomic_write_text
from torchloom.data.config import BUILTIN_TOKENIZER
from torchloom.data.corpus import ensure_builtin_corpus, python_tag
from torchloom.data.sources import SourceFile, iter_documents

log = logging.getLogger(__name__)

# Bump when the builtin tokenizer's training recipe changes.
TOKENIZER_VERSION = 1
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
# Used when no tokenizer_config.json names the special tokens: common spellings, best first.
KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
KNOWN_BOS = (BOS_TOKEN, "<s>", "<bos>", "<|bos|>")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token ids training needs.

    Special-token strings inside text are encoded as plain text, so a document cannot forge a
    document boundary; ``bos``/``eos`` are only added through ``add_bos``/``add_eos``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token: str,
        bos_token: str | None = None,
        pad_token: str | None = None,
        path: Path | None = None,
    ) -> None:
        self.backend = backend
        self.backend.encode_special_tokens = True
        self.path = path
        self.eos_id: int = self._token_id(eos_token, "eos")
        self.bos_id: int | None = self._token_id(bos_token, "bos") if bos_token else None
        self.pad_id: int | None = self._token_id(pad_token, "pad") if pad_token else None
        # Added tokens may sit above the model vocabulary: size the embedding by the largest id.
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json`` file or a Hugging Face folder containing one.

        bos/eos/pad come from ``tokenizer_config.json`` next to it when present, else from
        well-known token spellings such as ``<|endoftext|>`` or ``</s>``.
        """
        path = Path(path).expanduser()
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            raise ConfigError(
                f"Tokenizer '{path}' not found: expected a tokenizer.json file or a folder "
                f"containing one, or '{BUILTIN_TOKENIZER}'."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(json_path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ConfigError(f"Could not load tokenizer {json_path}: {e}") from None
        special = _read_special_tokens(json_path.parent / "tokenizer_config.json")
        vocab = backend.get_vocab(with_added_tokens=True)
        eos = special.get("eos") or next((t for t in KNOWN_EOS if t in vocab), None)
        if eos is None:
            raise ConfigError(
                f"Tokenizer {json_path} has no recognizable end-of-text token, which separates "
                'documents. Add a tokenizer_config.json beside it with {"eos_token": "..."}.'
            )
        bos = special.get("bos") or next((t for t in KNOWN_BOS if t in vocab), None)
        return cls(backend, eos_token=eos, bos_token=bos, pad_token=special.get("pad"), path=path)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by bos/eos."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ConfigError(f"Tokenizer {self.path} has no bos token to add.")
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added), encoded in parallel."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept visible unless skipped."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` to ``path`` and a ``tokenizer_config.json`` beside it.

        The config names bos/eos/pad, so ``Tokenizer.from_file`` on the folder (or any Hugging
        Face loader) gets the same special tokens back.
        """
        path = Path(path)
        atomic_write_text(path, self.backend.to_str())
        config = {
            f"{role}_token": self.backend.id_to_token(token_id)
            for role, token_id in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id))
            if token_id is not None
        }
        atomic_write_text(path.parent / "tokenizer_config.json", json.dumps(config, indent=1))

    def fingerprint(self) -> str:
        """Hash of everything that decides the ids: the tokenizer json and the eos choice."""
        content = f"{self.backend.to_str()}\neos={self.eos_id}"
        return hashlib.sha256(content.encode("utf-8")).hexdigest()

    def _token_id(self, token: str, role: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            raise ConfigError(
                f"Tokenizer {self.path}: {role} token '{token}' is not in its vocabulary."
                f"{did_you_mean(token, [t for t in vocab if t.startswith(('<', '['))])}"
            )
        return token_id


def load_tokenizer(spec: str, cache_dir: Path, vocab_size: int) -> Tokenizer:
    """The tokenizer named by ``--data.tokenizer``; the builtin one is trained on first use."""
    if spec == BUILTIN_TOKENIZER:
        path = ensure_builtin_tokenizer(cache_dir, vocab_size)
        backend = tokenizers.Tokenizer.from_file(str(path))
        return Tokenizer(backend, EOS_TOKEN, BOS_TOKEN, pad_token=EOS_TOKEN, path=path)
    if spec.startswith("builtin:"):
        raise ConfigError(
            f"Unknown builtin tokenizer '{spec}'.{did_you_mean(spec, [BUILTIN_TOKENIZER])} "
            f"The builtin tokenizer is '{BUILTIN_TOKENIZER}'."
        )
    return Tokenizer.from_file(spec)


def builtin_tokenizer_path(cache_dir: Path, vocab_size: int) -> Path:
    """Where the builtin tokenizer of ``vocab_size`` lives (it may not exist yet)."""
    name = f"stdlib_bpe-v{TOKENIZER_VERSION}-{python_tag()}-V{vocab_size}.json"
    return cache_dir / "builtin" / name


def ensure_builtin_tokenizer(cache_dir: Path, vocab_size: int) -> Path:
    """Path of the builtin BPE tokenizer json, training it on the builtin corpus if needed."""
    path = builtin_tokenizer_path(cache_dir, vocab_size)
    if not path.exists():
        corpus = SourceFile(ensure_builtin_corpus(cache_dir), "text")
        start = time.perf_counter()
        backend = train_byte_level_bpe(list(iter_documents([corpus])), vocab_size)
        atomic_write_text(path, backend.to_str())
        log.info("Trained %s in %.1fs", path, time.perf_counter() - start)
    return path


def train_byte_level_bpe(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """A GPT-2-style byte-level BPE of ``vocab_size`` ids (special tokens included).

    Byte-level means every string encodes without unknown tokens and decodes back exactly.
    Training is deterministic: the same texts give the same json (tests check this).
    """
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def _read_special_tokens(config_path: Path) -> dict[str, str]:
    """``{"bos": ..., "eos": ..., "pad": ...}`` from an HF tokenizer_config.json, if any."""
    if not config_path.is_file():
        return {}
    try:
        config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_path}: not valid JSON ({e}).") from None
    special: dict[str, str] = {}
    for role in ("bos", "eos", "pad"):
        value = config.get(f"{role}_token")
        if isinstance(value, dict):  # serialized AddedToken: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str) and value:
            special[role] = value
    return special
