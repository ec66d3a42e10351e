"""Qwen3 dense (Qwen team, 2025): Llama-style blocks plus RMSNorm on every q and k head."""

from __future__ import annotations

from torchloom.models.components.transformer import Transformer


class Qwen3(Transformer):
    """The generic Transformer with ``qk_norm`` and a head_dim chosen independently of dim."""
