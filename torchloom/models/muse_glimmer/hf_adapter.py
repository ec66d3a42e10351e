"""Muse Glimmer <-> transformers' MuseGlimmerForConditionalGeneration (model_type
"muse_glimmer"); Muse Spark's adapter (models/muse_spark/) extends it.

The language model is ``text_config`` and ``model.language_model.*`` (+ ``lm_head``); the
vision encoder is ``vision_config`` with the projector's top-level keys and the placeholder ids
(models/muse_glimmer/encoders_hf.py), its tensors ``model.vision_tower.*``,
``model.vision_adapter.*`` and ``model.vision_projection.*``, our ``vision_tower.*``
(muse_vision_hf_name). Every key is mapped, checked against the one value we support, or
refused by name. Text tensor names are transformers' under torchloom's block slots:
input_layernorm -> attention_norm, post_attention_layernorm -> attention_post_norm,
pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm -> mlp_post_norm,
self_attn -> attention.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torchloom.config.errors import ConfigError
from torchloom.models.components.muse_vision import muse_vision_hf_name
from torchloom.models.hf_adapter import (
    _METADATA_KEYS,
    HFAdapter,
    RowSlice,
    refuse_unknown_keys,
    rope_from_hf,
)
from torchloom.models.muse_glimmer.config import MuseGlimmerConfig, default_layer_types
from torchloom.models.muse_glimmer.encoders_hf import (
    PROJECTOR_KEYS,
    vision_config_from_hf,
    vision_config_to_hf,
)

_LM = "model.language_model."
_VISION = "vision_tower."
_HF_VISION = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
# text_config key -> our field, for the sizes and plain numbers.
_TEXT_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim", "intermediate_size": "ffn_dim", "rms_norm_eps": "norm_eps",
    "post_norm_eps": "post_norm_eps", "max_position_embeddings": "max_seq_len",
    "sliding_window": "sliding_window", "qk_scale_factor": "qk_scale",
    "output_multiplier": "logit_scale", "final_logit_softcapping": "logit_cap",
}  # fmt: skip
_TEXT_READ = frozenset(_TEXT_FIELDS) | {
    "model_type", "architectures", "rope_parameters", "layer_types", "layer_rope_theta",
    "tie_word_embeddings",
}  # fmt: skip
_BLOCK_TO_HF = {
    "attention_norm": "input_layernorm", "attention_post_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm",
    "attention": "self_attn",
}  # fmt: skip


class MuseGlimmerHFAdapter(HFAdapter):
    model_type = "muse_glimmer"
    architecture = "MuseGlimmerForConditionalGeneration"
    text_model_type: ClassVar[str] = "muse_glimmer_text"
    config_cls: ClassVar[type[MuseGlimmerConfig]] = MuseGlimmerConfig
    defaults = {
        "vocab_size": 202048, "hidden_size": 6656, "intermediate_size": 19968,
        "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "sliding_window": 2048, "final_logit_softcapping": 20.0, "qk_scale_factor": 3.87,
        "output_multiplier": 0.19611613513818404, "post_norm_eps": 1e-8,
        "tie_word_embeddings": False,
    }  # fmt: skip
    text_options: ClassVar[dict[str, tuple[Any, ...]]] = {
        "attention_bias": (False,), "attention_dropout": (0.0,),
        "hidden_activation": ("silu", "swish"),
    }  # fmt: skip
    """text_config options and the values we support (the first is written on export)."""
    block_to_hf: ClassVar[dict[str, str]] = _BLOCK_TO_HF
    hf_encoder_prefixes: ClassVar[tuple[str, ...]] = _HF_VISION
    token_ids: ClassVar[dict[str, int]] = {"image_token_id": 200092, "video_token_id": 200091}
    """The placeholder ids (top-level keys, our fields' names) and transformers' defaults."""
    encoder_keys: ClassVar[frozenset[str]] = frozenset({"vision_config", *PROJECTOR_KEYS})
    """Top-level keys the encoders read (besides token_ids)."""

    # -- config ---------------------------------------------------------------------------

    def config_from_hf(self, hf: dict[str, Any]) -> MuseGlimmerConfig:
        """The config of a multimodal config.json's language model; ConfigError for what we
        cannot run."""
        self._check_top(hf)
        text = hf.get("text_config") or {}
        self._check_text_keys(text)

        def get(key: str) -> Any:
            value = text.get(key)
            return self.defaults.get(key) if value is None else value

        layers = get("num_hidden_layers")
        fields = {ours: get(key) for key, ours in _TEXT_FIELDS.items()}
        rope = rope_from_hf(
            {"rope_parameters": text.get("rope_parameters")}, get("max_position_embeddings")
        )
        layer_types = tuple(text.get("layer_types") or default_layer_types(layers))
        thetas = text.get("layer_rope_theta")
        if thetas is None:
            rope_layers = tuple(t == "sliding_attention" for t in layer_types)
        else:
            off_theta = [t for t in thetas if t and float(t) != rope.theta]
            if off_theta:
                raise ConfigError(
                    f"layer_rope_theta {thetas} sets a RoPE theta other than rope_theta "
                    f"({rope.theta}); transformers rotates every RoPE layer with rope_theta and "
                    "torchloom does likewise, so it refuses a per-layer theta it would ignore."
                )
            rope_layers = tuple(bool(t) for t in thetas)
        default_rope = tuple(t == "sliding_attention" for t in layer_types)
        text_width = {"hidden_size": fields["dim"], "rms_norm_eps": fields["norm_eps"]}
        cfg = self.config_cls(
            **fields,
            rope=rope,
            layer_types=() if layer_types == default_layer_types(layers) else layer_types,
            rope_layers=() if rope_layers == default_rope else rope_layers,
            tie_embeddings=bool(get("tie_word_embeddings")),
            **self._family_fields(get),
            **self._encoder_fields(hf, text_width),
            **{key: hf.get(key, default) for key, default in self.token_ids.items()},
        )
        cfg.validate()
        return cfg

    def _family_fields(self, get: Any) -> dict[str, Any]:
        """Fields a subclass reads from text_config besides Glimmer's."""
        return {}

    def _encoder_fields(self, hf: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
        """The encoders' configs (``text``: the language model's hidden_size, rms_norm_eps)."""
        return {"vision": vision_config_from_hf(hf, self.model_type + "_vision", text)}

    def _encoders_to_hf(self, cfg: Any) -> dict[str, Any]:
        return vision_config_to_hf(cfg.vision, self.model_type + "_vision")

    def _check_top(self, hf: dict[str, Any]) -> None:
        if hf.get("model_type") != self.model_type:
            raise ConfigError(f"model_type is {hf.get('model_type')!r}, not {self.model_type!r}.")
        architectures = hf.get("architectures")
        if architectures and list(architectures) != [self.architecture]:
            raise ConfigError(
                f"architectures {architectures} is not supported; torchloom reads the language "
                f"model of {self.architecture} checkpoints."
            )
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError(f"a {self.model_type!r} config.json needs a text_config.")
        known = {*self.encoder_keys, *self.token_ids, "model_type", "architectures",
                 "text_config", "tie_word_embeddings"}  # fmt: skip
        refuse_unknown_keys(hf, known, f"a {self.model_type} config")
        if "tie_word_embeddings" in hf and hf["tie_word_embeddings"] != hf["text_config"].get(
            "tie_word_embeddings", False
        ):
            raise ConfigError("tie_word_embeddings differs between the config and text_config.")

    def _check_text_keys(self, text: dict[str, Any]) -> None:
        if text.get("model_type", self.text_model_type) != self.text_model_type:
            raise ConfigError(
                f"text_config model_type is {text.get('model_type')!r}, not "
                f"{self.text_model_type!r}."
            )
        options = self.text_options | {"quantization_config": (None,)}
        for key, value in text.items():
            if key in options:
                if value is not None and value not in options[key]:
                    allowed = " or ".join(repr(v) for v in options[key])
                    raise ConfigError(
                        f"text_config {key}={value!r} is not supported (torchloom reads "
                        f"{self.model_type} checkpoints with {key}={allowed} only)."
                    )
            elif key not in _TEXT_READ | _METADATA_KEYS | self.ignored_keys:
                raise ConfigError(
                    f"unknown text_config option {key}={value!r}. torchloom does not know what "
                    f"it changes in a {self.model_type} model, so it refuses rather than "
                    "ignores it."
                )

    def config_to_hf(
        self,
        cfg: Any,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """A multimodal config.json: ``cfg``'s text_config, its encoders' configs and the
        placeholder ids."""
        if not isinstance(cfg, self.config_cls):
            raise ConfigError(f"a {type(cfg).__name__} cannot be exported as {self.model_type}.")
        text = {ours_key: getattr(cfg, ours) for ours_key, ours in _TEXT_FIELDS.items()}
        text |= {
            "model_type": self.text_model_type,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta},
            "layer_types": list(cfg.resolved_layer_types()),
            "layer_rope_theta": [cfg.rope.theta if r else 0 for r in cfg.resolved_rope_layers()],
            "tie_word_embeddings": cfg.tie_embeddings,
            **{key: values[0] for key, values in self.text_options.items()},
            **self._family_to_hf(cfg),
        }
        if cfg.rope.scaling != "none":
            raise ConfigError(f"{self.model_type} checkpoints have no RoPE scaling to export.")
        if bos_token_id is not None:
            text["bos_token_id"] = bos_token_id
        if eos_token_id is not None:
            text["eos_token_id"] = eos_token_id
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "text_config": text,
            **self._encoders_to_hf(cfg),
            **{key: getattr(cfg, key) for key in self.token_ids},
        }
        if dtype is not None:
            hf["dtype"] = dtype
        return hf

    def _family_to_hf(self, cfg: Any) -> dict[str, Any]:
        return {}

    # -- tensor names ---------------------------------------------------------------------

    def hf_names(self, name: str, config: Any) -> str | list[str] | RowSlice:
        return self.to_hf_name(name)

    def to_hf_name(self, name: str) -> str:
        if name.startswith(_VISION):
            return muse_vision_hf_name(name.removeprefix(_VISION))
        if name.startswith("output."):
            return "lm_head." + name.removeprefix("output.")
        parts = name.split(".")
        if parts[0] == "layers":
            parts[2] = self.block_to_hf.get(parts[2], parts[2])
            name = ".".join(parts)
        return _LM + self._in_layer_to_hf(name)

    def _in_layer_to_hf(self, name: str) -> str:
        """A subclass's renames inside a layer (after the block's slots)."""
        return name

    def from_hf_name(self, hf_name: str) -> str | None:
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name.startswith(self.hf_encoder_prefixes):
            return hf_name  # an encoder tensor our names did not claim: a model mismatch
        if hf_name.startswith("lm_head."):
            return "output." + hf_name.removeprefix("lm_head.")
        if not hf_name.startswith(_LM):
            raise ConfigError(
                f"Unexpected tensor '{hf_name}' in a {self.architecture} checkpoint (expected "
                f"names under {_LM}, lm_head. or the encoders')."
            )
        name = self._in_layer_from_hf(hf_name.removeprefix(_LM))
        parts = name.split(".")
        if parts[0] == "layers":
            from_hf = {hf: ours for ours, hf in self.block_to_hf.items()}
            parts[2] = from_hf.get(parts[2], parts[2])
        return ".".join(parts)

    def _in_layer_from_hf(self, name: str) -> str:
        return name
