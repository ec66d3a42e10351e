"""Qwen3-Next <-> transformers' Qwen3NextForCausalLM (config.json model_type "qwen3_next"); the
Qwen3.5 adapters (models/qwen3_5/) subclass it.

Tensor names are transformers' under torchloom's layer slots: a layer's token mixer is
``attention`` here whatever its kind, ``self_attn`` (gated attention) or ``linear_attn`` (Gated
DeltaNet, told apart by its parameter names) there; the shared expert is ``shared_experts``
here, ``shared_expert`` there. Per-expert tensors are stacked (models/hf_adapter.py). The
zero-centred norms store the same offsets transformers does, so every tensor loads as it is.

Not modelled, as in transformers: the multi-token-prediction layers of the released
checkpoints (``mtp.*`` tensors, ``mtp_*`` keys) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.moe import MoEConfig
from torchloom.models.hf_adapter import HFAdapter, RowSlice, rope_from_hf
from torchloom.models.qwen3_next.config import (
    LAYER_TYPES,
    Qwen3NextConfig,
    interval_layer_types,
)

# Qwen3NextConfig's defaults (transformers 5) for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "intermediate_size": 5632, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
    "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "full_attention_interval": 4, "partial_rotary_factor": 0.25, "num_key_value_heads": 2,
}  # fmt: skip
_LINEAR = {
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel",
}
_MOE_KEYS = frozenset({
    "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
    "output_router_logits", "router_aux_loss_coef",
})  # fmt: skip
# A DeltaNet layer's own parameter names (none is also an attention layer's).
_DELTANET = re.compile(
    r"(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d|dt_bias|A_log"
    r"|norm|out_proj)\b"
)
# DeltaNet parameters that are one part of a tensor the checkpoints stack: q, k, v (in order)
# of conv1d (both layouts) and of in_proj_qkv (Qwen3.5's).
_PART = re.compile(r"(layers\.\d+\.attention\.)(?:(q|k|v)_conv1d|in_proj_(q|k|v))\.weight")
_PART_INDEX = {"q": 0, "k": 1, "v": 2}


class Qwen3NextHFAdapter(HFAdapter):
    model_type = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    qk_norm = True
    defaults = _DEFAULTS
    fused_projections: ClassVar[bool] = True
    """Whether checkpoints hold the DeltaNet's fused projections (in_proj_qkvz, in_proj_ba)."""
    ffn_kinds: ClassVar[tuple[str, ...]] = ("moe", "swiglu")
    """Feed-forwards this model type can hold: MoE (num_experts > 0) or dense (0)."""
    ignored_rope_keys: ClassVar[tuple[str, ...]] = ()
    """rope_parameters keys that change nothing for text (Qwen3.5's MRoPE sections)."""
    family_options = {"use_sliding_window": (False,)}  # the released configs say so
    # Read by config_from_hf; sliding_window and max_window_layers act only with
    # use_sliding_window (refused).
    ignored_keys = frozenset(_LINEAR) | _MOE_KEYS | {
        "intermediate_size", "layer_types", "full_attention_interval",
        "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "sliding_window",
        "max_window_layers",
    }  # fmt: skip

    # -- config ---------------------------------------------------------------------------

    def config_from_hf(self, hf: dict[str, Any]) -> Qwen3NextConfig:
        """The Qwen3NextConfig of an HF config.json; ConfigError for what we cannot run."""
        self._check_keys(hf)

        def get(key: str) -> Any:
            value = hf.get(key)
            return self.defaults.get(key) if value is None else value

        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", *_LINEAR)  # fmt: skip
        for key in sizes:
            value = get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        layers = get("num_hidden_layers")
        layer_types = tuple(hf.get("layer_types") or ())
        interval = get("full_attention_interval")
        if not layer_types:
            layer_types = interval_layer_types(layers, interval)
        unknown = set(layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ConfigError(
                f"layer_types {sorted(unknown)} are not supported (each layer must be "
                f"{' or '.join(LAYER_TYPES)})."
            )
        rope_params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        partial = rope_params.pop("partial_rotary_factor", None)
        if partial is None:
            partial = get("partial_rotary_factor")
        for key in self.ignored_rope_keys:
            rope_params.pop(key, None)
        plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "partial_rotary_factor")}
        plain["rope_parameters"] = rope_params
        max_len = get("max_position_embeddings")
        # A dense width only where this model type has dense layers (else the default).
        ffn_dim = (
            get("intermediate_size") if "swiglu" in self.ffn_kinds else Qwen3NextConfig.ffn_dim
        )
        cfg = Qwen3NextConfig(
            vocab_size=get("vocab_size"),
            dim=get("hidden_size"),
            num_layers=layers,
            num_heads=get("num_attention_heads"),
            num_kv_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            partial_rotary_factor=float(partial),
            rope=rope_from_hf(plain, max_len),
            **{ours: get(key) for key, ours in _LINEAR.items()},
            linear_fused_projections=self.fused_projections,
            full_attention_interval=interval,
            layer_types=self._explicit_layer_types(layer_types, interval),
            ffn_dim=ffn_dim,
            norm_eps=float(get("rms_norm_eps")),
            max_seq_len=max_len,
            tie_embeddings=bool(get("tie_word_embeddings")),
            **self._ffn_from_hf(get, layers),
        )
        cfg.validate()
        return cfg

    @staticmethod
    def _explicit_layer_types(layer_types: tuple[str, ...], interval: int) -> tuple[str, ...]:
        """() when the layers follow the interval pattern (the config then stays short)."""
        pattern = interval_layer_types(len(layer_types), interval)
        return () if layer_types == pattern else layer_types

    def _ffn_from_hf(self, get: Any, layers: int) -> dict[str, Any]:
        """ffn and moe of the config: every layer MoE (num_experts > 0) or every layer dense."""
        experts = get("num_experts") if "moe" in self.ffn_kinds else 0
        if not experts:
            if "swiglu" not in self.ffn_kinds:
                raise ConfigError(f"num_experts must be positive for {self.model_type}.")
            return {"ffn": "swiglu"}
        dense = sorted(get("mlp_only_layers") or [])
        step = get("decoder_sparse_step")
        if dense or step != 1:
            raise ConfigError(
                f"mlp_only_layers={dense} with decoder_sparse_step={step} is not supported: "
                "torchloom's Qwen3-Next has an MoE feed-forward in every layer (mlp_only_layers "
                "[], decoder_sparse_step 1), as the released models do."
            )
        expert_dim = get("moe_intermediate_size")
        shared_dim = get("shared_expert_intermediate_size")
        for key, value in (("moe_intermediate_size", expert_dim),
                           ("shared_expert_intermediate_size", shared_dim)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        # transformers' one shared expert may have any width; a multiple of an expert's is
        # kept as that many experts' worth (the flavors' and earlier checkpoints' spelling).
        multiple = shared_dim % expert_dim == 0
        top_k = get("num_experts_per_tok")
        aux = bool(get("output_router_logits"))
        moe = MoEConfig(
            num_experts=experts,
            top_k=top_k,
            expert_dim=expert_dim,
            num_shared_experts=shared_dim // expert_dim if multiple else 1,
            shared_expert_dim=0 if multiple else shared_dim,
            shared_expert_gate=True,
            normalize_top_k=bool(get("norm_topk_prob")),
            # transformers adds coef * E * sum_i (count_i / N) P_i with output_router_logits;
            # torchloom's loss is that over top_k (models/components/moe.py).
            balance_loss="batch" if aux else "none",
            balance_loss_coef=float(get("router_aux_loss_coef")) * top_k if aux else 0.0,
        )
        return {"ffn": "moe", "moe": moe}

    def config_to_hf(
        self,
        cfg: Qwen3NextConfig,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """A config.json for ``cfg`` that transformers loads as ``architecture``."""
        if cfg.linear_fused_projections != self.fused_projections:
            raise ConfigError(
                f"This model's DeltaNet projections are "
                f"{'fused' if cfg.linear_fused_projections else 'separate'}, but transformers' "
                f"{self.architecture} has them {'fused' if self.fused_projections else 'separate'}"
                "; it cannot be exported as one."
            )
        if cfg.ffn not in self.ffn_kinds:
            raise ConfigError(
                f"transformers' {self.architecture} has no {cfg.ffn!r} feed-forward; this model "
                "cannot be exported as one."
            )
        hf = self.shared_hf_config(cfg, dtype, bos_token_id, eos_token_id)
        hf["rope_parameters"] = hf["rope_parameters"] | {
            "partial_rotary_factor": cfg.partial_rotary_factor
        }
        hf |= {
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            **{key: getattr(cfg, ours) for key, ours in _LINEAR.items()},
            "layer_types": list(cfg.resolved_layer_types()),
        }
        if "swiglu" in self.ffn_kinds:
            hf["intermediate_size"] = cfg.ffn_dim
        if cfg.ffn == "moe":
            hf |= self._moe_to_hf(cfg.moe)
        elif "moe" in self.ffn_kinds:
            hf["num_experts"] = 0
        return hf

    def _moe_to_hf(self, moe: MoEConfig) -> dict[str, Any]:
        qwen_routing = MoEConfig(
            num_experts=moe.num_experts, top_k=moe.top_k, expert_dim=moe.expert_dim,
            num_shared_experts=moe.num_shared_experts, shared_expert_dim=moe.shared_expert_dim,
            shared_expert_gate=True, normalize_top_k=moe.normalize_top_k,
            balance_loss=moe.balance_loss, balance_loss_coef=moe.balance_loss_coef,
        )  # fmt: skip
        renormalised_only = "norm_topk_prob" not in self.ignored_keys
        if (
            moe != qwen_routing
            or not moe.num_shared_experts
            or moe.balance_loss == "sequence"
            or (renormalised_only and not moe.normalize_top_k)
        ):
            raise ConfigError(
                f"This model's routing ({moe}) is not what transformers' {self.architecture} "
                "computes (softmax top-k, a gated shared expert, batch balance loss); it "
                "cannot be exported as one."
            )
        hf = {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": moe.expert_dim,
            "shared_expert_intermediate_size": moe.shared_dim,
            "num_experts_per_tok": moe.top_k,
            "num_experts": moe.num_experts,
            "norm_topk_prob": moe.normalize_top_k,
            "output_router_logits": moe.balance_loss != "none",
            "router_aux_loss_coef": moe.balance_loss_coef / moe.top_k
            if moe.balance_loss_coef
            else 0.001,
        }
        return {key: value for key, value in hf.items() if key in self.ignored_keys}

    # -- tensor names ---------------------------------------------------------------------

    def hf_names(self, name: str, config: Any) -> str | list[str] | RowSlice:
        match = _PART.fullmatch(name)
        if match is None:
            return super().hf_names(name, config)
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        index = _PART_INDEX[match.group(2) or match.group(3)]
        start = key_dim * index
        return RowSlice(self.to_hf_name(name), start, start + (key_dim, key_dim, value_dim)[index])

    def tensors_to_hf(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor as ``to_hf`` writes it, except the q, k, v parts of a DeltaNet layer's
        conv1d and in_proj_qkv, which are written stacked once all three have come."""
        parts: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in named_tensors:
            match = _PART.fullmatch(name)
            if match is None:
                yield from self.to_hf(name, tensor)
                continue
            hf_name = self.to_hf_name(name)
            held = parts.setdefault(hf_name, {})
            held[_PART_INDEX[match.group(2) or match.group(3)]] = tensor
            if len(held) == len(_PART_INDEX):
                yield hf_name, torch.cat([held[i] for i in range(len(_PART_INDEX))])
                del parts[hf_name]
        if parts:
            raise ValueError(f"{sorted(parts)} lack some of their q, k, v parts")

    def to_hf_name(self, name: str) -> str:
        match = _PART.fullmatch(name)
        if match:  # a part of a stacked tensor: that tensor's name
            name = match.group(1) + ("conv1d" if match.group(2) else "in_proj_qkv") + ".weight"
        hf_name = super().to_hf_name(name)
        hf_name = hf_name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        prefix, sep, rest = hf_name.partition(".self_attn.")
        if sep and _DELTANET.match(rest):
            return f"{prefix}.linear_attn.{rest}"
        return hf_name

    def from_hf_name(self, hf_name: str) -> str | None:
        if hf_name.startswith("mtp."):
            return None  # multi-token prediction layers: not modelled (module docstring)
        hf_name = hf_name.replace(".linear_attn.", ".self_attn.")
        hf_name = hf_name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        return super().from_hf_name(hf_name)
