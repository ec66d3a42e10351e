"""Muse Glimmer's architecture (``MuseGlimmerConfig``): its text decoder, which Muse Spark's
extends, and its vision encoder (``vision``, models/components/muse_vision.py), whose image
tokens replace the ``image_token_id`` placeholders (<|patch|>, t*h*w/4 per image, between
<|image_start|> and <|image_end|>). The model is models/muse_glimmer/model.py.

Every layer is 'muse_attention' (registered here): grouped-query attention whose queries and
keys pass one weightless RMSNorm, the queries then scaled by ``qk_scale`` (on top of
1/sqrt(head_dim)), and whose output is gated by sigmoid(gate_proj(x)). Counting back from the
last layer, every 4th is full attention without RoPE; the rest attend within a sliding window
with rotate-half RoPE. The feed-forward is a SwiGLU. Blocks have sandwich norms: (1 + w)
RMSNorms before and after both branches (the post-norms with their own tiny epsilon). The
embeddings pass a weightless RMSNorm (no sqrt(dim) scaling); the final norm scales by a plain
weight w; the logits are soft-capped: cap * tanh(logits * logit_scale / cap).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.models.components.attention import Attention
from torchloom.models.components.decoder import (
    MIXERS,
    DecoderConfig,
    LayerSpec,
    _residual_std,
)
from torchloom.models.components.muse_vision import MuseVisionConfig
from torchloom.models.components.norms import NORM_IMPLS, WeightlessRMSNorm, ZeroCenteredRMSNorm
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding

LAYER_TYPES = ("sliding_attention", "full_attention")
DEBUG_VISION = MuseVisionConfig(
    patch_size=4, dim=32, num_layers=2, num_heads=2, ffn_dim=64, pos_grid=4, adapter_dim=64,
    text_dim=64,
)  # fmt: skip
"""The debug flavors' ViT (and the default): 2 layers, 4 x 4-patch windows, text width 64."""


def default_layer_types(layers: int) -> tuple[str, ...]:
    """Full attention on every 4th layer counted back from the last, sliding elsewhere."""
    return tuple(
        "full_attention" if (layers - 1 - i) % 4 == 0 else "sliding_attention"
        for i in range(layers)
    )


