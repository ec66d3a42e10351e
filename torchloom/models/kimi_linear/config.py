"""Kimi Linear's architecture (``KimiLinearConfig``) and its flavors: the debug model and the
published Kimi-Linear-48B-A3B shape.

A hybrid of Kimi Delta Attention ('kda', models/components/kda.py) and multi-head latent
attention ('mla', models/components/mla.py) layers, the latter without positional encoding
(NoPE: Kimi Linear's KDA layers carry the order); the listed ``full_attention_layers`` are MLA,
the rest KDA (the published model: every fourth layer, and the last). The first
``first_dense_layers`` have a dense SwiGLU feed-forward and the rest a mixture of experts
(sigmoid scores with the balancing bias, top-k renormalised, scaled, and a shared expert).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import DecoderConfig, LayerSpec
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding


@dataclass(frozen=True)
class KimiLinearConfig(DecoderConfig):
    """Architecture of a Kimi Linear decoder (one flavor of kimi_linear)."""

    num_heads: int = 4
    """Heads of the MLA (full attention) layers."""
    q_lora_rank: int | None = None
    """Rank of MLA's low-rank query (q_a_proj, q_a_layernorm, q_b_proj); None or 0: q_proj."""
    kv_lora_rank: int = 32
    """Width of MLA's latent each token's keys and values are made from (what it caches)."""
    qk_nope_head_dim: int = 16
    """MLA query/key channels per head made from the latent."""
    qk_rope_head_dim: int = 8
    """MLA query/key channels per head whose key part all heads share (rotated by RoPE only
    when mla_use_nope is false)."""
    v_head_dim: int = 16
    """MLA value channels per head."""
    latent_norm_eps: float = 1e-6
    """Epsilon of MLA's q_a_layernorm and kv_a_layernorm (transformers builds them with its
    RMSNorm's default, not rms_norm_eps)."""
    mla_use_nope: bool = True
    """MLA without positional encoding (Kimi Linear); false rotates the shared parts by RoPE."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary embedding over qk_rope_head_dim, used only when mla_use_nope is false."""
    kda_num_heads: int = 4
    """Heads of the KDA (linear attention) layers."""
    kda_head_dim: int = 16
    """Key and value channels per KDA head (also the rank of its forget and output gates)."""
    kda_conv_size: int = 4
    """Taps of KDA's short causal convolutions on q, k and v."""
    full_attention_layers: tuple[int, ...] = (3,)
    """Indices (from 0) of the MLA layers; every other layer is KDA."""
    ffn_dim: int = 192
    """Hidden width of the dense layers' SwiGLU."""
    first_dense_layers: int = 1
    """Layers 0 .. first_dense_layers - 1 have a dense SwiGLU; the rest are MoE layers."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing and experts of the MoE layers (override fields as 'moe.top_k', ...)."""

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key channels per head: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_interleave(self) -> bool:
        """The shared key parts are never interleaved pairs (RoPE, if any, rotates halves)."""
        return False

    def layer_specs(self) -> list[LayerSpec]:
        full = set(self.full_attention_layers)
        return [
            LayerSpec("mla" if i in full else "kda",
                      "swiglu" if i < self.first_dense_layers else "moe")
            for i in range(self.num_layers)
        ]  # fmt: skip

    def rotary(self) -> RotaryEmbedding | None:
        if self.mla_use_nope:
            return None
        return RotaryEmbedding(self.rope, self.qk_rope_head_dim, self.batch_invariant)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "kda_num_heads", "kda_head_dim", "kda_conv_size",
                     "ffn_dim"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.q_lora_rank is not None and self.q_lora_rank < 0:
            raise ConfigError(
                f"model q_lora_rank must be positive, or null (or 0) for a full-rank q_proj; "
                f"got {self.q_lora_rank}."
            )
        layers = self.full_attention_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise ConfigError(
                f"model full_attention_layers must be increasing layer indices in [0, "
                f"{self.num_layers}), got {list(layers)}."
            )
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ConfigError(
                f"model first_dense_layers must be in [0, num_layers={self.num_layers}], got "
                f"{self.first_dense_layers}."
            )
        if not self.mla_use_nope and self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}."
            )
        if self.attn_backend == "flex":
            raise ConfigError(
                "attn_backend 'flex' is not supported by kimi_linear: its KDA layers need the "
                "document ids, which the flex backend replaces by a block mask. Use sdpa."
            )
        super().validate()
        self.moe.validate()
        self.rope.validate()


# -- flavors --------------------------------------------------------------------------------

_KIMI_ROUTING = dict(
    score_func="sigmoid", normalize_top_k=True, route_scale=2.446, expert_bias=True,
    num_shared_experts=1,
)  # fmt: skip

KIMI_LINEAR_FLAVORS: dict[str, KimiLinearConfig] = {
    # 3 KDA layers and 1 MLA layer (Kimi Linear's 3:1), 1 dense + 3 MoE layers of 8 experts
    # with a shared expert and the balancing bias: trains on a CPU in seconds.
    "debug": KimiLinearConfig(
        vocab_size=4096, dim=64, num_layers=4, num_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kda_num_heads=4,
        kda_head_dim=16, full_attention_layers=(3,), ffn_dim=192, first_dense_layers=1,
        max_seq_len=512,
        moe=MoEConfig(num_experts=8, top_k=2, expert_dim=32, bias_update_rate=0.001,
                      **_KIMI_ROUTING),
    ),
    # moonshotai/Kimi-Linear-48B-A3B-{Base,Instruct}: 20 KDA and 7 MLA layers (1-indexed
    # 4, 8, ..., 24 and 27), 256 experts (8 per token) in one group.
    "48B-A3B": KimiLinearConfig(
        vocab_size=163840, dim=2304, num_layers=27, num_heads=32, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        kda_num_heads=32, kda_head_dim=128, kda_conv_size=4,
        full_attention_layers=(3, 7, 11, 15, 19, 23, 26), ffn_dim=9216, first_dense_layers=1,
        max_seq_len=1048576, rope=RopeConfig(theta=10000.0),
        moe=MoEConfig(num_experts=256, top_k=8, expert_dim=1024, **_KIMI_ROUTING),
    ),
}  # fmt: skip
