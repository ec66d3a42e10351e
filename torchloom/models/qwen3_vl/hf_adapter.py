"""Qwen3-VL <-> transformers' Qwen3VLForConditionalGeneration (model_type "qwen3_vl") and
Qwen3VLMoeForConditionalGeneration ("qwen3_vl_moe").

The config.json nests a ``text_config`` (a Qwen3 or Qwen3-MoE decoder, read by those families'
rules, with M-RoPE's ``mrope_section`` in its rope parameters) and a ``vision_config``. Tensors:
``model.visual.*`` is our ``visual.*`` name for name; ``model.language_model.*`` is the decoder.
The MoE checkpoints keep each layer's experts fused: ``gate_up_proj`` ``[E, 2I, D]`` (gate rows
first) and ``down_proj`` ``[E, D, I]``, or both transposed in the released files
(FusedExperts); export writes transformers' untransposed layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import Any

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.vision import VisionConfig
from torchloom.models.hf_adapter import (
    FusedExperts,
    HFAdapter,
    RowSlice,
    refuse_unknown_keys,
)
from torchloom.models.qwen3.hf_adapter import Qwen3HFAdapter
from torchloom.models.qwen3_moe.hf_adapter import Qwen3MoeHFAdapter
from torchloom.models.qwen3_vl.config import Qwen3VLConfig


class _DenseText(Qwen3HFAdapter):
    """Qwen3VLTextConfig: Qwen3's keys and meanings, its own defaults."""

    model_type = "qwen3_vl_text"
    architecture = "Qwen3VLTextModel"
    defaults = {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 128000,
                "tie_word_embeddings": False}  # fmt: skip
    family_options = {}
    sliding_layers = False


class _MoeText(Qwen3MoeHFAdapter):
    """Qwen3VLMoeTextConfig: Qwen3-MoE's keys, always renormalised top-k, its own defaults."""

    model_type = "qwen3_vl_moe_text"
    architecture = "Qwen3VLMoeTextModel"
    defaults = Qwen3MoeHFAdapter.defaults | {
        "max_position_embeddings": 128000, "moe_intermediate_size": 1408,
        "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": True,
    }  # fmt: skip
    family_options = {}


_TEXT = {False: _DenseText(), True: _MoeText()}
_MRoPE_KEYS = ("mrope_section", "mrope_interleaved")
_TOP_KEYS = frozenset({
    "model_type", "architectures", "text_config", "vision_config", "image_token_id",
    "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings",
    "hidden_size",
})  # fmt: skip
# Qwen3VLVisionConfig's keys and defaults (model_type, initializer_range: read by nobody).
_VISION_DEFAULTS = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
    "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24], "rope_parameters": None,
}  # fmt: skip
_VISION_TYPES = ("qwen3_vl_vision", "qwen3_vl", "qwen3_vl_moe_vision", "qwen3_vl_moe")
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")
_TEXT_PREFIX = "model.language_model."


