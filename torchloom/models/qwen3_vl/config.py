"""Qwen3-VL: a Qwen3 decoder (dense, or Qwen3-MoE's experts) reading images through a
native-resolution ViT with DeepStack, positions by interleaved M-RoPE.

Flavors: ``debug`` and ``debug_moe`` (tiny, for CPU runs) and the published 2B, 8B, 30B-A3B and
235B-A22B shapes (Qwen/Qwen3-VL-*-Instruct config.json).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torchloom.config.errors import ConfigError
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.multimodal import MultimodalDecoder
from torchloom.models.components.rope import MRotaryEmbedding, RopeConfig
from torchloom.models.components.transformer import MoETransformerConfig
from torchloom.models.components.vision import VisionConfig


@dataclass(frozen=True)
class Qwen3VLConfig(MoETransformerConfig):
    """A Qwen3-VL architecture. The decoder is dense when first_dense_layers == num_layers (its
    ``moe`` then unused), Qwen3-VL-MoE's otherwise."""

    media_layout: ClassVar[str] = "qwen3_vl"
    """The --data.media_layout whose rendering of media this model reads."""

    vision: VisionConfig = field(default_factory=VisionConfig)
    """The vision encoder (override fields as 'vision.depth', ...)."""
    mrope_section: tuple[int, int, int] = (8, 4, 4)
    """Frequency pairs of each head turned by the (t, h, w) positions; sums to head_dim / 2."""
    image_token_id: int = 4093
    """The placeholder token an image's merged tokens replace."""
    vision_start_token_id: int = 4090
    """The token before an image's placeholders (position ids find images by it)."""
    vision_end_token_id: int = 4091
    """The token after an image's placeholders (kept for export)."""
    video_token_id: int = 4094
    """The video placeholder (videos are not read yet; kept for export)."""

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts (Qwen3-VL-MoE)."""
        return self.first_dense_layers < self.num_layers

    def rotary(self) -> MRotaryEmbedding:
        return MRotaryEmbedding(
            self.rope, self.resolved_head_dim, self.mrope_section, self.batch_invariant
        )

    def build(self) -> MultimodalDecoder:
        return MultimodalDecoder(self)

    def validate(self) -> None:
        super().validate()
        self.vision.validate()
        if sum(self.mrope_section) != self.resolved_head_dim // 2 or min(self.mrope_section) < 0:
            raise ConfigError(
                f"mrope_section {list(self.mrope_section)} must be three counts summing to "
                f"head_dim / 2 = {self.resolved_head_dim // 2}."
            )
        if len(self.vision.deepstack_layers) > self.num_layers:
            raise ConfigError(
                f"{len(self.vision.deepstack_layers)} DeepStack layers but only "
                f"{self.num_layers} decoder layers to add them to."
            )
        for name in ("image_token_id", "vision_start_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(
                    f"model {name} {getattr(self, name)} is not a token id "
                    f"(vocab_size {self.vocab_size})."
                )


_VOCAB = 151936
_CONTEXT = 262144
_ROPE = RopeConfig(theta=5000000.0)
_TOKENS = dict(image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653,
               video_token_id=151656)  # fmt: skip
# The two released encoders: 2B/4B's and 8B/32B/MoE's (patch 16, merge 2, 48x48 positions).
_SMALL_VIT = dict(depth=24, dim=1024, ffn_dim=4096, num_heads=16, deepstack_layers=(5, 11, 17))
_LARGE_VIT = dict(depth=27, dim=1152, ffn_dim=4304, num_heads=16, deepstack_layers=(8, 16, 24))


def _vision(shape: dict) -> VisionConfig:
    return VisionConfig(**shape, patch_size=16, num_position_embeddings=2304)


def _qwen3_vl(
    dim: int, num_layers: int, num_heads: int, num_kv_heads: int, ffn_dim: int,
    vision: dict, tie: bool, moe: MoEConfig | None = None,
) -> Qwen3VLConfig:  # fmt: skip
    return Qwen3VLConfig(
        vocab_size=_VOCAB, dim=dim, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=128, ffn_dim=ffn_dim, norm_eps=1e-6, rope=_ROPE,
        max_seq_len=_CONTEXT, qk_norm=True, tie_embeddings=tie, vision=_vision(vision),
        mrope_section=(24, 20, 20), moe=moe or MoEConfig(),
        first_dense_layers=0 if moe else num_layers, **_TOKENS,
    )  # fmt: skip


def _experts(expert_dim: int) -> MoEConfig:
    # Qwen3-VL-MoE always renormalises the chosen 8 of 128 (no norm_topk_prob option).
    return MoEConfig(num_experts=128, top_k=8, expert_dim=expert_dim, normalize_top_k=True)


_DEBUG = dict(
    vocab_size=4096, dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
    ffn_dim=192, norm_eps=1e-6, rope=RopeConfig(theta=1000000.0), max_seq_len=512,
    qk_norm=True, mrope_section=(8, 4, 4),
    vision=VisionConfig(depth=2, dim=32, ffn_dim=64, num_heads=2, patch_size=4,
                        num_position_embeddings=16, deepstack_layers=(0, 1)),
)  # fmt: skip

QWEN3_VL_FLAVORS: dict[str, Qwen3VLConfig] = {
    "debug": Qwen3VLConfig(**_DEBUG, tie_embeddings=True, first_dense_layers=3),
    "debug_moe": Qwen3VLConfig(
        **_DEBUG,
        first_dense_layers=0,
        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=32, normalize_top_k=True),
    ),
    "2B": _qwen3_vl(2048, 28, 16, 8, 6144, _SMALL_VIT, tie=True),
    "8B": _qwen3_vl(4096, 36, 32, 8, 12288, _LARGE_VIT, tie=False),
    "30B-A3B": _qwen3_vl(2048, 48, 32, 4, 6144, _LARGE_VIT, tie=False, moe=_experts(768)),
    "235B-A22B": _qwen3_vl(4096, 94, 64, 4, 12288, _LARGE_VIT, tie=False, moe=_experts(1536)),
}
