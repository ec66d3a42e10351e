"""The text decoder of Muse Spark (``MuseSparkConfig``): Muse Glimmer's (models/muse_glimmer/)
with

- each attention head's output normed (weightless RMSNorm) before the gate;
- the post-attention norm without weight; the post-feed-forward norm scales by (1 + w), then
  normalizes;
- each branch joined by a learned residual gate (models/components/residual_gate.py) instead
  of a sum;
- mixtures of experts ('latent_moe', models/components/latent_moe.py) that run at
  ``latent_dim`` channels: a (1 + w) RMSNorm after the down-projection, each expert's output
  scaled then normed, no shared experts; sigmoid routing in fp32 on the logits times
  ``logit_scale``, the correction bias for the choice only, the top-k weights renormalized;
- layers that ``mlp_layer_types`` names 'dense' keep a SwiGLU of ffn_dim;
- Glimmer's vision encoder, and an audio encoder (``audio``, models/components/audio.py) whose
  tokens replace the ``audio_token_id`` placeholders (<|audio|>, ceil(samples / 1920) per clip,
  between <|soft_audio_start|> and <|soft_audio_end|>).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.audio import MuseAudioConfig
from torchloom.models.components.decoder import FFNS, MOE_FFNS, LayerSpec, _residual_std
from torchloom.models.components.latent_moe import LatentMoE
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.muse_vision import MuseVisionConfig
from torchloom.models.components.norms import (
    ScaleThenNormRMSNorm,
    WeightlessRMSNorm,
    ZeroCenteredRMSNorm,
)
from torchloom.models.components.residual_gate import ResidualGate
from torchloom.models.components.rope import RopeConfig
from torchloom.models.muse_glimmer.config import MuseGlimmerConfig, with_text_width

MLP_LAYER_TYPES = {"sparse": "latent_moe", "dense": "swiglu"}
"""Hugging Face's mlp_layer_types -> torchloom's feed-forward kinds."""


DEBUG_AUDIO = MuseAudioConfig(
    patch_sizes=(4, 4), hidden_sizes=(16, 32), depths=(1, 1), text_dim=64
)  # fmt: skip
"""The debug flavor's audio encoder (and the default): 2 stages, 16 samples per token."""


def _spark_moe() -> MoEConfig:
    return MoEConfig(
        num_experts=8, top_k=2, expert_dim=32, score_func="sigmoid", normalize_top_k=True,
        expert_bias=True,
    )  # fmt: skip