class Qwen3VLHFAdapter(HFAdapter):
    model_type = "qwen3_vl"
    architecture = "Qwen3VLForConditionalGeneration"
    reads_also = ("qwen3_vl_moe",)
    qk_norm = True
    defaults = {"head_dim": 128}
    _ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
                      "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}  # fmt: skip

    # -- config.json ------------------------------------------------------------------------

    def config_from_hf(self, hf: dict[str, Any]) -> Qwen3VLConfig:
        model_type = hf.get("model_type")
        if model_type not in self._ARCHITECTURES:
            raise ConfigError(f"model_type is {model_type!r}, not 'qwen3_vl' or 'qwen3_vl_moe'.")
        architecture = self._ARCHITECTURES[model_type]
        if hf.get("architectures") and list(hf["architectures"]) != [architecture]:
            raise ConfigError(
                f"architectures {hf['architectures']} is not supported; torchloom reads "
                f"{architecture} checkpoints for model_type {model_type!r}."
            )
        refuse_unknown_keys(hf, _TOP_KEYS | {"use_cache"}, f"a {model_type} config")
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError(f"a {model_type!r} config.json needs a text_config.")
        moe = model_type == "qwen3_vl_moe"
        text, mrope_section = _text_config(hf["text_config"], _TEXT[moe].model_type, moe)
        text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
        decoder = _TEXT[moe].config_from_hf(text)
        if hf.get("hidden_size") not in (None, decoder.dim):
            raise ConfigError(
                f"hidden_size={hf['hidden_size']} differs from text_config's {decoder.dim}."
            )
        cfg = Qwen3VLConfig(
            **{f.name: getattr(decoder, f.name) for f in fields(decoder)},
            **({} if moe else {"first_dense_layers": decoder.num_layers}),
            vision=_vision_from_hf(hf.get("vision_config") or {}, decoder.dim),
            mrope_section=mrope_section,
            **{key: int(hf.get(key, default)) for key, default in _TOKEN_DEFAULTS.items()},
        )
        cfg.validate()
        return cfg

    def config_to_hf(
        self,
        cfg: Qwen3VLConfig,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        text_adapter = _TEXT[cfg.is_moe]
        text = text_adapter.config_to_hf(cfg, dtype, bos_token_id, eos_token_id)
        for key in ("architectures", "rope_theta", "rope_scaling", "use_sliding_window",
                    "norm_topk_prob"):  # fmt: skip
            text.pop(key, None)
        text["model_type"] = text_adapter.model_type
        text["rope_parameters"] |= {"mrope_section": list(cfg.mrope_section),
                                    "mrope_interleaved": True}  # fmt: skip
        model_type = "qwen3_vl_moe" if cfg.is_moe else "qwen3_vl"
        vision = cfg.vision
        hf: dict[str, Any] = {
            "architectures": [self._ARCHITECTURES[model_type]],
            "model_type": model_type,
            "text_config": text,
            "vision_config": {
                "model_type": f"{model_type}_vision", "depth": vision.depth,
                "hidden_size": vision.dim, "hidden_act": "gelu_pytorch_tanh",
                "intermediate_size": vision.ffn_dim, "num_heads": vision.num_heads,
                "in_channels": vision.in_channels, "patch_size": vision.patch_size,
                "spatial_merge_size": vision.spatial_merge_size,
                "temporal_patch_size": vision.temporal_patch_size, "out_hidden_size": cfg.dim,
                "num_position_embeddings": vision.num_position_embeddings,
                "deepstack_visual_indexes": list(vision.deepstack_layers),
                "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
            },
            **{key: getattr(cfg, key) for key in _TOKEN_DEFAULTS},
            "tie_word_embeddings": cfg.tie_embeddings,
        }  # fmt: skip
        if dtype is not None:
            hf["dtype"] = hf["torch_dtype"] = dtype
        return hf

    # -- tensor names -----------------------------------------------------------------------

    def to_hf_name(self, name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        hf_name = super().to_hf_name(name)
        return (
            _TEXT_PREFIX + hf_name.removeprefix("model.")
            if hf_name.startswith("model.")
            else hf_name
        )

    def from_hf_name(self, hf_name: str) -> str | None:
        if hf_name.startswith("model.visual."):
            return hf_name.removeprefix("model.")
        if hf_name.startswith(_TEXT_PREFIX):
            hf_name = "model." + hf_name.removeprefix(_TEXT_PREFIX)
        return super().from_hf_name(hf_name)

    def hf_names(self, name: str, config: Any) -> str | list[str] | RowSlice | FusedExperts:
        match = _OUR_EXPERTS.fullmatch(name)
        if match is None:
            return self.to_hf_name(name)
        layer, proj = match.groups()
        prefix = f"{_TEXT_PREFIX}layers.{layer}.mlp.experts."
        width = config.moe.expert_dim
        if proj == "down_proj":
            return FusedExperts(prefix + "down_proj", 0, config.dim, config.dim)
        start = 0 if proj == "gate_proj" else width
        return FusedExperts(prefix + "gate_up_proj", start, start + width, 2 * width)

    def tensors_to_hf(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        gates: dict[str, torch.Tensor] = {}  # a layer's gate_proj until its up_proj comes
        for name, tensor in named_tensors:
            match = _OUR_EXPERTS.fullmatch(name)
            if match is None:
                yield self.to_hf_name(name), tensor
                continue
            layer, proj = match.groups()
            prefix = f"{_TEXT_PREFIX}layers.{layer}.mlp.experts."
            if proj == "down_proj":
                yield prefix + "down_proj", tensor
            elif proj == "gate_proj":
                gates[layer] = tensor
            else:
                yield prefix + "gate_up_proj", torch.cat((gates.pop(layer), tensor), dim=1)
        if gates:
            raise ValueError(f"experts' gate_proj of layers {sorted(gates)} without up_proj")

    def to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _OUR_EXPERTS.fullmatch(name):
            raise ValueError(f"{name} is part of a fused tensor: export through tensors_to_hf")
        yield self.to_hf_name(name), tensor


_TOKEN_DEFAULTS = {"image_token_id": 151655, "vision_start_token_id": 151652,
                   "vision_end_token_id": 151653, "video_token_id": 151656}  # fmt: skip
"""transformers' defaults of the special token ids (the released checkpoints' ids)."""


def _text_config(
    text: dict[str, Any], model_type: str, moe: bool
) -> tuple[dict[str, Any], tuple[int, int, int]]:
    """The text_config as its text family reads it (M-RoPE keys taken out), and mrope_section."""
    text = {k: v for k, v in text.items() if k != "architectures"} | {"model_type": model_type}
    section = (24, 20, 20)  # transformers' default when rope parameters name none
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict):
            if params.get("mrope_section") is not None:
                section = tuple(int(s) for s in params["mrope_section"])
            # mrope_interleaved: transformers' Qwen3-VL interleaves whatever it says.
            text[key] = {k: v for k, v in params.items() if k not in _MRoPE_KEYS}
    if len(section) != 3:
        raise ConfigError(f"mrope_section {list(section)} must have three entries (t, h, w).")
    if moe:
        text["norm_topk_prob"] = True  # Qwen3-VL-MoE always renormalises the chosen experts
    return text, section  # type: ignore[return-value]


def _vision_from_hf(hf: dict[str, Any], text_dim: int) -> VisionConfig:
    known = frozenset(_VISION_DEFAULTS) | {"model_type", "initializer_range"}
    refuse_unknown_keys(hf, known | {"use_cache"}, "a Qwen3-VL vision_config")
    if hf.get("model_type", "qwen3_vl_vision") not in _VISION_TYPES:
        raise ConfigError(f"vision_config model_type {hf['model_type']!r} is not Qwen3-VL's.")

    def get(key: str) -> Any:
        value = hf.get(key)
        return _VISION_DEFAULTS[key] if value is None else value

    if get("hidden_act") != "gelu_pytorch_tanh":
        raise ConfigError(f"vision hidden_act={get('hidden_act')!r} is not supported "
                          "(gelu_pytorch_tanh only).")  # fmt: skip
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(get(key), int):
            raise ConfigError(f"vision {key}={get(key)!r} is not supported (one int only).")
    if get("out_hidden_size") != text_dim:
        raise ConfigError(
            f"vision out_hidden_size={get('out_hidden_size')} differs from the language model's "
            f"hidden_size {text_dim}."
        )
    rope = get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
        raise ConfigError(f"vision rope_parameters {rope} are not supported (axial only).")
    return VisionConfig(
        depth=get("depth"), dim=get("hidden_size"), ffn_dim=get("intermediate_size"),
        num_heads=get("num_heads"), in_channels=get("in_channels"), patch_size=get("patch_size"),
        temporal_patch_size=get("temporal_patch_size"),
        spatial_merge_size=get("spatial_merge_size"),
        num_position_embeddings=get("num_position_embeddings"),
        deepstack_layers=tuple(get("deepstack_visual_indexes")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )  # fmt: skip
