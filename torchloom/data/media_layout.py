"""How each vision-language family writes media into the token stream and the media tensors:
which image processor cuts the patches, the placeholder text around an image's (and an audio
clip's) tokens, and the kind of positions the model reads. ``--data.media_layout`` picks one;
the recipe sets it to match its model (``qwen3_vl`` for Qwen3-VL, ...).

Every layout gives an image t*h*w / merge^2 placeholder tokens (merge 2 for all of them), the
number its model's encoder emits after merging patches. An audio clip of n samples gives
ceil(n / audio_samples_per_token) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.data.tokenizer import (
    IMAGE_TOKEN,
    MEDIA_SPECIAL_TOKENS,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
)

# builtin:stdlib_bpe_vl's reserved audio tokens (data/tokenizer.py MEDIA_SPECIAL_TOKENS).
BUILTIN_AUDIO_START, BUILTIN_AUDIO_END, BUILTIN_AUDIO_TOKEN = (
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
)  # fmt: skip


@dataclass(frozen=True)
class MediaLayout:
    """One family's media conventions, as its Hugging Face processor and chat template write them."""

    name: str
    image_processor: Literal["qwen2vl", "kimi", "muse"]
    """Which image processor cuts images into patches (data/images.py)."""
    image_start_token: str
    """The token right before an image's placeholders (or before ``image_prefix``)."""
    image_token: str
    """The placeholder, one per merged image token; the model puts the image's embeddings there."""
    image_end_token: str
    positions: Literal["mrope", "1d"]
    """mrope: Qwen2-VL's ``[B, T, 3]`` multimodal RoPE positions; 1d: plain ``[B, T]``."""
    image_prefix: str = ""
    """Text between the start token and the placeholders (Kimi: ``image<|media_content|>``)."""
    audio_start_token: str = ""
    audio_token: str = ""
    """One per ``audio_samples_per_token`` waveform samples; empty: the family reads no audio."""
    audio_end_token: str = ""
    audio_samples_per_token: int = 0
    """Waveform samples the audio encoder folds into one token (Muse Spark: 1920)."""
    audio_sampling_rate: int = 0
    """The rate, in hertz, the audio encoder was trained at (Muse Spark: 24000)."""

    @property
    def has_audio(self) -> bool:
        return bool(self.audio_token)

    def image_placeholder(self, num_tokens: int) -> str:
        """The text that stands for an image of ``num_tokens`` merged tokens."""
        return (
            self.image_start_token + self.image_prefix + self.image_token * num_tokens
            + self.image_end_token
        )  # fmt: skip

    def audio_tokens(self, num_samples: int) -> int:
        """Tokens of an audio clip of ``num_samples`` samples (the last one partly padding)."""
        return -(-num_samples // self.audio_samples_per_token)

    def audio_placeholder(self, num_samples: int) -> str:
        """The text that stands for an audio clip of ``num_samples`` samples."""
        tokens = self.audio_token * self.audio_tokens(num_samples)
        return self.audio_start_token + tokens + self.audio_end_token

    def special_tokens(self) -> tuple[str, ...]:
        """The tokens only media parts may produce (text holding one is refused)."""
        tokens = (self.image_start_token, self.image_token, self.image_end_token,
                  self.audio_start_token, self.audio_token, self.audio_end_token)  # fmt: skip
        return tuple(t for t in tokens if t)

    def with_builtin_tokens(self) -> MediaLayout:
        """The same layout spelled with builtin:stdlib_bpe_vl's tokens (``<|vision_start|>``,
        ``<|image_pad|>``, ``<|vision_end|>``, ``<|audio_start|>``, ``<|audio_pad|>``,
        ``<|audio_end|>``; no prefix), so every family's debug recipe trains on builtin ids."""
        audio = {}
        if self.has_audio:
            audio = {"audio_start_token": BUILTIN_AUDIO_START, "audio_token": BUILTIN_AUDIO_TOKEN,
                     "audio_end_token": BUILTIN_AUDIO_END}  # fmt: skip
        return replace(
            self, image_start_token=VISION_START_TOKEN, image_token=IMAGE_TOKEN,
            image_end_token=VISION_END_TOKEN, image_prefix="", **audio,
        )  # fmt: skip


MEDIA_LAYOUTS = {
    "qwen3_vl": MediaLayout(
        "qwen3_vl", "qwen2vl", VISION_START_TOKEN, IMAGE_TOKEN, VISION_END_TOKEN, "mrope"
    ),
    "kimi_k25": MediaLayout(
        "kimi_k25", "kimi", "<|media_begin|>", "<|media_pad|>", "<|media_end|>", "1d",
        image_prefix="image<|media_content|>",
    ),
    "muse_glimmer": MediaLayout(
        "muse_glimmer", "muse", "<|image_start|>", "<|patch|>", "<|image_end|>", "1d"
    ),
    "muse_spark": MediaLayout(
        "muse_spark", "muse", "<|image_start|>", "<|patch|>", "<|image_end|>", "1d",
        audio_start_token="<|soft_audio_start|>", audio_token="<|audio|>",
        audio_end_token="<|soft_audio_end|>", audio_samples_per_token=1920,
        audio_sampling_rate=24000,
    ),
}  # fmt: skip
"""--data.media_layout -> layout, named by the model family that reads it."""


def media_layout(name: str) -> MediaLayout:
    """The layout called ``name``, or a ConfigError listing them."""
    if name not in MEDIA_LAYOUTS:
        raise ConfigError(
            f"Unknown --data.media_layout '{name}'.{did_you_mean(name, MEDIA_LAYOUTS)} The "
            f"layouts are {', '.join(MEDIA_LAYOUTS)} (the model family that reads the data)."
        )
    return MEDIA_LAYOUTS[name]


def builtin_media_ids(layout: MediaLayout, vocab_size: int) -> dict[str, int]:
    """The ids builtin:stdlib_bpe_vl of ``vocab_size`` gives ``layout``'s tokens (spelled with
    its own, ``with_builtin_tokens``), by role: what a debug recipe sets in its model's
    placeholder id fields without loading the tokenizer. The media tokens follow the text ids,
    so a model needs a vocabulary of at least vocab_size + 7."""
    builtin = layout.with_builtin_tokens()
    roles = {"image_token_id": builtin.image_token,
             "image_start_token_id": builtin.image_start_token,
             "image_end_token_id": builtin.image_end_token,
             "audio_token_id": builtin.audio_token,
             "audio_start_token_id": builtin.audio_start_token,
             "audio_end_token_id": builtin.audio_end_token}  # fmt: skip
    return {
        role: vocab_size + MEDIA_SPECIAL_TOKENS.index(token)
        for role, token in roles.items()
        if token
    }
