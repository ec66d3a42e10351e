"""The hybrid decoder of Qwen3-Next and Qwen3.5 (``Qwen3NextConfig``) and Qwen3-Next's flavors.

Most layers are Gated DeltaNet linear attention ('gated_deltanet',
models/components/linear_attention.py); every ``full_attention_interval``-th layer (or the
layers an explicit ``layer_types`` names) is gated attention ('gated_attention': an output gate
from q_proj, RoPE on the first quarter of each head, q/k norms). Every feed-forward is a
mixture of experts with a gated shared expert (Qwen3-Next, Qwen3.5-MoE) or a dense SwiGLU
(Qwen3.5 dense). Every RMSNorm but the DeltaNet's output norm is zero-centred: it scales by
(1 + weight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import DecoderConfig, LayerSpec
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.norms import ZeroCenteredRMSNorm
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding

LAYER_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "gated_attention"}
"""Hugging Face's layer_types -> torchloom's mixer kinds."""


def interval_layer_types(layers: int, interval: int) -> tuple[str, ...]:
    """Every interval-th layer full attention, the rest linear (transformers' default)."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    )


@dataclass(frozen=True)
class Qwen3NextConfig(DecoderConfig):
    """Architecture of a Gated DeltaNet + gated attention hybrid (Qwen3-Next, Qwen3.5)."""

    norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    num_heads: int = 4
    """Query heads of the gated attention layers."""
    num_kv_heads: int = 2
    """Key/value heads of the gated attention layers; must divide num_heads."""
    head_dim: int = 32
    """Channels per attention head."""
    partial_rotary_factor: float = 0.25
    """Fraction of each attention head's channels RoPE rotates (the first ones)."""
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10_000_000.0))
    """Rotary embedding over the rotated channels."""
    linear_num_key_heads: int = 2
    """Query/key heads of the Gated DeltaNet layers."""
    linear_num_value_heads: int = 4
    """Value heads (one recurrent state each) of the Gated DeltaNet layers; a multiple of
    linear_num_key_heads."""
    linear_key_head_dim: int = 16
    """Channels per DeltaNet query/key head."""
    linear_value_head_dim: int = 16
    """Channels per DeltaNet value head."""
    linear_conv_kernel: int = 4
    """Width of the DeltaNet's causal convolution over q, k and v."""
    linear_fused_projections: bool = False
    """DeltaNet input projections fused per key-head group (in_proj_qkvz, in_proj_ba: Qwen3-Next's
    checkpoints) rather than separate (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: Qwen3.5)."""
    full_attention_interval: int = 4
    """Every this-many-th layer is gated attention, the rest Gated DeltaNet (used when
    layer_types is empty)."""
    layer_types: tuple[str, ...] = ()
    """Explicit kind of each layer, 'linear_attention' or 'full_attention' (empty: from
    full_attention_interval)."""
    ffn: Literal["moe", "swiglu"] = "moe"
    """Feed-forward of every layer: a mixture of experts or a dense SwiGLU of ffn_dim."""
    ffn_dim: int = 192
    """Hidden width of the dense SwiGLU (ffn 'swiglu')."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing and experts of the MoE feed-forwards (ffn 'moe')."""

    @property
    def rotary_dim(self) -> int:
        """Channels of each attention head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def resolved_layer_types(self) -> tuple[str, ...]:
        """'linear_attention' / 'full_attention' per layer."""
        if self.layer_types:
            return self.layer_types
        return interval_layer_types(self.num_layers, self.full_attention_interval)

    def layer_specs(self) -> list[LayerSpec]:
        return [LayerSpec(LAYER_TYPES[t], self.ffn) for t in self.resolved_layer_types()]

    def rotary(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.rope, self.rotary_dim, self.batch_invariant)

    def make_norm(self, dim: int) -> nn.Module:
        return ZeroCenteredRMSNorm(dim, self.norm_eps, self.norm_impl)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        names = ("num_heads", "num_kv_heads", "head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel", "full_attention_interval", "ffn_dim")  # fmt: skip
        for name in names:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each kv head serves a whole group of query heads."
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads}): each key head serves a "
                "whole group of value heads."
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor ({self.partial_rotary_factor}) must be in (0, 1] and "
                f"rotate an even number of channels (head_dim {self.head_dim} x factor = "
                f"{self.rotary_dim})."
            )
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown or (self.layer_types and len(self.layer_types) != self.num_layers):
            raise ConfigError(
                f"model layer_types must name each of the {self.num_layers} layers as one of "
                f"{', '.join(LAYER_TYPES)}; got {list(self.layer_types)}."
            )
        if self.ffn not in ("moe", "swiglu"):
            raise ConfigError(f"model ffn must be 'moe' or 'swiglu', got {self.ffn!r}.")
        super().validate()
        self.rope.validate()
        if self.ffn == "moe":
            self.moe.validate()


# -- flavors --------------------------------------------------------------------------------

QWEN3_NEXT_FLAVORS: dict[str, Qwen3NextConfig] = {
    # 3 DeltaNet layers + 1 gated attention layer, 8 experts with a gated shared expert.
    "debug": Qwen3NextConfig(
        vocab_size=4096, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_fused_projections=True, max_seq_len=512,
        moe=MoEConfig(
            num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1, shared_expert_gate=True,
            normalize_top_k=True,
        ),
    ),
    # Qwen/Qwen3-Next-80B-A3B-{Instruct,Thinking}: 48 layers (36 DeltaNet, 12 attention),
    # 512 experts, 10 per token, one gated shared expert.
    "80B-A3B": Qwen3NextConfig(
        vocab_size=151936, dim=2048, num_layers=48, num_heads=16, num_kv_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_fused_projections=True, ffn_dim=5120,
        max_seq_len=262144,
        moe=MoEConfig(
            num_experts=512, top_k=10, expert_dim=512, num_shared_experts=1,
            shared_expert_gate=True, normalize_top_k=True,
        ),
    ),
}  # fmt: skip
