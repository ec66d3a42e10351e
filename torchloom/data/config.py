"""What data to train on and how to tokenize it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from torchloom.config.errors import ConfigError, did_you_mean, warn

BUILTIN_CORPUS = "builtin:stdlib_docs"
BUILTIN_CHAT = "builtin:chat_tasks"
BUILTIN_WORD_PROBLEMS = "builtin:word_problems"
BUILTIN_WORD_PROBLEMS_CHAT = "builtin:word_problems_chat"
BUILTIN_WORD_PROBLEMS_CHAT_MIXED = "builtin:word_problems_chat_mixed"
BUILTIN_SHAPES_CHAT = "builtin:shapes_chat"
BUILTIN_SHAPES_CHAT_TEST = "builtin:shapes_chat_test"
BUILTIN_TONES_CHAT = "builtin:tones_chat"
BUILTIN_TONES_CHAT_TEST = "builtin:tones_chat_test"
BUILTIN_TOKENIZER = "builtin:stdlib_bpe"
BUILTIN_VL_TOKENIZER = "builtin:stdlib_bpe_vl"
"""The builtin tokenizer plus vision (and reserved video/audio) tokens appended after its ids."""
BUILTIN_TOKENIZERS = (BUILTIN_TOKENIZER, BUILTIN_VL_TOKENIZER)
# 256 byte tokens + the four special tokens; anything smaller cannot encode arbitrary text.
MIN_BUILTIN_VOCAB = 260
# The default builtin data set of each format, and the format of every builtin data set.
BUILTIN_SOURCES = {"text": BUILTIN_CORPUS, "chat": BUILTIN_CHAT, "multimodal": BUILTIN_SHAPES_CHAT}
BUILTIN_FORMATS = {BUILTIN_CORPUS: "text", BUILTIN_WORD_PROBLEMS: "text",
                   BUILTIN_CHAT: "chat", BUILTIN_WORD_PROBLEMS_CHAT: "chat",
                   BUILTIN_WORD_PROBLEMS_CHAT_MIXED: "chat",
                   BUILTIN_SHAPES_CHAT: "multimodal",
                   BUILTIN_SHAPES_CHAT_TEST: "multimodal",
                   BUILTIN_TONES_CHAT: "multimodal",
                   BUILTIN_TONES_CHAT_TEST: "multimodal"}  # fmt: skip


@dataclass
class DataConfig:
    """Training data: where it comes from, how it is tokenized, packed and split."""

    format: Literal["text", "chat", "multimodal"] = "text"
    """text: documents for pre-training, loss on every token. chat: conversations for
    supervised fine-tuning (JSONL lines {"messages": [{"role", "content"}, ...]}) rendered by
    the tokenizer's chat template, loss only on assistant tokens, packed without splitting a
    conversation. multimodal: chats whose content may be a list of parts, text and images
    ({"type": "image", "path": "img/0.png"}, relative to the JSONL file), for vision-language
    models (docs/data.md)."""

    sources: list[str] = field(default_factory=lambda: [BUILTIN_CORPUS])
    """Data to train on. Text: builtin:stdlib_docs (English docs shipped with Python), a .txt
    file (the whole file is one document), a .jsonl file (one document per line, text in
    --data.text_field), a .parquet or .arrow file (one document per row, text in the column
    --data.text_field), a datasets save_to_disk folder, a .npy array of token ids (documents
    ending with eos) or a directory (every .txt/.jsonl/.parquet/.arrow/.npy
    under it, in sorted order); builtin:word_problems (arithmetic and word problems with worked solutions). Chat:
    builtin:chat_tasks (small synthetic tasks), builtin:word_problems_chat (a question, then
    its worked solution), builtin:word_problems_chat_mixed (the same, half of the replies
    giving only the answer), .jsonl files or directories of them. Multimodal:
    builtin:shapes_chat (questions about drawn shapes; builtin:shapes_chat_test is its
    held-out split), builtin:tones_chat (which of two tones is higher or longer, for
    --data.media_layout muse_spark; builtin:tones_chat_test held out), multimodal chat .jsonl
    files or directories of them."""

    text_field: str = "text"
    """Field of each JSONL line, or column of each parquet/arrow row, that holds the text."""

    streaming: bool = False
    """Text: tokenize and pack the training data on a background thread while training runs,
    with no tokenization pass and no token cache (needed for --data.mix; no validation
    split, so set --data.val_fraction 0). Off: tokenize every source
    once into cached token arrays and shuffle windows of them."""

    mix: list[float] = field(default_factory=list)
    """Streaming: one weight per --data.sources entry, each >= 0 and summing to 1, e.g.
    '[0.7, 0.3]': each document comes from source i with probability mix[i] (a seeded draw),
    and sources that run out restart. Empty: the sources are read one after the other."""

    prefetch_steps: int = 4
    """Streaming: optimizer steps of batches the background thread keeps ready."""

    tokenizer: str = BUILTIN_TOKENIZER
    """builtin:stdlib_bpe (a byte-level BPE trained on the builtin corpus, with a ChatML chat
    template), a tokenizer.json file, or a Hugging Face tokenizer folder with tokenizer.json (and
    optionally tokenizer_config.json naming bos/eos/pad tokens and the chat template)."""

    chat_template: str = ""
    """A .jinja file whose chat template replaces the tokenizer's own (empty: the tokenizer's).
    The trained model is saved with it."""

    overlong_conversations: Literal["drop", "truncate"] = "drop"
    """Chat format: a conversation longer than seq_len + 1 tokens is dropped (and counted), or
    truncated to its first seq_len + 1 tokens."""

    vocab_size: int = 4096
    """Vocabulary size of the builtin tokenizer, special tokens included (ignored otherwise;
    builtin:stdlib_bpe_vl appends its 7 media tokens above it)."""

    media_layout: Literal["qwen3_vl", "kimi_k25", "muse_glimmer", "muse_spark"] = "qwen3_vl"
    """Multimodal: how media are written for the model family that reads them (the recipe sets
    it to match its model): qwen3_vl (Qwen-VL patches in merge windows, <|vision_start|> +
    <|image_pad|> x n + <|vision_end|>, M-RoPE positions), kimi_k25 (MoonViT raster patches,
    <|media_begin|>image<|media_content|> + <|media_pad|> x n + <|media_end|>), muse_glimmer
    (Muse raster patches, <|image_start|> + <|patch|> x n + <|image_end|>), muse_spark (Muse's
    images and 24 kHz audio, <|soft_audio_start|> + <|audio|> x n + <|soft_audio_end|>); the
    last three with plain positions. With builtin:stdlib_bpe_vl every layout is spelled with
    its tokens (docs/multimodal.md)."""

    max_images_per_row: int = 4
    """Multimodal: image slots per packed row (N of media pixel_values [B, N, L, P]); a row
    holds at most this many images, and a sample with more is refused."""

    max_image_patches: int = 1024
    """Multimodal: patch slots per image (L). Larger images are resized down to fit (their
    max pixels become at most L x patch^2), as the processor's max_pixels would."""

    image_min_pixels: int = 0
    """Multimodal: smaller images are resized up to this many pixels (0: the processor's
    own, from the tokenizer folder's preprocessor_config.json, else Qwen3-VL's 65536)."""

    image_max_pixels: int = 0
    """Multimodal: larger images are resized down to this many pixels (0: the processor's)."""

    image_decode_limit: int = 100_000_000
    """Multimodal: an image file of more pixels (width x height) is refused before decoding."""

    max_audios_per_row: int = 2
    """Multimodal, layouts with audio (muse_spark): audio clip slots per packed row (A of
    media audio_values [B, A, S, 1]); a sample with more clips is refused."""

    max_audio_seconds: float = 30.0
    """Multimodal, layouts with audio: longer clips are refused; a clip slot holds this many
    seconds of samples, rounded up to whole audio tokens (S)."""

    document_mask: bool = True
    """Packed sequences never attend across documents, and positions restart at each document.
    Off: a packed sequence is one long causal stream."""

    val_fraction: float = 0.02
    """Fraction of documents held out for validation (0 disables validation)."""

    shuffle: bool = True
    """Visit training sequences in a seeded random order, reshuffled every epoch."""

    cache_dir: str = ""
    """Where corpora, tokenizers and token arrays are cached. Empty: $TORCHLOOM_CACHE, or
    else ~/.cache/torchloom."""

    def validate(self) -> None:
        """Raise ConfigError for values that cannot work (files are checked when loading)."""
        if not isinstance(self.format, str) or self.format not in BUILTIN_SOURCES:
            hint = did_you_mean(str(self.format), BUILTIN_SOURCES)
            raise ConfigError(
                f"Unknown --data.format {self.format!r}.{hint} Choose {', '.join(BUILTIN_SOURCES)}."
            )
        if isinstance(self.sources, str):
            raise ConfigError(
                f"--data.sources takes a list of sources; got a string: use "
                f"sources=[{self.sources!r}]."
            )
        if not isinstance(self.sources, list | tuple) or not all(
            isinstance(s, str) for s in self.sources
        ):
            raise ConfigError(
                f"--data.sources must be a list of paths or builtin: names (str); got "
                f"{self.sources!r}."
            )
        if not self.sources:
            raise ConfigError(
                f"--data.sources is empty: give at least one source, e.g. "
                f"'[\"{BUILTIN_SOURCES[self.format]}\"]' or '[\"my.jsonl\"]'."
            )
        repeated = sorted({s for s in self.sources if self.sources.count(s) > 1})
        if repeated:
            how = (
                "their --data.mix weights add up"
                if self.mix
                else "its documents are read once per mention"
            )
            warn(
                f"--data.sources names {', '.join(repeated)} more than once: {how}. Give each "
                "source once (with its weight in --data.mix) unless that is meant."
            )
        builtin = BUILTIN_SOURCES[self.format]
        for source in self.sources:
            if not source.startswith("builtin:"):
                continue
            other = BUILTIN_FORMATS.get(source)
            if other is None:
                raise ConfigError(
                    f"Unknown builtin data source '{source}'."
                    f"{did_you_mean(source, BUILTIN_FORMATS)} The builtin {self.format} "
                    f"sources are {', '.join(builtin_sources(self.format))}."
                )
            if other != self.format:
                raise ConfigError(
                    f"'{source}' holds {other} data but --data.format is {self.format}: use "
                    f"--data.format {other}, or the {self.format} source '{builtin}'."
                )
        if self.format != "text" and not self.document_mask:
            raise ConfigError(
                f"--data.document_mask false does not apply to --data.format {self.format}: "
                "packed conversations never attend to each other. Leave document_mask on."
            )
        if self.tokenizer.startswith("builtin:") and self.tokenizer not in BUILTIN_TOKENIZERS:
            raise ConfigError(
                f"Unknown builtin tokenizer '{self.tokenizer}'; the builtin tokenizers are "
                f"{', '.join(BUILTIN_TOKENIZERS)}.{did_you_mean(self.tokenizer, BUILTIN_TOKENIZERS)}"
            )
        if self.format == "multimodal":
            self._validate_multimodal()
        self._validate_streaming()
        if not self.text_field:
            raise ConfigError("--data.text_field is empty: name the JSONL field holding the text.")
        if not self.tokenizer:
            raise ConfigError(
                f"--data.tokenizer is empty: use '{BUILTIN_TOKENIZER}' or a tokenizer.json path."
            )
        if self.tokenizer in BUILTIN_TOKENIZERS and self.vocab_size <= MIN_BUILTIN_VOCAB:
            raise ConfigError(
                f"--data.vocab_size={self.vocab_size} is too small: the builtin byte-level BPE "
                f"needs more than {MIN_BUILTIN_VOCAB} (256 bytes + 4 special tokens); try 4096."
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(
                f"--data.val_fraction={self.val_fraction} must be in [0, 1): it is the fraction "
                "of documents held out for validation, e.g. 0.02 (0 disables validation)."
            )

    def _validate_streaming(self) -> None:
        if self.streaming and self.format != "text":
            raise ConfigError(
                f"--data.streaming applies to --data.format text, not {self.format}: "
                "conversations are packed whole from cached arrays. Leave streaming off."
            )
        if self.streaming and self.val_fraction > 0:
            raise ConfigError(
                f"--data.streaming has no validation split (--data.val_fraction is "
                f"{self.val_fraction}): add --data.val_fraction 0, or turn streaming off."
            )
        if self.prefetch_steps < 1:
            raise ConfigError(f"--data.prefetch_steps={self.prefetch_steps} must be at least 1.")
        if not self.mix:
            return
        if not self.streaming:
            raise ConfigError(
                "--data.mix needs --data.streaming true (documents are mixed as they stream); "
                "add it, or drop --data.mix to read the sources one after the other."
            )
        if len(self.mix) != len(self.sources):
            raise ConfigError(
                f"--data.mix has {len(self.mix)} weight(s) for {len(self.sources)} source(s): "
                "give one weight per --data.sources entry, in the same order."
            )
        if any(not math.isfinite(w) or w < 0 for w in self.mix):
            raise ConfigError(f"--data.mix {self.mix}: every weight must be a number >= 0.")
        if abs(sum(self.mix) - 1.0) > 1e-6:
            raise ConfigError(
                f"--data.mix {self.mix} sums to {sum(self.mix):.6g}, not 1: give each source's "
                "share of the documents, e.g. '[0.7, 0.3]'."
            )

    def _validate_multimodal(self) -> None:
        if self.tokenizer == BUILTIN_TOKENIZER:
            raise ConfigError(
                f"--data.tokenizer {BUILTIN_TOKENIZER} has no image tokens; multimodal data needs "
                f"--data.tokenizer {BUILTIN_VL_TOKENIZER} (the same ids plus vision tokens) or a "
                "vision-language model's tokenizer folder."
            )
        if self.overlong_conversations == "truncate":
            raise ConfigError(
                "--data.overlong_conversations truncate does not apply to --data.format "
                "multimodal: a cut could split an image's tokens. Use drop, or raise seq_len."
            )
        for name in ("max_images_per_row", "max_image_patches", "image_decode_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--data.{name}={getattr(self, name)} must be at least 1.")
        if self.max_audios_per_row < 0 or self.max_audio_seconds <= 0:
            raise ConfigError(
                f"--data.max_audios_per_row={self.max_audios_per_row} must be >= 0 and "
                f"--data.max_audio_seconds={self.max_audio_seconds} above 0."
            )
        low, high = self.image_min_pixels, self.image_max_pixels
        if low < 0 or high < 0 or (low and high and low > high):
            raise ConfigError(
                f"--data.image_min_pixels={low} and --data.image_max_pixels={high} must be >= 0 "
                "(0: the processor's own) with min <= max."
            )


def builtin_sources(data_format: str) -> list[str]:
    """The builtin data sources of ``data_format`` (text or chat)."""
    return [source for source, f in BUILTIN_FORMATS.items() if f == data_format]
