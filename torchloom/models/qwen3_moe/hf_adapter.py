"""Qwen3-MoE <-> transformers' Qwen3MoeForCausalLM (config.json model_type "qwen3_moe").

Checkpoints hold one tensor per expert and projection (``mlp.experts.<e>.gate_proj.weight``);
torchloom stacks them into one [experts, ...] parameter per projection (models/hf_adapter.py).
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.transformer import MoETransformerConfig, TransformerConfig
from torchloom.models.qwen3.hf_adapter import Qwen3HFAdapter


class Qwen3MoeHFAdapter(Qwen3HFAdapter):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    # Qwen3MoeConfig's defaults: a missing head_dim means dim / heads here.
    defaults = {
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
    family_options = {"use_sliding_window": (False,)}
    sliding_layers = False  # MoETransformerConfig has one mask: causal
    # Read by config_from_hf below.
    ignored_keys = Qwen3HFAdapter.ignored_keys | {
        "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "num_experts_per_tok",
        "num_experts", "num_local_experts", "norm_topk_prob", "output_router_logits",
        "router_aux_loss_coef",
    }  # fmt: skip

    def config_from_hf(self, hf: dict[str, Any]) -> MoETransformerConfig:
        dense = super().config_from_hf(hf)

        def get(key: str) -> Any:
            value = hf.get(key)
            return self.defaults.get(key) if value is None else value

        experts = hf.get("num_local_experts", hf.get("num_experts")) or self.defaults["num_experts"]
        layers = dense.num_layers
        dense_layers = sorted(hf.get("mlp_only_layers") or [])
        step = get("decoder_sparse_step")
        first_dense = len(dense_layers)
        if dense_layers != list(range(first_dense)) or step != 1:
            raise ConfigError(
                f"mlp_only_layers={dense_layers} with decoder_sparse_step={step} is not "
                "supported: torchloom places dense layers first (mlp_only_layers [0 .. k-1], "
                "decoder_sparse_step 1), as every released Qwen3-MoE model does."
            )
        top_k = get("num_experts_per_tok")
        aux = bool(get("output_router_logits"))
        moe = MoEConfig(
            num_experts=experts,
            top_k=top_k,
            expert_dim=get("moe_intermediate_size"),
            normalize_top_k=bool(get("norm_topk_prob")),
            # transformers adds coef * E * sum_i (count_i / N) P_i when output_router_logits;
            # torchloom's loss is that over top_k (models/components/moe.py).
            balance_loss="batch" if aux else "none",
            balance_loss_coef=float(get("router_aux_loss_coef")) * top_k if aux else 0.0,
        )
        cfg = MoETransformerConfig(
            **{f.name: getattr(dense, f.name) for f in fields(TransformerConfig)},
            moe=moe,
            first_dense_layers=min(first_dense, layers),
        )
        cfg.validate()
        return cfg

    def config_to_hf(self, cfg: MoETransformerConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        moe = cfg.moe
        unsupported = {
            key: value
            for key, value in asdict(moe).items()
            if key in _FIXED and value != getattr(_QWEN3_ROUTING, key)
        }
        if unsupported or moe.balance_loss == "sequence":
            raise ConfigError(
                f"This model's routing ({unsupported or {'balance_loss': 'sequence'}}) is not "
                "what transformers' Qwen3MoeForCausalLM computes; it cannot be exported as one."
            )
        hf = super().config_to_hf(cfg, *args, **kwargs)
        hf.update(
            decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.first_dense_layers)),
            moe_intermediate_size=moe.expert_dim,
            num_experts_per_tok=moe.top_k,
            num_experts=moe.num_experts,
            norm_topk_prob=moe.normalize_top_k,
            output_router_logits=moe.balance_loss != "none",
            router_aux_loss_coef=moe.balance_loss_coef / moe.top_k
            if moe.balance_loss_coef
            else 0.001,
        )
        return hf


# Routing fields transformers' Qwen3-MoE has no option for, and their only value there.
_QWEN3_ROUTING = replace(MoEConfig(), score_func="softmax")
_FIXED = (
    "num_shared_experts", "score_func", "num_groups", "top_groups", "route_scale", "expert_bias",
)  # fmt: skip
