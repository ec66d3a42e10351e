"""Kimi K2.5's architecture (``KimiK25Config``): Kimi K2's DeepSeek-V3 decoder reading images
through MoonViT, and its flavors: ``debug`` (tiny, CPU-trainable) and ``K2.5`` (the published
shape).

An image takes ``h * w / merge**2`` placeholder tokens (``image_token_id``; Kimi's chat template
writes ``<|media_begin|>image<|media_content|>`` before them and ``<|media_end|>`` after), which
the merged, projected image tokens replace. Positions are the text model's plain 1-D ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

from torchloom.config.errors import ConfigError
from torchloom.models.components.moonvit import MoonViTConfig
from torchloom.models.deepseek_v3.config import DEEPSEEK_V3_FLAVORS, DeepSeekV3Config


@dataclass(frozen=True)
class KimiK25Config(DeepSeekV3Config):
    """A Kimi K2.5 architecture: the DeepSeek-V3 decoder's fields plus the vision encoder and
    the placeholder ids."""

    media_layout: ClassVar[str] = "kimi_k25"
    """The --data.media_layout whose rendering of media this model reads."""

    vision: MoonViTConfig = field(default_factory=lambda: MoonViTConfig(text_dim=64))
    """MoonViT and its projector (override fields as 'vision.num_layers', ...); its
    ``text_dim`` is the decoder's ``dim``."""
    image_token_id: int = 4093
    """The placeholder an image's merged tokens replace (<|media_pad|>)."""
    video_token_id: int = 4094
    """The video placeholder (videos are not read yet; kept for export)."""
    vision_start_token_id: int = 4090
    """The token opening an image's span (<|media_begin|>; kept for export)."""
    vision_end_token_id: int = 4091
    """The token closing it (<|media_end|>; kept for export)."""

    def build(self):  # -> KimiK25 (a lazy import: the model module imports this one)
        from torchloom.models.kimi_k25.model import KimiK25

        return KimiK25(self)

    def validate(self) -> None:
        super().validate()
        self.vision.validate()
        if self.vision.text_dim != self.dim:
            raise ConfigError(
                f"model vision.text_dim {self.vision.text_dim} must equal dim {self.dim}: the "
                "projector writes the decoder's embeddings."
            )
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ConfigError(
                f"model image_token_id {self.image_token_id} is not a token id "
                f"(vocab_size {self.vocab_size})."
            )


def _with_vision(text: DeepSeekV3Config, vision: MoonViTConfig, **kw) -> KimiK25Config:
    shared = {f.name: getattr(text, f.name) for f in fields(text)}
    return KimiK25Config(**shared, vision=replace(vision, text_dim=text.dim), **kw)


_DEBUG_VISION = MoonViTConfig(patch_size=4, dim=32, num_layers=2, num_heads=2, ffn_dim=64,
                              pos_grid=8)  # fmt: skip
# Kimi K2's decoder with Kimi K2.5's 256K context (YaRN factor 64 over 4K).
_K25_TEXT = replace(
    DEEPSEEK_V3_FLAVORS["kimi-k2"],
    max_seq_len=262144,
    rope=replace(DEEPSEEK_V3_FLAVORS["kimi-k2"].rope, factor=64.0),
)

KIMI_K25_FLAVORS: dict[str, KimiK25Config] = {
    # deepseek_v3's debug decoder without MTP, a 2-layer MoonViT; the builtin VL tokenizer's
    # vision ids (builtin:stdlib_bpe_vl) as placeholders.
    "debug": _with_vision(replace(DEEPSEEK_V3_FLAVORS["debug"], mtp_layers=0), _DEBUG_VISION),
    "K2.5": _with_vision(
        _K25_TEXT,
        MoonViTConfig(),
        image_token_id=163605,
        video_token_id=163840,
        vision_start_token_id=163602,
        vision_end_token_id=163604,
    ),
}
