"""DeepSeek-V3's architecture (``DeepSeekV3Config``) and its flavors: the debug model and the
published DeepSeek-V2-Lite (16B), DeepSeek-V2 (236B), DeepSeek-V3 (671B) and Kimi-K2 shapes.

Every layer is multi-head latent attention ('mla'); the first ``first_dense_layers`` have a
dense SwiGLU feed-forward and the rest a mixture of experts ('moe'). Optional multi-token
prediction (``mtp_layers``) adds one block per extra predicted token (models/deepseek_v3/
model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import DecoderConfig, LayerSpec
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.rope import RopeConfig, RotaryEmbedding


@dataclass(frozen=True)
class DeepSeekV3Config(DecoderConfig):
    """Architecture of a DeepSeek-V2 / V3 style decoder (one flavor of deepseek_v3)."""

    norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    num_heads: int = 4
    """Attention heads (MLA: every head has its own keys and values, made from the latent)."""
    q_lora_rank: int | None = None
    """Rank of the low-rank query (q_a_proj, q_a_layernorm, q_b_proj); None or 0: one q_proj."""
    kv_lora_rank: int = 32
    """Width of the latent each token's keys and values are made from (what generation caches)."""
    qk_nope_head_dim: int = 16
    """Query/key channels per head without position (from the latent)."""
    qk_rope_head_dim: int = 8
    """Query/key channels per head rotated by RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 16
    """Value channels per head."""
    rope_interleave: bool = True
    """The rotated channels come as interleaved pairs (DeepSeek's checkpoints); False: "rotate
    half" pairs (i, i + d/2)."""
    ffn_dim: int = 192
    """Hidden width of the dense layers' SwiGLU."""
    first_dense_layers: int = 1
    """Layers 0 .. first_dense_layers - 1 have a dense SwiGLU; the rest are MoE layers."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing and experts of the MoE layers (override fields as 'moe.top_k', ...)."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary embedding over qk_rope_head_dim; YaRN's mscale_all_dim also scales the softmax."""
    mtp_layers: int = 0
    """Multi-token prediction depth D: one extra block per additional future token, trained
    with an auxiliary loss (0: none)."""
    mtp_loss_weight: float = 0.3
    """lambda: the MTP loss is lambda / D times the sum over depths of each depth's mean
    cross-entropy (DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1)."""

    @property
    def qk_head_dim(self) -> int:
        """Query/key channels per head: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_norm_eps(self) -> float:
        """Epsilon of MLA's q_a_layernorm and kv_a_layernorm: norm_eps."""
        return self.norm_eps

    def layer_specs(self) -> list[LayerSpec]:
        return [
            LayerSpec("mla", "swiglu" if i < self.first_dense_layers else "moe")
            for i in range(self.num_layers)
        ]

    def rotary(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.rope, self.qk_rope_head_dim, self.batch_invariant)

    def build(self) -> nn.Module:
        from torchloom.models.deepseek_v3.model import DeepSeekV3

        return DeepSeekV3(self)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        super().validate()
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "ffn_dim"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.q_lora_rank is not None and self.q_lora_rank < 0:
            raise ConfigError(
                f"model q_lora_rank must be positive, or null (or 0) for a full-rank q_proj; "
                f"got {self.q_lora_rank}."
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}."
            )
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ConfigError(
                f"model first_dense_layers must be in [0, num_layers={self.num_layers}], got "
                f"{self.first_dense_layers}."
            )
        if self.mtp_layers < 0 or self.mtp_loss_weight < 0:
            raise ConfigError(
                "model mtp_layers and mtp_loss_weight must be >= 0, got "
                f"{self.mtp_layers} and {self.mtp_loss_weight}."
            )
        self.moe.validate()
        self.rope.validate()


# -- flavors --------------------------------------------------------------------------------


