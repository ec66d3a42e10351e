"""Qwen3 dense <-> transformers' Qwen3ForCausalLM (config.json model_type "qwen3")."""

from __future__ import annotations

from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.models.components.transformer import TransformerConfig
from torchloom.models.hf_adapter import HFAdapter


class Qwen3HFAdapter(HFAdapter):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norm = True
    # Qwen3Config's defaults: unlike Llama, a missing head_dim means 128, not dim / heads.
    defaults = {
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    family_options = {"use_sliding_window": (False,)}
    # sliding_window and max_window_layers only act with use_sliding_window (refused);
    # layer_types is checked below.
    ignored_keys = frozenset({"sliding_window", "max_window_layers", "layer_types"})

    def config_from_hf(self, hf: dict[str, Any]) -> TransformerConfig:
        kinds = set(hf.get("layer_types") or []) - {"full_attention"}
        if kinds:
            raise ConfigError(
                f"layer_types {sorted(kinds)} are not supported (every layer must be "
                "full_attention)."
            )
        return super().config_from_hf(hf)
