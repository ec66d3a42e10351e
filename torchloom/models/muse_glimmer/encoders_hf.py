"""The Muse encoders' parts of a MuseGlimmer / MuseSpark ``config.json``: ``vision_config`` and
the projector's top-level keys, ``audio_config``, read with transformers' defaults for what a
file leaves out and every unknown key refused by name; and written back from our configs.

The readers fill the defaults, then hand the complete dict to the encoders' own strict readers
(``muse_vision_config_from_hf``, ``muse_audio_config_from_hf``), which check the values.
"""

from __future__ import annotations

from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.models.components.audio import MuseAudioConfig, muse_audio_config_from_hf
from torchloom.models.components.muse_vision import MuseVisionConfig, muse_vision_config_from_hf
from torchloom.models.hf_adapter import _METADATA_KEYS, refuse_unknown_keys

PROJECTOR_KEYS = ("out_hidden_size", "projector_hidden_size", "projector_hidden_act")
"""Top-level keys of the vision adapter."""
_SUB_CONFIG_KEYS = _METADATA_KEYS | {"model_type", "architectures", "output_attentions"}


def vision_config_to_hf(cfg: MuseVisionConfig, model_type: str) -> dict[str, Any]:
    """``vision_config`` (``model_type``: 'muse_glimmer_vision' or 'muse_spark_vision') and the
    projector's top-level keys, as {"vision_config": ..., key: value, ...}."""
    vision = {
        "model_type": model_type, "patch_size": cfg.patch_size, "patch_temporal": cfg.temporal_patch,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.ffn_dim,
        "pos_emb_height": cfg.pos_grid, "pos_emb_width": cfg.pos_grid,
        "max_position_embeddings": cfg.pos_grid**2, "merge_size": cfg.merge_size,
        "hidden_act": "gelu", "layer_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta},
        "layer_types": [
            "full_attention" if cfg.is_full_attention(i) else "window_attention"
            for i in range(cfg.num_layers)
        ],
        "initializer_range": cfg.init_std,
    }  # fmt: skip
    return {
        "vision_config": vision,
        "out_hidden_size": cfg.dim * cfg.merge_size**2,
        "projector_hidden_size": cfg.adapter_dim,
        "projector_hidden_act": "gelu",
    }


def vision_config_from_hf(
    hf: dict[str, Any], model_type: str, text: dict[str, Any]
) -> MuseVisionConfig:
    """The vision encoder of a config.json (the top level); ``text``: the language model's
    ``hidden_size`` and ``rms_norm_eps`` as read (defaults filled)."""
    defaults = vision_config_to_hf(MuseVisionConfig(), model_type)
    vision = dict(defaults["vision_config"]) | (hf.get("vision_config") or {})
    _refuse_unknown("vision_config", vision, defaults["vision_config"], model_type)
    if "layer_types" not in (hf.get("vision_config") or {}):  # the default for this depth
        vision["layer_types"] = None
    if vision["max_position_embeddings"] != vision["pos_emb_height"] * vision["pos_emb_width"]:
        raise ConfigError(
            f"vision_config.max_position_embeddings {vision['max_position_embeddings']} must be "
            "pos_emb_height * pos_emb_width (the position table's size)."
        )
    full = {key: hf[key] if hf.get(key) is not None else defaults[key] for key in PROJECTOR_KEYS}
    full |= {"vision_config": vision, "text_config": text}
    if vision["layer_types"] is None:
        layers = vision["num_hidden_layers"]
        vision["layer_types"] = vision_config_to_hf(
            MuseVisionConfig(num_layers=layers), model_type
        )["vision_config"]["layer_types"]
    return muse_vision_config_from_hf(full, init_std=vision["initializer_range"])


def audio_config_to_hf(cfg: MuseAudioConfig) -> dict[str, Any]:
    """Muse Spark's ``audio_config``."""
    return {
        "model_type": "muse_spark_audio", "patch_sizes": list(cfg.patch_sizes),
        "hidden_sizes": list(cfg.hidden_sizes), "depths": list(cfg.depths),
        "num_hidden_layers": len(cfg.patch_sizes), "mlp_ratio": cfg.mlp_ratio,
        "conv_kernel_size": cfg.conv_kernel_size, "hidden_act": "gelu",
        "rms_norm_eps": cfg.norm_eps, "out_hidden_size": cfg.text_dim,
        "initializer_range": cfg.init_std,
    }  # fmt: skip


def audio_config_from_hf(hf: dict[str, Any], text: dict[str, Any]) -> MuseAudioConfig:
    """Muse Spark's audio encoder of a config.json (the top level); ``text`` as for
    vision_config_from_hf."""
    given = hf.get("audio_config") or {}
    defaults = audio_config_to_hf(MuseAudioConfig(text_dim=text["hidden_size"]))
    audio = defaults | given
    _refuse_unknown("audio_config", audio, defaults, "muse_spark_audio")
    if audio["num_hidden_layers"] != len(audio["patch_sizes"]):
        raise ConfigError(
            f"audio_config.num_hidden_layers {audio['num_hidden_layers']} must equal the number "
            f"of stages ({len(audio['patch_sizes'])} patch_sizes)."
        )
    full = {"audio_config": audio, "text_config": text}
    return muse_audio_config_from_hf(full, init_std=audio["initializer_range"])


def _refuse_unknown(
    section: str, values: dict[str, Any], known: dict[str, Any], model_type: str
) -> None:
    if values.get("model_type", model_type) != model_type:
        raise ConfigError(f"{section} model_type is {values['model_type']!r}, not {model_type!r}.")
    refuse_unknown_keys(values, [*known, *_SUB_CONFIG_KEYS], f"a Muse {section}")
