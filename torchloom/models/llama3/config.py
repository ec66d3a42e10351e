"""Llama 3 flavors: debug, and the published Llama 3.2 (1B, 3B) and 3.1 (8B, 70B, 405B) shapes."""

from __future__ import annotations

from dataclasses import replace

from torchloom.models.components.rope import RopeConfig
from torchloom.models.components.transformer import TransformerConfig

# Llama 3.1 stretches an 8K pre-training context to 128K; Llama 3.2 uses factor 32.
_LLAMA31_ROPE = RopeConfig(
    theta=500000.0,
    scaling="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_seq_len=8192,
)
_LLAMA32_ROPE = replace(_LLAMA31_ROPE, factor=32.0)
_VOCAB = 128256
_CONTEXT = 131072

LLAMA3_FLAVORS: dict[str, TransformerConfig] = {
    "debug": TransformerConfig(
        vocab_size=4096,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=192,
        rope=RopeConfig(theta=10000.0),
        max_seq_len=512,
    ),
    "1B": TransformerConfig(
        vocab_size=_VOCAB,
        dim=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=8192,
        rope=_LLAMA32_ROPE,
        max_seq_len=_CONTEXT,
        tie_embeddings=True,
    ),
    "3B": TransformerConfig(
        vocab_size=_VOCAB,
        dim=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        ffn_dim=8192,
        rope=_LLAMA32_ROPE,
        max_seq_len=_CONTEXT,
        tie_embeddings=True,
    ),
    "8B": TransformerConfig(
        vocab_size=_VOCAB,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=14336,
        rope=_LLAMA31_ROPE,
        max_seq_len=_CONTEXT,
    ),
    "70B": TransformerConfig(
        vocab_size=_VOCAB,
        dim=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        ffn_dim=28672,
        rope=_LLAMA31_ROPE,
        max_seq_len=_CONTEXT,
    ),
    "405B": TransformerConfig(
        vocab_size=_VOCAB,
        dim=16384,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        ffn_dim=53248,
        rope=_LLAMA31_ROPE,
        max_seq_len=_CONTEXT,
    ),
}
"""All use norm_eps 1e-5 (the TransformerConfig default) and no q/k norm."""
