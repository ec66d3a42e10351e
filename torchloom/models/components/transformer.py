"""The decoder of Llama 3, Qwen3 and Qwen3-MoE: every layer grouped-query attention with RoPE,
then a SwiGLU feed-forward (``TransformerConfig``) or, after the first dense layers, a mixture of
experts (``MoETransformerConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import DecoderConfig, LayerSpec
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding


@dataclass(frozen=True)
class TransformerConfig(DecoderConfig):
    """Architecture of a dense decoder (one flavor of llama3 or qwen3)."""

    num_heads: int = 4
    """Query heads per attention layer."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int | None = None
    """Channels per head; None means dim // num_heads (Qwen3 sets it independently of dim)."""
    ffn_dim: int = 192
    """Hidden width of the SwiGLU feed-forward."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary position embedding frequencies (override fields as 'rope.theta', ...)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on every query and key head before RoPE (Qwen3)."""

    def layer_specs(self) -> list[LayerSpec]:
        return [LayerSpec("attention", "swiglu")] * self.num_layers

    def rotary(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.rope, self.resolved_head_dim, self.batch_invariant)

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or dim // num_heads when it is not set."""
        return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        super().validate()
        for name in ("num_heads", "num_kv_heads", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each kv head serves a whole group of query heads."
            )
        if self.head_dim is None and self.dim % self.num_heads:
            raise ConfigError(
                f"dim ({self.dim}) is not divisible by num_heads ({self.num_heads}); "
                "change one of them or set head_dim explicitly."
            )
        if self.resolved_head_dim <= 0 or self.resolved_head_dim % 2:
            source = (
                "" if self.head_dim is not None
                else f" (dim {self.dim} / num_heads {self.num_heads})"
            )  # fmt: skip
            raise ConfigError(
                f"head_dim must be positive and even for RoPE, got {self.resolved_head_dim}"
                f"{source}; change dim or num_heads in --model.overrides, or set head_dim."
            )
        self.rope.validate()


@dataclass(frozen=True)
class MoETransformerConfig(TransformerConfig):
    """A decoder of grouped-query attention layers whose feed-forwards are mixtures of experts
    after the first ``first_dense_layers`` (which keep a dense SwiGLU of ffn_dim): Qwen3-MoE."""

    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing and experts of the MoE layers (override fields as 'moe.top_k', ...)."""
    first_dense_layers: int = 0
    """Layers 0 .. first_dense_layers - 1 keep a dense SwiGLU feed-forward."""

    def layer_specs(self) -> list[LayerSpec]:
        return [
            LayerSpec("attention", "swiglu" if i < self.first_dense_layers else "moe")
            for i in range(self.num_layers)
        ]

    def validate(self) -> None:
        super().validate()
        self.moe.validate()
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ConfigError(
                f"model first_dense_layers must be in [0, num_layers={self.num_layers}], got "
                f"{self.first_dense_layers}."
            )
