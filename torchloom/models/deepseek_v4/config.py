"""DeepSeek-V4's architecture (``DeepSeekV4Config``) and its flavors: the debug model and the
published DeepSeek-V4-Flash (284B, 13B active) and DeepSeek-V4-Pro (1.6T, 49B active) shapes.

Each layer's attention is one of three kinds (models/components/compressed_attention.py):
sliding-window attention, compressed sparse attention (groups of ``csa_ratio`` tokens, top-k
picked by a lightning indexer) or heavily compressed attention (groups of ``hca_ratio``). The
residual stream is ``hc_streams`` copies wide (hyper-connections, components/
hyper_connections.py); every feed-forward is an MoE, hash-routed in the first ``hash_layers``.
Optional multi-token prediction (``mtp_layers``) adds one sliding-window block per extra
predicted token (models/deepseek_v4/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.compressed_attention import ATTENTION_KINDS, CSA, HCA, SLIDING
from torchloom.models.components.decoder import DecoderConfig, LayerSpec
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.rope import RopeConfig

SPARSE_ATTENTION = ("auto", "dense", "gather", "triton")


@dataclass(frozen=True)
class DeepSeekV4Config(DecoderConfig):
    """Architecture of a DeepSeek-V4 decoder (one flavor of deepseek_v4)."""

    norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm (also the unweighted ones of the queries and mixings)."""
    num_heads: int = 4
    """Query heads; one key-value head is shared by all of them."""
    head_dim: int = 32
    """Channels per head (queries, the shared key = value, compressed keys)."""
    rope_dim: int = 8
    """Trailing channels of each head that RoPE rotates (interleaved pairs)."""
    q_lora_rank: int = 32
    """Rank of the low-rank query (q_a_proj, q_a_norm, q_b_proj); the indexer reads it too."""
    o_groups: int = 2
    """Head groups of the grouped output projection."""
    o_lora_rank: int = 16
    """Width each head group is projected to before o_b_proj mixes them."""
    sliding_window: int = 128
    """Tokens of the window every layer attends over (the query and window - 1 before it)."""
    csa_ratio: int = 4
    """Tokens per compressed group in compressed sparse attention layers."""
    hca_ratio: int = 128
    """Tokens per compressed group in heavily compressed attention layers."""
    index_heads: int = 4
    """Lightning indexer query heads."""
    index_head_dim: int = 16
    """Lightning indexer channels per head (its own compressed keys too)."""
    index_topk: int = 4
    """Compressed groups each CSA query attends to, picked by the indexer."""
    attention_kinds: tuple[str, ...] = ()
    """One of sliding_attention, compressed_sparse_attention, heavily_compressed_attention per
    layer; empty: transformers' default schedule (two HCA layers, then HCA and CSA alternating)."""
    indexer_loss_weight: float = 0.0
    """Weight of the lightning indexers' training loss (KL from the attention's distribution
    over the picked groups to the indexer's, DeepSeek-V3.2's; reported as ``aux_indexer``). The
    indexer reads detached inputs, so only this loss trains it; 0: the indexers do not learn."""
    sparse_attention: str = "auto"
    """How a forward without generation cache attends (kernels/sparse_attention.py): "dense"
    (the masked softmax over all T + S keys: the reference, O(T^2)), "gather" (each query's
    window and groups gathered in PyTorch), "triton" (the fused kernels, CUDA), "auto" (triton
    on CUDA, else dense). Training with indexer_loss_weight > 0 runs dense in CSA layers: the
    indexer's loss reads the attention's probabilities over every group."""
    hash_layers: int = 3
    """The first hash_layers MoE layers choose experts by a fixed token -> experts table."""
    hc_streams: int = 4
    """Copies of the hidden state in the residual stream (hyper-connections' n_hc)."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations that make each comb mixing doubly stochastic."""
    hc_eps: float = 1e-6
    """Floor added to the mixings and the Sinkhorn normalisations."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Routing and experts of every layer (hash layers use it with hash_routing)."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """RoPE of the sliding-window layers ("main")."""
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0))
    """RoPE of the compressed layers ("compress"): their queries, window keys and groups."""
    mtp_layers: int = 0
    """Multi-token prediction depth D: one extra sliding-window block per additional future
    token, trained with an auxiliary loss (0: none; the published checkpoints have 1)."""
    mtp_loss_weight: float = 0.3
    """lambda: the MTP loss is lambda / D times the sum over depths of each depth's mean
    cross-entropy. DeepSeek has not published V4's; the default is DeepSeek-V3's 0.3 (its
    first 10T tokens), an assumption."""

    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind."""
        if self.attention_kinds:
            return self.attention_kinds
        n = self.num_layers
        rest = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        return tuple(([HCA] * min(n, 2) + rest)[:n])

    def layer_specs(self) -> list[LayerSpec]:
        return [
            LayerSpec(kind, "hash_moe" if i < self.hash_layers else "moe")
            for i, kind in enumerate(self.kinds())
        ]

    def layer_kinds(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return dict.fromkeys(ATTENTION_KINDS), dict.fromkeys(("moe", "hash_moe"))

    def moe_of(self, layer: int) -> MoEConfig:
        """The MoE of layer ``layer``: hash-routed (no choice bias) in the first hash_layers."""
        if layer >= self.hash_layers:
            return self.moe
        return replace(self.moe, hash_routing=True, expert_bias=False, bias_update_rate=0.0)

    def rope_of(self, kind: str) -> RopeConfig:
        return self.rope if kind == SLIDING else self.compress_rope

    def build(self) -> nn.Module:
        from torchloom.models.deepseek_v4.model import DeepSeekV4

        return DeepSeekV4(self)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        super().validate()
        for name in ("num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "sliding_window", "csa_ratio", "hca_ratio", "index_heads",
                     "index_head_dim", "index_topk", "hc_streams", "hc_sinkhorn_iters"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.indexer_loss_weight < 0:
            raise ConfigError(
                f"model indexer_loss_weight must be >= 0, got {self.indexer_loss_weight}."
            )
        if self.sparse_attention not in SPARSE_ATTENTION:
            raise ConfigError(f"model sparse_attention must be one of {', '.join(SPARSE_ATTENTION)}; got {self.sparse_attention!r}.")  # fmt: skip
        if self.batch_invariant:
            raise ConfigError(
                "deepseek_v4 has no batch-invariant attention yet (its compressed and sparse "
                "attention runs a dense PyTorch reference); set --model.batch_invariant false."
            )
        if self.attn_backend != "sdpa":
            raise ConfigError(
                f"deepseek_v4's attention (sliding window, compressed and sparse keys, sinks) runs "
                f"its own kernels, so attn_backend {self.attn_backend!r} would not be used; leave "
                "--model.attn_backend at sdpa."
            )
        if self.rope_dim % 2 or self.rope_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError(
                f"model rope_dim ({self.rope_dim}) must be even and at most head_dim "
                f"({self.head_dim}) and index_head_dim ({self.index_head_dim})."
            )
        if self.num_heads % self.o_groups:
            raise ConfigError(
                f"model o_groups ({self.o_groups}) must divide num_heads ({self.num_heads})."
            )
        if self.attention_kinds and len(self.attention_kinds) != self.num_layers:
            raise ConfigError(
                f"model attention_kinds has {len(self.attention_kinds)} entries for num_layers "
                f"{self.num_layers}; give one per layer (or none for the default schedule)."
            )
        if self.mtp_layers < 0 or self.mtp_loss_weight < 0:
            raise ConfigError(
                "model mtp_layers and mtp_loss_weight must be >= 0, got "
                f"{self.mtp_layers} and {self.mtp_loss_weight}."
            )
        if not 0 <= self.hash_layers <= self.num_layers:
            raise ConfigError(
                f"model hash_layers must be in [0, num_layers={self.num_layers}], got "
                f"{self.hash_layers}."
            )
        self.moe.validate()
        if self.moe.num_groups != 1 or self.moe.num_shared_experts != 1:
            raise ConfigError(
                "model moe: DeepSeek-V4 routes without expert groups and has one shared expert; "
                "set moe.num_groups 1 and moe.num_shared_experts 1."
            )
        self.rope.validate()
        self.compress_rope.validate()


# -- flavors --------------------------------------------------------------------------------


def _moe(experts: int, expert_dim: int, route_scale: float, **kw: Any) -> MoEConfig:
    """DeepSeek-V4's routing: sqrt(softplus) scores, normalised top-6, a choice bias, one
    shared expert, SwiGLU inputs clamped at 10."""
    return MoEConfig(
        num_experts=experts, top_k=6, expert_dim=expert_dim, num_shared_experts=1,
        score_func="sqrtsoftplus", normalize_top_k=True, route_scale=route_scale,
        expert_bias=True, swiglu_limit=10.0, **kw,
    )  # fmt: skip


# The published checkpoints' compressed layers use YaRN x16 from a 64K context with cos/sin
# unscaled (transformers forces attention_factor 1.0: configuration_deepseek_v4.py).
_COMPRESS_YARN = RopeConfig(
    theta=160000.0, scaling="yarn", factor=16.0, original_max_seq_len=65536, attention_factor=1.0
)
# DeepSeek-V4-Flash's schedule: two sliding layers, then CSA and HCA alternating (compress_ratios
# [0, 0, 4, 128, 4, ...] of deepseek-ai/DeepSeek-V4-Flash's config.json).
_FLASH_KINDS = (SLIDING, SLIDING, *(CSA if i % 2 == 0 else HCA for i in range(41)))

DEEPSEEK_V4_FLAVORS: dict[str, DeepSeekV4Config] = {
    # One layer of each kind (hash-routed first), 8 experts, sequences long enough that groups
    # of 4 and of 16 complete and the indexer picks 4 of many: trains on a CPU in seconds.
    "debug": DeepSeekV4Config(
        vocab_size=4096, dim=64, num_layers=3, num_heads=4, head_dim=32, rope_dim=8,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=16, csa_ratio=4,
        hca_ratio=16, index_heads=2, index_head_dim=16, index_topk=4,
        attention_kinds=(SLIDING, CSA, HCA), hash_layers=1, max_seq_len=512,
        moe=_moe(8, 32, 1.5, bias_update_rate=0.001),
    ),
    # DeepSeek-V4-Flash (284B, 13B active): transformers' DeepseekV4Config defaults (its
    # docstring checkpoint is deepseek-ai/DeepSeek-V4-Flash-Base), which the published
    # config.json repeats: 43 layers, 64 heads of 512, q rank 1024, 8 output groups of 1024,
    # 256 experts of 2048 (6 per token, scale 1.5), indexer 64 x 128 picking 512, 3 hash layers,
    # one MTP depth (num_nextn_predict_layers 1).
    "flash": DeepSeekV4Config(
        vocab_size=129280, dim=4096, num_layers=43, num_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, csa_ratio=4,
        hca_ratio=128, index_heads=64, index_head_dim=128, index_topk=512,
        attention_kinds=_FLASH_KINDS, hash_layers=3, max_seq_len=1048576,
        moe=_moe(256, 2048, 1.5), compress_rope=_COMPRESS_YARN, mtp_layers=1,
    ),
    # DeepSeek-V4-Pro (1.6T, 49B active), from its published config.json: 61 layers, hidden
    # 7168, 128 heads, q rank 1536, 16 output groups, 384 experts of 3072 (scale 2.5), indexer
    # top-512, one MTP depth; the attention schedule is transformers' default (two HCA layers,
    # then HCA and CSA alternating), which its docstring calls the V4-Pro default.
    "pro": DeepSeekV4Config(
        vocab_size=129280, dim=7168, num_layers=61, num_heads=128, head_dim=512, rope_dim=64,
        q_lora_rank=1536, o_groups=16, o_lora_rank=1024, sliding_window=128, csa_ratio=4,
        hca_ratio=128, index_heads=64, index_head_dim=128, index_topk=512, hash_layers=3,
        max_seq_len=1048576, moe=_moe(384, 3072, 2.5), compress_rope=_COMPRESS_YARN,
        mtp_layers=1,
    ),
}  # fmt: skip
