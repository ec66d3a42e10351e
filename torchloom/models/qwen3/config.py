"""Qwen3 dense flavors: debug and the published 0.6B ... 32B shapes."""

from __future__ import annotations

from torchloom.models.components.rope import RopeConfig
from torchloom.models.components.transformer import TransformerConfig

_ROPE = RopeConfig(theta=1000000.0)
_VOCAB = 151936
_CONTEXT = 40960


def _qwen3(
    dim: int, num_layers: int, num_heads: int, ffn_dim: int, tie_embeddings: bool
) -> TransformerConfig:
    """A released Qwen3 dense shape; they all share vocab, context, 8 kv heads of 128."""
    return TransformerConfig(
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


QWEN3_FLAVORS: dict[str, TransformerConfig] = {
    "debug": TransformerConfig(
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
