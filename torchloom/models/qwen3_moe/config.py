"""Qwen3-MoE flavors: debug and the published 30B-A3B and 235B-A22B shapes.

Every layer is an MoE layer: 128 experts, 8 per token, softmax scores renormalised over the
chosen 8, no shared experts. Qwen3 balances the experts with a global-batch balance loss; the
flavors carry the micro-batch form of it ('batch') with transformers' router_aux_loss_coef
(0.001) converted to this loss's scale (x top_k; see models/components/moe.py).
"""

from __future__ import annotations

from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.rope import RopeConfig
from torchloom.models.components.transformer import MoETransformerConfig

_VOCAB = 151936
_CONTEXT = 40960


def _moe(expert_dim: int) -> MoEConfig:
    return MoEConfig(
        num_experts=128, top_k=8, expert_dim=expert_dim, normalize_top_k=True,
        balance_loss="batch", balance_loss_coef=0.008,
    )  # fmt: skip


QWEN3_MOE_FLAVORS: dict[str, MoETransformerConfig] = {
    "debug": MoETransformerConfig(
        vocab_size=4096,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,  # heads * head_dim != dim, as in the released shapes
        ffn_dim=192,
        norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        max_seq_len=512,
        qk_norm=True,
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_dim=32,
            normalize_top_k=True,
            balance_loss="batch",
            balance_loss_coef=0.002,
        ),
    ),
    "30B-A3B": MoETransformerConfig(
        vocab_size=_VOCAB,
        dim=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_dim=6144,
        norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        max_seq_len=_CONTEXT,
        qk_norm=True,
        moe=_moe(768),
    ),
    "235B-A22B": MoETransformerConfig(
        vocab_size=_VOCAB,
        dim=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        ffn_dim=12288,
        norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        max_seq_len=_CONTEXT,
        qk_norm=True,
        moe=_moe(1536),
    ),
}
