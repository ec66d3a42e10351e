"""Qwen3 dense <-> transformers' Qwen3ForCausalLM (config.json model_type "qwen3")."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

from torchloom.config.errors import ConfigError
from torchloom.models.components.transformer import TransformerConfig
from torchloom.models.hf_adapter import HFAdapter
from torchloom.models.qwen3.config import LAYER_TYPES, Qwen3Config

# Qwen3Config's defaults for the sliding-window keys.
_SLIDING_WINDOW, _MAX_WINDOW_LAYERS = 4096, 28


def sliding_layers_from_hf(hf: dict[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as transformers' Qwen3Config reads them: the window acts
    only with use_sliding_window, and without layer_types the layers from max_window_layers on
    slide. ((), None) when no layer slides; ConfigError for what transformers cannot run."""
    window = None
    if hf.get("use_sliding_window"):
        window = hf.get("sliding_window", _SLIDING_WINDOW)
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", _MAX_WINDOW_LAYERS)
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    if unknown := sorted(set(types) - set(LAYER_TYPES)):
        raise ConfigError(
            f"layer_types {unknown} are not supported (each layer is one of {list(LAYER_TYPES)})."
        )
    if "sliding_attention" not in types:
        return (), None
    if window is None:
        raise ConfigError(
            "layer_types has sliding_attention layers but use_sliding_window is not true (or "
            "sliding_window is null), so they have no window; set both or make them full_attention."
        )
    return tuple(types), window


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
    family_options = {"use_sliding_window": (False, True)}
    # Read by sliding_layers_from_hf.
    ignored_keys = frozenset({"sliding_window", "max_window_layers", "layer_types"})
    sliding_layers: ClassVar[bool] = True
    """Whether this adapter's family honours sliding_attention layers (the dense text families
    built on Qwen3's keys that do not refuse them)."""

    def config_from_hf(self, hf: dict[str, Any]) -> TransformerConfig:
        dense = super().config_from_hf(hf)
        layer_types, window = sliding_layers_from_hf(hf)
        if not self.sliding_layers:
            if layer_types:
                raise ConfigError(
                    f"layer_types with sliding_attention layers are not supported for "
                    f"{self.model_type} (every layer must be full_attention)."
                )
            return dense
        kept = {f.name: getattr(dense, f.name) for f in fields(TransformerConfig)}
        cfg = Qwen3Config(**kept, layer_types=layer_types, sliding_window=window)
        cfg.validate()
        return cfg

    def config_to_hf(self, cfg: TransformerConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        hf = super().config_to_hf(cfg, *args, **kwargs)
        layer_types = getattr(cfg, "layer_types", ())
        if "sliding_attention" in layer_types:
            hf |= {
                "use_sliding_window": True,
                "sliding_window": cfg.sliding_window,
                "layer_types": list(layer_types),
            }
        return hf