@dataclass(frozen=True)
class MuseSparkConfig(MuseGlimmerConfig):
    """Architecture of Muse Spark's text decoder (module docstring)."""

    media_layout: ClassVar[str] = "muse_spark"
    """The --data.media_layout whose rendering of media this model reads."""

    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=500_000.0))
    """Rotary embedding of the layers with RoPE."""
    qk_scale: float = 5.4730064863875
    """The normed queries are multiplied by this (qk_scale_factor)."""
    logit_scale: float = 0.1767766952966369
    """Logits (and router logits) are multiplied by this (output_multiplier)."""
    residual_gate_temperature: float = 0.3
    """Temperature t of the residual gates: beta = sigmoid(g / t)."""
    latent_dim: int = 48
    """Width the MoE layers' experts run at (moe_hidden_size)."""
    moe: MoEConfig = field(default_factory=_spark_moe)
    """Routing and experts of the MoE layers (sigmoid scores, choice bias, renormalized)."""
    mlp_layer_types: tuple[str, ...] = ()
    """Each layer's 'sparse' (MoE) or 'dense' (SwiGLU) feed-forward (empty: all sparse)."""
    audio: MuseAudioConfig = field(default_factory=lambda: DEBUG_AUDIO)
    """The audio encoder (override fields as 'audio.depths', ...); its ``text_dim`` and
    ``text_norm_eps`` are the decoder's ``dim`` and ``norm_eps``."""
    audio_token_id: int = 4095
    """The placeholder a clip's tokens replace (<|audio|>)."""

    def build(self):  # -> MuseSpark (a lazy import: the model module imports this one)
        from torchloom.models.muse_glimmer.model import MuseSpark

        return MuseSpark(self)

    @property
    def attention_out_norm(self) -> bool:
        return True

    def resolved_mlp_layer_types(self) -> tuple[str, ...]:
        return self.mlp_layer_types or ("sparse",) * self.num_layers

    def layer_specs(self) -> list[LayerSpec]:
        return [
            LayerSpec("muse_attention", MLP_LAYER_TYPES[t]) for t in self.resolved_mlp_layer_types()
        ]

    def make_post_norm(self, dim: int, slot: Literal["attention", "mlp"]) -> nn.Module | None:
        if slot == "attention":
            return WeightlessRMSNorm(self.post_norm_eps)
        return ScaleThenNormRMSNorm(dim, self.post_norm_eps)

    def make_residual(self, dim: int, slot: Literal["attention", "mlp"]) -> nn.Module | None:
        return ResidualGate(dim, self.residual_gate_temperature, self.init_std)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        if self.latent_dim <= 0 or self.residual_gate_temperature <= 0:
            raise ConfigError(
                f"model latent_dim ({self.latent_dim}) and residual_gate_temperature "
                f"({self.residual_gate_temperature}) must be positive."
            )
        types = self.mlp_layer_types
        if types and (len(types) != self.num_layers or set(types) - set(MLP_LAYER_TYPES)):
            raise ConfigError(
                f"model mlp_layer_types must name each of the {self.num_layers} layers as one "
                f"of {', '.join(MLP_LAYER_TYPES)}; got {list(types)}."
            )
        moe = self.moe
        if moe.score_func != "sigmoid" or not moe.expert_bias or moe.num_shared_experts:
            raise ConfigError(
                "Muse Spark's experts are routed by sigmoid scores with the choice bias and "
                f"have no shared experts; got moe.score_func {moe.score_func!r}, "
                f"moe.expert_bias {moe.expert_bias}, moe.num_shared_experts "
                f"{moe.num_shared_experts}."
            )
        super().validate()
        moe.validate()
        self.audio.validate()
        if (self.audio.text_dim, self.audio.text_norm_eps) != (self.dim, self.norm_eps):
            raise ConfigError(
                f"model audio.text_dim {self.audio.text_dim} and audio.text_norm_eps "
                f"{self.audio.text_norm_eps} must equal dim {self.dim} and norm_eps "
                f"{self.norm_eps}: the audio encoder writes the decoder's normed embeddings."
            )
        if not 0 <= self.audio_token_id < self.vocab_size:
            raise ConfigError(
                f"model audio_token_id {self.audio_token_id} is not a token id "
                f"(vocab_size {self.vocab_size})."
            )


def _latent_moe(cfg: Any, layer: int) -> nn.Module:
    return LatentMoE(
        cfg.dim, cfg.latent_dim, cfg.moe,
        norm_in=ZeroCenteredRMSNorm(cfg.latent_dim, cfg.norm_eps, cfg.norm_impl),
        norm_out=ScaleThenNormRMSNorm(cfg.latent_dim, cfg.post_norm_eps),
        router_logit_scale=cfg.logit_scale, impl=cfg.mlp_impl, init_std=cfg.init_std,
        out_std=_residual_std(cfg),
    )  # fmt: skip


FFNS["latent_moe"] = _latent_moe
MOE_FFNS.add("latent_moe")


# -- flavors --------------------------------------------------------------------------------

MUSE_SPARK_FLAVORS: dict[str, MuseSparkConfig] = {
    # 4 layers (3 sliding with window 16, 1 full without RoPE); layer 0 dense, 3 MoE layers
    # of 8 experts at width 48, top-2.
    "debug": MuseSparkConfig(
        vocab_size=4096, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        ffn_dim=128, sliding_window=16, max_seq_len=512, latent_dim=48,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    ),
    # meta-models/Muse-Spark-Open-816B-A42B: transformers' MuseSpark(Text/Vision/Audio)Config
    # defaults.
    "816B-A42B": with_text_width(MuseSparkConfig(
        vocab_size=202048, dim=8192, num_layers=62, num_heads=128, num_kv_heads=16,
        head_dim=64, ffn_dim=16384, max_seq_len=1048576, latent_dim=4096,
        moe=MoEConfig(
            num_experts=256, top_k=8, expert_dim=4096, score_func="sigmoid",
            normalize_top_k=True, expert_bias=True,
        ),
        vision=MuseVisionConfig(), audio=MuseAudioConfig(), image_token_id=200092,
        video_token_id=200091, audio_token_id=200038,
    )),
}  # fmt: skip