def _yarn(mscale: float, factor: float = 40.0, theta: float = 10000.0, **kw: float) -> RopeConfig:
    """DeepSeek's YaRN from a 4K pre-training context (mscale = mscale_all_dim)."""
    return RopeConfig(
        theta=theta, scaling="yarn", factor=factor, original_max_seq_len=4096, mscale=mscale,
        mscale_all_dim=mscale, **kw,
    )  # fmt: skip


_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Config] = {
    # 1 dense + 2 MoE layers, low-rank q, 2 groups of 4 experts, a shared expert, sigmoid
    # scores with the balancing bias, one MTP depth: trains on a CPU in seconds.
    "debug": DeepSeekV3Config(
        vocab_size=4096, dim=64, num_layers=3, num_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_dim=192,
        first_dense_layers=1, max_seq_len=512,
        moe=MoEConfig(
            num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1, score_func="sigmoid",
            num_groups=2, top_groups=1, normalize_top_k=True, route_scale=2.5,
            expert_bias=True, bias_update_rate=0.001,
        ),
        mtp_layers=1,
    ),
    # DeepSeek-V2-Lite: full-rank q, softmax routing, sequence-wise balance loss 0.001.
    "16B": DeepSeekV3Config(
        vocab_size=102400, dim=2048, num_layers=27, num_heads=16, q_lora_rank=None, **_MLA,
        ffn_dim=10944, first_dense_layers=1, max_seq_len=163840, rope=_yarn(0.707),
        moe=MoEConfig(
            num_experts=64, top_k=6, expert_dim=1408, num_shared_experts=2,
            balance_loss="sequence", balance_loss_coef=0.001,
        ),
    ),
    # DeepSeek-V2: 8 groups of 20 experts, 3 groups per token, routed output x16. (Its device-
    # and communication-level balance losses are not modelled.)
    "236B": DeepSeekV3Config(
        vocab_size=102400, dim=5120, num_layers=60, num_heads=128, q_lora_rank=1536, **_MLA,
        ffn_dim=12288, first_dense_layers=1, max_seq_len=163840, rope=_yarn(0.707),
        moe=MoEConfig(
            num_experts=160, top_k=6, expert_dim=1536, num_shared_experts=2, num_groups=8,
            top_groups=3, route_scale=16.0, balance_loss="sequence", balance_loss_coef=0.003,
        ),
    ),
    # DeepSeek-V3: sigmoid scores, auxiliary-loss-free balancing (bias rate 0.001) plus a
    # 0.0001 sequence-wise loss, 8 groups of 32 experts (4 per token), one MTP depth.
    "671B": DeepSeekV3Config(
        vocab_size=129280, dim=7168, num_layers=61, num_heads=128, q_lora_rank=1536, **_MLA,
        ffn_dim=18432, first_dense_layers=3, max_seq_len=163840, rope=_yarn(1.0),
        moe=MoEConfig(
            num_experts=256, top_k=8, expert_dim=2048, num_shared_experts=1,
            score_func="sigmoid", num_groups=8, top_groups=4, normalize_top_k=True,
            route_scale=2.5, expert_bias=True, bias_update_rate=0.001,
            balance_loss="sequence", balance_loss_coef=0.0001,
        ),
        mtp_layers=1,
    ),
    # Kimi-K2 (moonshotai/Kimi-K2-Instruct): DeepSeek-V3's layout with 64 heads, 384 experts
    # in one group, one dense layer and no MTP.
    "kimi-k2": DeepSeekV3Config(
        vocab_size=163840, dim=7168, num_layers=61, num_heads=64, q_lora_rank=1536, **_MLA,
        ffn_dim=18432, first_dense_layers=1, max_seq_len=131072,
        rope=_yarn(1.0, factor=32.0, theta=50000.0, beta_fast=1.0, beta_slow=1.0),
        moe=MoEConfig(
            num_experts=384, top_k=8, expert_dim=2048, num_shared_experts=1,
            score_func="sigmoid", normalize_top_k=True, route_scale=2.827, expert_bias=True,
        ),
    ),
}  # fmt: skip