@dataclass(frozen=True)
class MuseGlimmerConfig(DecoderConfig):
    """Architecture of Muse Glimmer's text decoder (module docstring)."""

    media_layout: ClassVar[str] = "muse_glimmer"
    """The --data.media_layout whose rendering of media this model reads."""

    norm_eps: float = 1e-5
    """Epsilon of the pre-norms, the q/k and embedding norms and the final norm."""
    post_norm_eps: float = 1e-8
    """Epsilon of the post-attention and post-feed-forward norms."""
    num_heads: int = 4
    """Query heads per attention layer."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int = 16
    """Channels per head."""
    ffn_dim: int = 128
    """Hidden width of the SwiGLU feed-forward."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary embedding of the layers with RoPE."""
    qk_scale: float = 3.87
    """The normed queries are multiplied by this (qk_scale_factor)."""
    sliding_window: int = 2048
    """Keys a sliding-window layer's query sees: itself and the window - 1 before it."""
    layer_types: tuple[str, ...] = ()
    """Each layer's 'sliding_attention' or 'full_attention' (empty: every 4th layer counted
    back from the last is full)."""
    rope_layers: tuple[bool, ...] = ()
    """Whether each layer rotates q and k (empty: the sliding layers do, the full ones not)."""
    logit_scale: float = 0.19611613513818404
    """The logits are multiplied by this before the soft-cap (output_multiplier)."""
    logit_cap: float = 20.0
    """Soft-cap of the logits: cap * tanh(logits * logit_scale / cap)."""
    vision: MuseVisionConfig = field(default_factory=lambda: DEBUG_VISION)
    """The vision encoder and its adapter (override fields as 'vision.num_layers', ...); its
    ``text_dim`` and ``text_norm_eps`` are the decoder's ``dim`` and ``norm_eps``."""
    image_token_id: int = 4093
    """The placeholder an image's merged tokens replace (<|patch|>)."""
    video_token_id: int = 4094
    """The video placeholder (videos are not read yet; kept for export)."""

    def build(self):  # -> MuseGlimmer (a lazy import: the model module imports this one)
        from torchloom.models.muse_glimmer.model import MuseGlimmer

        return MuseGlimmer(self)

    @property
    def attention_out_norm(self) -> bool:
        """Whether each head's output is normed before the gate (Spark: yes)."""
        return False

    def attention_mask(self, layer: int) -> AttentionMask:
        """A sliding window on the 'sliding_attention' layers; causal on the full ones."""
        if self.resolved_layer_types()[layer] == "sliding_attention":
            return AttentionMask(window=self.sliding_window)
        return CAUSAL

    def resolved_layer_types(self) -> tuple[str, ...]:
        return self.layer_types or default_layer_types(self.num_layers)

    def resolved_rope_layers(self) -> tuple[bool, ...]:
        if self.rope_layers:
            return self.rope_layers
        return tuple(t == "sliding_attention" for t in self.resolved_layer_types())

    def layer_specs(self) -> list[LayerSpec]:
        return [LayerSpec("muse_attention", "swiglu")] * self.num_layers

    def rotary(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.rope, self.head_dim, self.batch_invariant)

    def make_norm(self, dim: int) -> nn.Module:
        return ZeroCenteredRMSNorm(dim, self.norm_eps, self.norm_impl)

    def make_final_norm(self) -> nn.Module:
        return NORM_IMPLS[self.norm_impl](self.dim, self.norm_eps)

    def make_post_norm(self, dim: int, slot: Literal["attention", "mlp"]) -> nn.Module | None:
        return ZeroCenteredRMSNorm(dim, self.post_norm_eps, self.norm_impl)

    def make_embedding_norm(self) -> nn.Module | None:
        return WeightlessRMSNorm(self.norm_eps)

    def logit_softcap(self) -> tuple[float, float] | None:
        return self.logit_scale, self.logit_cap

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        for name in ("num_heads", "num_kv_heads", "head_dim", "ffn_dim", "sliding_window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        for name in ("post_norm_eps", "qk_scale", "logit_scale", "logit_cap"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each kv head serves a whole group of query heads."
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        types = self.layer_types
        if types and (len(types) != self.num_layers or set(types) - set(LAYER_TYPES)):
            raise ConfigError(
                f"model layer_types must name each of the {self.num_layers} layers as one of "
                f"{', '.join(LAYER_TYPES)}; got {list(types)}."
            )
        if self.rope_layers and len(self.rope_layers) != self.num_layers:
            raise ConfigError(
                f"model rope_layers must have one entry per layer ({self.num_layers}), got "
                f"{len(self.rope_layers)}."
            )
        if self.attn_backend != "sdpa" or self.batch_invariant or self.float8 != "none":
            raise ConfigError(
                f"{type(self).__name__} runs with attn_backend 'sdpa' (its sliding window lives "
                "in that backend's mask), without batch_invariant or float8, for now; got "
                f"attn_backend {self.attn_backend!r}, batch_invariant {self.batch_invariant}, "
                f"float8 {self.float8!r}."
            )
        super().validate()
        self.rope.validate()
        self.vision.validate()
        if (self.vision.text_dim, self.vision.text_norm_eps) != (self.dim, self.norm_eps):
            raise ConfigError(
                f"model vision.text_dim {self.vision.text_dim} and vision.text_norm_eps "
                f"{self.vision.text_norm_eps} must equal dim {self.dim} and norm_eps "
                f"{self.norm_eps}: the adapter writes the decoder's normed embeddings."
            )
        for name in ("image_token_id", "video_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(
                    f"model {name} {getattr(self, name)} is not a token id "
                    f"(vocab_size {self.vocab_size})."
                )


def _muse_attention(cfg: Any, layer: int) -> nn.Module:
    return Attention(
        cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=True,
        norm_eps=cfg.norm_eps, backend=cfg.attn_backend, rope_impl=cfg.rope_impl,
        init_std=cfg.init_std, out_std=_residual_std(cfg),
        make_norm=lambda dim: WeightlessRMSNorm(cfg.norm_eps), gate_proj=True,
        q_scale=cfg.qk_scale, rotary=cfg.resolved_rope_layers()[layer],
        mask=cfg.attention_mask(layer), out_norm=cfg.attention_out_norm,
    )  # fmt: skip


MIXERS["muse_attention"] = _muse_attention


# -- flavors --------------------------------------------------------------------------------


def with_text_width(cfg: MuseGlimmerConfig) -> MuseGlimmerConfig:
    """``cfg`` with its encoders writing its text width and embedding-norm epsilon."""
    audio = getattr(cfg, "audio", None)
    kw = {"text_dim": cfg.dim, "text_norm_eps": cfg.norm_eps}
    more = {} if audio is None else {"audio": replace(audio, **kw)}
    return replace(cfg, vision=replace(cfg.vision, **kw), **more)


MUSE_GLIMMER_FLAVORS: dict[str, MuseGlimmerConfig] = {
    # 4 layers: sliding (window 16), sliding, sliding, full without RoPE; a 2-layer ViT over
    # 4-pixel patches (4 x 4-patch windows).
    "debug": MuseGlimmerConfig(
        vocab_size=4096, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        ffn_dim=128, sliding_window=16, max_seq_len=512,
    ),
    # meta-models/Muse-Glimmer-30B: transformers' MuseGlimmer(Text/Vision)Config defaults (its
    # RoPE theta there is the library default, 10000).
    "30B": with_text_width(MuseGlimmerConfig(
        vocab_size=202048, dim=6656, num_layers=52, num_heads=32, num_kv_heads=2, head_dim=128,
        ffn_dim=19968, max_seq_len=131072, vision=MuseVisionConfig(), image_token_id=200092,
        video_token_id=200091,
    )),
}  # fmt: skip
