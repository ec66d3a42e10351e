"""Qwen3 dense: its config (a dense decoder whose layers may interleave sliding-window and full
attention, Hugging Face's ``layer_types``) and the debug and published 0.6B ... 32B flavors."""

from __future__ import annotations

from dataclasses import dataclass

from torchloom.config.errors import ConfigError
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.models.components.rope import RopeConfig
from torchloom.models.components.transformer import TransformerConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Qwen3Config(TransformerConfig):
    """A Qwen3 dense decoder. Gemma-style interleaving is a config change: ``layer_types``
    names each layer's attention, and the sliding ones see ``sliding_window`` keys."""

    layer_types: tuple[str, ...] = ()
    """Each layer's 'full_attention' or 'sliding_attention' (empty: every layer full)."""
    sliding_window: int | None = None
    """Keys a 'sliding_attention' layer's query sees: itself and the window - 1 before it."""

    def attention_mask(self, layer: int) -> AttentionMask:
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return AttentionMask(window=self.sliding_window)
        return CAUSAL

    def validate(self) -> None:
        super().validate()
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"model layer_types names {len(self.layer_types)} layers, but num_layers is "
                f"{self.num_layers}: name every layer (or none: all full attention)."
            )
        if unknown := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ConfigError(
                f"model layer_types {unknown} are not attention kinds qwen3 knows; use "
                f"{' or '.join(LAYER_TYPES)}."
            )
        sliding = "sliding_attention" in self.layer_types
        if sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(
                f"model layer_types has sliding_attention layers but sliding_window is "
                f"{self.sliding_window}; set it to a positive number of keys (model.overrides)."
            )


_ROPE = RopeConfig(theta=1000000.0)
_VOCAB = 151936
_CONTEXT = 40960


def _qwen3(
    dim: int, num_layers: int, num_heads: int, ffn_dim: int, tie_embeddings: bool
) -> Qwen3Config:
    """A released Qwen3 dense shape; they all share vocab, context, 8 kv heads of 128."""
    return Qwen3Config(
        vocab_size=_VOCAB,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn_dim,
        norm_eps=1e-6,
        rope=_ROPE,
        max_seq_len=_CONTEXT,
        qk_norm=True,
        tie_embeddings=tie_embeddings,
    )


QWEN3_FLAVORS: dict[str, Qwen3Config] = {
    "debug": Qwen3Config(
        vocab_size=4096,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,  # heads * head_dim = 128 != dim, as in the real 0.6B and 4B shapes
        ffn_dim=192,
        norm_eps=1e-6,
        rope=_ROPE,
        max_seq_len=512,
        qk_norm=True,
        tie_embeddings=True,
    ),
    "0.6B": _qwen3(dim=1024, num_layers=28, num_heads=16, ffn_dim=3072, tie_embeddings=True),
    "1.7B": _qwen3(dim=2048, num_layers=28, num_heads=16, ffn_dim=6144, tie_embeddings=True),
    "4B": _qwen3(dim=2560, num_layers=36, num_heads=32, ffn_dim=9728, tie_embeddings=True),
    "8B": _qwen3(dim=4096, num_layers=36, num_heads=32, ffn_dim=12288, tie_embeddings=False),
    "14B": _qwen3(dim=5120, num_layers=40, num_heads=40, ffn_dim=17408, tie_embeddings=False),
    "32B": _qwen3(dim=5120, num_layers=64, num_heads=64, ffn_dim=25600, tie_embeddings=False),
}
