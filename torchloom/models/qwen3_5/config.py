"""Qwen3.5 flavors (text decoder): the dense and the MoE models share Qwen3-Next's hybrid
architecture (``Qwen3NextConfig``) with separate DeltaNet projections (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a).

The published shapes are transformers' config defaults: ``Qwen3_5TextConfig`` (its docs call
it "Qwen3.5-9B style") and ``Qwen3_5MoeTextConfig`` (Qwen/Qwen3.5-35B-A3B). Their MRoPE reduces
to plain partial RoPE for text (every position axis holds the token's position).
"""

from __future__ import annotations

from torchloom.models.components.moe import MoEConfig
from torchloom.models.qwen3_next.config import Qwen3NextConfig

_VOCAB = 248320
_SHARED = dict(
    vocab_size=_VOCAB, num_heads=16, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    max_seq_len=262144,
)  # fmt: skip
_DEBUG = dict(
    vocab_size=4096, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, max_seq_len=512,
)  # fmt: skip

QWEN3_5_FLAVORS: dict[str, Qwen3NextConfig] = {
    "debug": Qwen3NextConfig(**_DEBUG, ffn="swiglu", ffn_dim=192),
    "9B": Qwen3NextConfig(
        **_SHARED, dim=4096, num_layers=32, num_kv_heads=4, ffn="swiglu", ffn_dim=12288
    ),
}

QWEN3_5_MOE_FLAVORS: dict[str, Qwen3NextConfig] = {
    "debug": Qwen3NextConfig(
        **_DEBUG,
        moe=MoEConfig(
            num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1, shared_expert_gate=True,
            normalize_top_k=True,
        ),
    ),
    "35B-A3B": Qwen3NextConfig(
        **_SHARED, dim=2048, num_layers=40, num_kv_heads=2,
        moe=MoEConfig(
            num_experts=256, top_k=8, expert_dim=512, num_shared_experts=1,
            shared_expert_gate=True, normalize_top_k=True,
        ),
    ),
}  # fmt: skip
