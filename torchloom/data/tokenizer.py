"""Text <-> token ids: our builtin byte-level BPE, or a Hugging Face tokenizer folder, with the
chat template that turns conversations into text."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from torchloom.config.errors import ConfigError, did_you_mean, warn
from torchloom.data.cache import atomic_write_text
from torchloom.data.chat import (
    CHATML_TEMPLATE,
    DEFAULT_TEMPLATE_NAME,
    Message,
    read_chat_templates,
    render_chat,
)
from torchloom.data.config import BUILTIN_TOKENIZER, BUILTIN_TOKENIZERS, BUILTIN_VL_TOKENIZER
from torchloom.data.corpus import ensure_builtin_corpus, python_tag
from torchloom.data.sources import SourceFile, iter_documents

log = logging.getLogger(__name__)

# Bump when the builtin tokenizer's training recipe changes (v2: reserved the chat tokens).
TOKENIZER_VERSION = 2
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# Ids 0..3 of the builtin tokenizer, reserved from the start so a pre-trained model can later be
# fine-tuned on chats without growing its vocabulary.
BUILTIN_SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, *CHAT_TOKENS)
# The builtin vision-language tokenizer (builtin:stdlib_bpe_vl) is the builtin one with these
# appended after its last id, so every text id stays the same: Qwen-VL's vision markers, and the
# video and audio ones reserved so adding those inputs later changes no id.
VISION_START_TOKEN, VISION_END_TOKEN = "<|vision_start|>", "<|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
MEDIA_SPECIAL_TOKENS = (VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_TOKEN, "<|video_pad|>",
                        "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")  # fmt: skip
# The named special tokens transformers passes to chat templates (as ``bos_token``, ...).
TEMPLATE_TOKEN_ROLES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# Used when no tokenizer_config.json names the special tokens: common spellings, best first.
KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
KNOWN_BOS = (BOS_TOKEN, "<s>", "<bos>", "<|bos|>")
UNKNOWN_WARNING_FRACTION = 0.5
"""More of the first encoded text than this as the unknown token: the tokenizer does not fit."""


SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model")
"""Files of tokenizers that transformers loads without a tokenizer.json (SentencePiece, BPE
vocab + merges, WordPiece): a folder of them can be converted, not read."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token ids training needs and the chat templates.

    Documents and chats are encoded differently on purpose. ``encode`` treats special-token
    strings inside text as plain text, so a document cannot forge a document boundary; bos/eos
    only come from ``add_bos``/``add_eos``. ``encode_chat`` encodes text rendered by a chat
    template, whose control tokens (``<|im_start|>`` ...) must become their special ids, as
    transformers' ``apply_chat_template`` does.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token: str,
        bos_token: str | None = None,
        pad_token: str | None = None,
        path: Path | None = None,
        chat_templates: dict[str, str] | None = None,
        template_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.backend.encode_special_tokens = True
        self.path = path
        self.eos_id: int = self._token_id(eos_token, "eos")
        self.bos_id: int | None = self._token_id(bos_token, "bos") if bos_token else None
        self.pad_id: int | None = self._token_id(pad_token, "pad") if pad_token else None
        # Added tokens may sit above the model vocabulary: size the embedding by the largest id.
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        """Jinja chat templates by name; ``default`` is the one ``apply_chat_template`` uses."""
        self.chat_template_origin = f"from tokenizer {path}" if path else ""
        """Where the default template comes from, for error messages."""
        self.template_tokens: dict[str, str] = template_tokens or {
            f"{role}_token": token
            for role, token in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token))
            if token
        }
        """What templates see as ``bos_token``, ``eos_token``...: the tokens tokenizer_config.json
        names (transformers passes exactly those), else this tokenizer's bos/eos/pad."""
        # A second backend that matches added tokens in text; the flag is per backend object.
        self._chat_backend = tokenizers.Tokenizer.from_str(backend.to_str())
        self._chat_backend.encode_special_tokens = False
        self._fingerprint: str | None = None
        unk = getattr(backend.model, "unk_token", None)
        self._unk_id: int | None = backend.token_to_id(unk) if unk else None
        """The unknown token's id, until the first batch of text has been checked against it."""

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json`` file or a Hugging Face folder containing one.

        From ``tokenizer_config.json`` beside it come bos/eos/pad (else well-known spellings
        such as ``<|endoftext|>`` or ``</s>``), tokens declared in ``added_tokens_decoder`` but
        missing from tokenizer.json, and the chat template (also read from
        ``chat_template.jinja``).
        """
        path = Path(path).expanduser()
        json_path = path / "tokenizer.json" if path.is_dir() else path
        if not json_path.is_file():
            slow = [n for n in SLOW_TOKENIZER_FILES if (path / n).is_file()]
            if slow:  # a folder of files transformers reads without a tokenizer.json
                raise ConfigError(
                    f"Tokenizer folder '{path}' has no tokenizer.json, only {', '.join(slow)} "
                    "(a slow tokenizer's files). Write the fast form beside them with "
                    f"transformers: AutoTokenizer.from_pretrained('{path}')"
                    f".save_pretrained('{path}')."
                )
            raise ConfigError(
                f"Tokenizer '{path}' not found: expected a tokenizer.json file or a folder "
                f"containing one, or '{BUILTIN_TOKENIZER}'."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(json_path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ConfigError(
                f"{json_path} is not a Hugging Face tokenizer.json (the tokenizers library's "
                f"format: {e}); give the tokenizer.json a model was saved with, or its folder."
            ) from None
        config_path = json_path.parent / "tokenizer_config.json"
        config = _read_tokenizer_config(config_path)
        _add_declared_tokens(backend, config, config_path)
        special = {
            role: token for role in TEMPLATE_TOKEN_ROLES if (token := _named_token(config, role))
        }
        vocab = backend.get_vocab(with_added_tokens=True)
        eos = special.get("eos") or next((t for t in KNOWN_EOS if t in vocab), None)
        if eos is None:
            raise ConfigError(
                f"Tokenizer {json_path} has no recognizable end-of-text token, which separates "
                'documents. Add a tokenizer_config.json beside it with {"eos_token": "..."}.'
            )
        bos = special.get("bos") or next((t for t in KNOWN_BOS if t in vocab), None)
        return cls(
            backend,
            eos_token=eos,
            bos_token=bos,
            pad_token=special.get("pad"),
            path=path,
            chat_templates=read_chat_templates(json_path.parent, config),
            template_tokens={f"{r}_token": t for r, t in special.items()} if config else None,
        )

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of document ``text`` (special-token strings stay text), optionally framed
        by bos/eos."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ConfigError(f"Tokenizer {self.path} has no bos token to add.")
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each document (no special tokens added), encoded in parallel."""
        try:
            encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        except Exception as e:  # the Rust side raises a bare Exception, e.g. no [UNK] token
            raise ConfigError(
                f"Tokenizer {self.path} could not encode the data's text ({e}); use a "
                "tokenizer that can encode any text, such as a byte-level BPE."
            ) from None
        ids = [e.ids for e in encodings]
        if self._unk_id is not None and texts:
            self._warn_if_mostly_unknown(ids)
        return ids

    def _warn_if_mostly_unknown(self, ids: list[list[int]]) -> None:
        """Warn once if most of the first batch of text became the unknown token: the
        tokenizer does not fit the text, and the model would learn nothing from it."""
        total = sum(len(doc) for doc in ids)
        unknown = sum(doc.count(self._unk_id) for doc in ids)
        if total and unknown / total > UNKNOWN_WARNING_FRACTION:
            token = self.backend.id_to_token(self._unk_id)
            warn(
                f"{unknown / total:.0%} of the first {total} tokens of the data are the unknown "
                f"token {token}: tokenizer {self.path} does not fit this text. Use a tokenizer "
                "made for it (or a byte-level one, which has no unknown token)."
            )
        self._unk_id = None  # checked once

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept visible unless skipped."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source, or None when the tokenizer has none."""
        return self.chat_templates.get(DEFAULT_TEMPLATE_NAME)

    def set_chat_template(self, source: str, origin: str = "") -> None:
        """Use ``source`` as the default chat template (also what ``save`` writes); ``origin``
        names where it comes from (e.g. its file) in error messages."""
        self.chat_templates[DEFAULT_TEMPLATE_NAME] = source
        self.chat_template_origin = origin

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = False,
        template_name: str | None = None,
    ) -> str:
        """``messages`` as text, rendered like transformers' ``apply_chat_template(...,
        tokenize=False)``; ``add_generation_prompt`` appends the header of an assistant reply."""
        return render_chat(
            self._template_source(template_name),
            messages,
            add_generation_prompt,
            self._template_origin(template_name),
            **self.template_tokens,
        )

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of chat-template output: control-token strings become their ids."""
        return self._chat_backend.encode(text, add_special_tokens=False).ids

    def encode_chat_prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template with the assistant's reply
        opened (``add_generation_prompt``): the prompt a chat model answers."""
        return self.encode_chat(self.apply_chat_template(messages, add_generation_prompt=True))

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of a generation prompt: ``text`` as a document, or with ``chat`` as one user
        message in the chat template, so a chat-tuned model answers in its own format."""
        if chat:
            return self.encode_chat_prompt([{"role": "user", "content": text}])
        return self.encode(text)

    def stop_ids(self, chat: bool = False) -> tuple[int, ...]:
        """The ids that end a generated reply: eos, and after a chat prompt also the special token
        the chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``)."""
        end_of_turn = self._end_of_turn_id() if chat else None
        return tuple(dict.fromkeys(i for i in (self.eos_id, end_of_turn) if i is not None))

    def _end_of_turn_id(self) -> int | None:
        """The first special token after the reply of a rendered exchange: found this way for any
        template rather than by name; None when the template closes a turn without one."""
        reply = "Sure."
        exchange = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": reply}]
        try:
            text = self.apply_chat_template(exchange)
        except ConfigError:  # a template that refuses this exchange: stop at eos alone
            return None
        at = text.rfind(reply)
        if at < 0:
            return None
        added = self.backend.get_added_tokens_decoder()
        special = {token_id for token_id, token in added.items() if token.special}
        return next((i for i in self.encode_chat(text[at + len(reply) :]) if i in special), None)

    def encode_chat_batch(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """``encode_chat`` of each text in parallel, with each token's character span."""
        encodings = self._chat_backend.encode_batch(texts, add_special_tokens=False)
        return [(e.ids, e.offsets) for e in encodings]

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` to ``path`` and a ``tokenizer_config.json`` beside it.

        The config names bos/eos/pad, the added tokens and the chat template, so
        ``Tokenizer.from_file`` on the folder, or transformers' ``AutoTokenizer``, gets the same
        tokenizer back.
        """
        path = Path(path)
        atomic_write_text(path, self.backend.to_str())
        config: dict[str, Any] = {
            # Without a class name, transformers picks one from the model type, and some (e.g.
            # Qwen2Tokenizer) replace the pre-tokenizer, which would change the ids.
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{
                f"{role}_token": self.backend.id_to_token(token_id)
                for role, token_id in (
                    ("bos", self.bos_id),
                    ("eos", self.eos_id),
                    ("pad", self.pad_id),
                )
                if token_id is not None
            },
            "clean_up_tokenization_spaces": False,  # decode must not edit spaces
            "added_tokens_decoder": {
                str(token_id): {
                    "content": token.content,
                    "lstrip": token.lstrip,
                    "normalized": token.normalized,
                    "rstrip": token.rstrip,
                    "single_word": token.single_word,
                    "special": token.special,
                }
                for token_id, token in sorted(self.backend.get_added_tokens_decoder().items())
            },
        }
        if list(self.chat_templates) == [DEFAULT_TEMPLATE_NAME]:
            config["chat_template"] = self.chat_template
        elif self.chat_templates:
            config["chat_template"] = [
                {"name": name, "template": source} for name, source in self.chat_templates.items()
            ]
        atomic_write_text(path.parent / "tokenizer_config.json", json.dumps(config, indent=1))

    def fingerprint(self) -> str:
        """Hash of everything that decides a document's ids: the tokenizer json and eos.
        Computed once (the backend is complete when the Tokenizer is made, as ``vocab_size``
        assumes): the token cache's key and the loader's state both ask for it."""
        if self._fingerprint is None:
            content = f"{self.backend.to_str()}\neos={self.eos_id}"
            self._fingerprint = hashlib.sha256(content.encode("utf-8")).hexdigest()
        return self._fingerprint

    def _template_origin(self, name: str | None) -> str:
        if (name or DEFAULT_TEMPLATE_NAME) == DEFAULT_TEMPLATE_NAME:
            return self.chat_template_origin
        return f"'{name}' from tokenizer {self.path}"

    def _template_source(self, name: str | None) -> str:
        key = name or DEFAULT_TEMPLATE_NAME
        if key in self.chat_templates:
            source = self.chat_templates[key]
            if not source.strip():
                origin = self._template_origin(name)
                raise ConfigError(
                    f"The chat template{f' ({origin})' if origin else ''} is empty, so every "
                    "conversation would render as nothing: give one with --data.chat_template "
                    "FILE.jinja."
                )
            return source
        if not self.chat_templates:
            raise ConfigError(
                f"Tokenizer {self.path} has no chat template (none in tokenizer_config.json, no "
                "chat_template.jinja). Give one with --data.chat_template FILE.jinja."
            )
        raise ConfigError(
            f"Tokenizer {self.path} has no chat template named '{key}'; it has "
            f"{', '.join(self.chat_templates)}.{did_you_mean(key, self.chat_templates)}"
        )

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
    if spec in BUILTIN_TOKENIZERS:
        path = ensure_builtin_tokenizer(cache_dir, vocab_size)
        backend = tokenizers.Tokenizer.from_file(str(path))
        if spec == BUILTIN_VL_TOKENIZER:
            backend.add_special_tokens(list(MEDIA_SPECIAL_TOKENS))  # appended: ids >= vocab_size
        return Tokenizer(
            backend,
            EOS_TOKEN,
            BOS_TOKEN,
            pad_token=EOS_TOKEN,
            path=path,
            chat_templates={DEFAULT_TEMPLATE_NAME: CHATML_TEMPLATE},
        )
    if spec.startswith("builtin:"):
        raise ConfigError(
            f"Unknown builtin tokenizer '{spec}'.{did_you_mean(spec, BUILTIN_TOKENIZERS)} "
            f"The builtin tokenizers are {', '.join(BUILTIN_TOKENIZERS)}."
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
    """A GPT-2-style byte-level BPE of ``vocab_size`` ids, the builtin special tokens first.

    Byte-level means every string encodes without unknown tokens and decodes back exactly.
    Training is deterministic: the same texts give the same json (tests check this).
    """
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BUILTIN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def _read_tokenizer_config(config_path: Path) -> dict[str, Any]:
    """An HF tokenizer_config.json as a dict; empty when there is none."""
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_path}: not valid JSON ({e}).") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{config_path} is not UTF-8 text ({e}); save it as UTF-8.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object, got {type(config).__name__}.")
    return config


def _named_token(config: dict[str, Any], role: str) -> str | None:
    """The ``{role}_token`` the config names, if any (a string or a serialized AddedToken)."""
    value = config.get(f"{role}_token")
    if isinstance(value, dict):  # serialized AddedToken: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _add_declared_tokens(
    backend: tokenizers.Tokenizer, config: dict[str, Any], config_path: Path
) -> None:
    """Add the tokens of ``added_tokens_decoder`` that tokenizer.json lacks, at their ids.

    Folders converted from older formats may declare special tokens only there; transformers
    adds them on load, so we do too and check they land on the declared ids.
    """
    declared = config.get("added_tokens_decoder") or {}
    for id_text, entry in sorted(declared.items(), key=lambda item: int(item[0])):
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or backend.token_to_id(content) is not None:
            continue
        token = tokenizers.AddedToken(
            content,
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", False)),
            special=bool(entry.get("special", False)),
        )
        backend.add_tokens([token])
        if backend.token_to_id(content) != int(id_text):
            raise ConfigError(
                f"{config_path}: added token {content!r} is declared with id {id_text}, but "
                f"tokenizer.json has room for it only at id {backend.token_to_id(content)}. "
                "Add it to tokenizer.json's added_tokens at that id."
            )
