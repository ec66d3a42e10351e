"""Muse Spark <-> transformers' MuseSparkForConditionalGeneration (model_type "muse_spark"):
Muse Glimmer's adapter with the residual gates, the MoE layers and their keys, and the audio
encoder: ``audio_config`` and ``audio_token_id``, its tensors ``model.audio_tower.*`` our
``audio_tower.*`` (muse_audio_hf_name).

Inside an MoE layer transformers names the router ``gate`` (its correction bias
``e_score_correction_bias``), the projections ``pre_expert_proj`` / ``post_expert_proj``, the
norms ``pre_expert_norm`` / ``experts.post_expert_norm``, and stacks each expert's gate and up
projections in one tensor ``experts.gate_up_proj`` [experts, 2 * width, latent] (gate first):
our gate_proj and up_proj are its row ranges along dim 1, joined again on export.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.audio import muse_audio_hf_name
from torchloom.models.components.moe import MoEConfig
from torchloom.models.hf_adapter import RowSlice
from torchloom.models.muse_glimmer.encoders_hf import audio_config_from_hf, audio_config_to_hf
from torchloom.models.muse_glimmer.hf_adapter import (
    _BLOCK_TO_HF,
    _HF_VISION,
    MuseGlimmerHFAdapter,
)
from torchloom.models.muse_spark.config import MLP_LAYER_TYPES, MuseSparkConfig

_IN_MOE = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.in_proj.weight": "mlp.pre_expert_proj.weight",
    "mlp.norm_in.weight": "mlp.pre_expert_norm.weight",
    "mlp.norm_out.weight": "mlp.experts.post_expert_norm.weight",
    "mlp.out_proj.weight": "mlp.post_expert_proj.weight",
}
_IN_MOE_FROM_HF = {hf: ours for ours, hf in _IN_MOE.items()}
_LAYER_PATH = re.compile(r"(layers\.\d+\.)(.+)")
_GATE_UP = re.compile(r"(layers\.\d+\.mlp\.experts\.)(gate_proj|up_proj)")
_AUDIO = "audio_tower."


class MuseSparkHFAdapter(MuseGlimmerHFAdapter):
    model_type = "muse_spark"
    architecture = "MuseSparkForConditionalGeneration"
    text_model_type = "muse_spark_text"
    config_cls = MuseSparkConfig
    defaults = {
        "vocab_size": 202048, "hidden_size": 8192, "intermediate_size": 16384,
        "num_hidden_layers": 62, "num_attention_heads": 128, "num_key_value_heads": 16,
        "head_dim": 64, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
        "sliding_window": 2048, "final_logit_softcapping": 20.0,
        "qk_scale_factor": 5.4730064863875, "output_multiplier": 0.1767766952966369,
        "post_norm_eps": 1e-8, "tie_word_embeddings": False, "moe_intermediate_size": 4096,
        "num_local_experts": 256, "num_experts_per_tok": 8, "routed_scaling_factor": 1.0,
        "moe_hidden_size": 4096, "residual_gate_temperature": 0.3,
    }  # fmt: skip
    text_options = {
        "attention_bias": (False,), "attention_dropout": (0.0,), "hidden_act": ("silu", "swish"),
        # transformers' router logits only feed an auxiliary loss it never computes here.
        "output_router_logits": (False,),
    }  # fmt: skip
    ignored_keys = frozenset({  # read in _family_fields
        "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
        "routed_scaling_factor", "moe_hidden_size", "mlp_layer_types",
        "residual_gate_temperature",
    })  # fmt: skip
    token_ids = MuseGlimmerHFAdapter.token_ids | {"audio_token_id": 200038}
    encoder_keys = MuseGlimmerHFAdapter.encoder_keys | {"audio_config"}
    hf_encoder_prefixes = (*_HF_VISION, "model.audio_tower.")
    block_to_hf = _BLOCK_TO_HF | {
        "attention_residual": "post_attention_residual_gate",
        "mlp_residual": "post_feedforward_residual_gate",
    }

    def _family_fields(self, get: Any) -> dict[str, Any]:
        for key in ("moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
                    "moe_hidden_size"):  # fmt: skip
            value = get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        mlp_types = tuple(get("mlp_layer_types") or ())
        unknown = set(mlp_types) - set(MLP_LAYER_TYPES)
        if unknown:
            raise ConfigError(
                f"mlp_layer_types {sorted(unknown)} are not supported (each layer is "
                f"{' or '.join(MLP_LAYER_TYPES)})."
            )
        all_sparse = ("sparse",) * get("num_hidden_layers")
        moe = MoEConfig(
            num_experts=get("num_local_experts"), top_k=get("num_experts_per_tok"),
            expert_dim=get("moe_intermediate_size"), score_func="sigmoid",
            normalize_top_k=True, route_scale=float(get("routed_scaling_factor")),
            expert_bias=True,
        )  # fmt: skip
        return {
            "moe": moe,
            "latent_dim": get("moe_hidden_size"),
            "mlp_layer_types": () if mlp_types in ((), all_sparse) else mlp_types,
            "residual_gate_temperature": float(get("residual_gate_temperature")),
        }

    def _encoder_fields(self, hf: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
        return super()._encoder_fields(hf, text) | {"audio": audio_config_from_hf(hf, text)}

    def _encoders_to_hf(self, cfg: Any) -> dict[str, Any]:
        return super()._encoders_to_hf(cfg) | {"audio_config": audio_config_to_hf(cfg.audio)}

    def _family_to_hf(self, cfg: Any) -> dict[str, Any]:
        moe = cfg.moe
        return {
            "moe_intermediate_size": moe.expert_dim,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "routed_scaling_factor": moe.route_scale,
            "moe_hidden_size": cfg.latent_dim,
            "mlp_layer_types": list(cfg.resolved_mlp_layer_types()),
            "residual_gate_temperature": cfg.residual_gate_temperature,
        }

    # -- tensor names ---------------------------------------------------------------------

    def hf_names(self, name: str, config: Any) -> str | list[str] | RowSlice:
        match = _GATE_UP.fullmatch(name)
        if match is None:
            return self.to_hf_name(name)
        width = config.moe.expert_dim
        start = 0 if match.group(2) == "gate_proj" else width
        return RowSlice(self.to_hf_name(name), start, start + width, dim=1)

    def tensors_to_hf(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor under its name, except each MoE layer's gate_proj and up_proj, written
        as one gate_up_proj once both have come."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named_tensors:
            match = _GATE_UP.fullmatch(name)
            if match is None:
                yield self.to_hf_name(name), tensor
                continue
            held = parts.setdefault(self.to_hf_name(name), {})
            held[match.group(2)] = tensor
            if len(held) == 2:
                hf_name = self.to_hf_name(name)
                yield hf_name, torch.cat([held["gate_proj"], held["up_proj"]], dim=1)
                del parts[hf_name]
        if parts:
            raise ValueError(f"{sorted(parts)} lack their gate or up projections")

    def to_hf_name(self, name: str) -> str:
        if name.startswith(_AUDIO):
            return muse_audio_hf_name(name.removeprefix(_AUDIO))
        return super().to_hf_name(name)

    def _in_layer_to_hf(self, name: str) -> str:
        if _GATE_UP.fullmatch(name):
            return _GATE_UP.sub(r"\1gate_up_proj", name)
        match = _LAYER_PATH.fullmatch(name)
        if match is None:
            return name
        return match.group(1) + _IN_MOE.get(match.group(2), match.group(2))

    def _in_layer_from_hf(self, name: str) -> str:
        match = _LAYER_PATH.fullmatch(name)
        if match is None:
            return name
        return match.group(1) + _IN_MOE_FROM_HF.get(match.group(2), match.group(2))
