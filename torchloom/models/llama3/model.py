"""Llama 3 (Meta, 2024): pre-norm RMSNorm, GQA attention with RoPE, SwiGLU MLP."""

from __future__ import annotations

from torchloom.models.components.transformer import Transformer


class Llama3(Transformer):
    """The generic Transformer as Llama 3 uses it: no q/k norm, Llama 3.1 RoPE scaling."""
