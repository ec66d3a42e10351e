"""Kimi Linear <-> transformers' KimiLinearForCausalLM (config.json model_type "kimi_linear").

Tensor names are those of Moonshot's checkpoints, which transformers reads and writes: a KDA
layer's ``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``, ``f_a_proj``, ``f_b_proj``,
``dt_bias``, ``A_log``, ``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj`` (all
ours, unchanged); an MLA layer's as DeepSeek-V3's; a MoE layer's under ``block_sparse_moe``:
``gate.weight`` and ``gate.e_score_correction_bias`` (the router and its balancing bias),
``experts.<e>.w1 / w3 / w2`` (gate, up, down: stacked into ours) and ``shared_experts``. A
dense layer's SwiGLU is ``mlp.*`` in Moonshot's files and ``block_sparse_moe.*`` in those
transformers writes; both are read, ``mlp.*`` is written.

config.json: Moonshot's files give the layer schedule as ``linear_attn_config`` (1-indexed
``kda_layers`` / ``full_attn_layers``, the KDA sizes) and ``first_k_dense_replace``;
transformers writes ``layer_types`` and ``mlp_layer_types``. Both are read (transformers'
precedence: ``layer_types`` first); we write both. The MLA layers are NoPE (``mla_use_nope``):
transformers never rotates them, so rope settings are ignored on reading.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.moe import MoEConfig
from torchloom.models.hf_adapter import HFAdapter, check_sigmoid_routing
from torchloom.models.kimi_linear.config import KimiLinearConfig

# transformers' KimiLinearConfig defaults for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_shared_experts": 1, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 8,
    "moe_renormalize": True, "model_max_length": 1048576, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "num_experts": 256, "linear_head_dim": 128,
    "linear_num_heads": 32, "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
}  # fmt: skip
# transformers' attribute_map: a key either name may carry (ours first).
_ALIASES = {
    "model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group", "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
}  # fmt: skip
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
          "v_head_dim", "qk_nope_head_dim", "num_experts", "num_experts_per_token",
          "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")  # fmt: skip
_LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "head_dim", "num_heads",
                     "short_conv_kernel_size"}  # fmt: skip
_OUR_MOE = re.compile(r"layers\.(\d+)\.mlp\.(router|experts|shared_experts)\.(.+)")
_EXPERT_FILE_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class KimiLinearHFAdapter(HFAdapter):
    model_type = "kimi_linear"
    architecture = "KimiLinearForCausalLM"
    qk_norm = False
    defaults = _DEFAULTS
    family_options = {
        "mla_use_nope": (True,),  # Moonshot's keys; transformers computes only these values
        "moe_router_activation_func": ("sigmoid",),
        "moe_layer_freq": (1,),
        "use_grouped_topk": (True,),
        "num_nextn_predict_layers": (0,),
        "pretraining_tp": (1,),
    }
    # Read by config_from_hf, or derived by transformers (head_dim = qk_rope_head_dim);
    # rope settings change nothing in NoPE layers; router logits are an output option.
    ignored_keys = frozenset(_DEFAULTS) | frozenset(_ALIASES.values()) | {
        "qk_head_dim", "layer_types", "mlp_layer_types", "linear_attn_config",
        "output_router_logits",
    }  # fmt: skip

    def config_from_hf(self, hf: dict[str, Any]) -> KimiLinearConfig:
        """The KimiLinearConfig of an HF config.json; ConfigError for what we cannot run."""
        self._check_keys(hf)

        def get(key: str) -> Any:
            for name in (key, _ALIASES.get(key)):
                if name is not None and hf.get(name) is not None:
                    return hf[name]
            return _DEFAULTS.get(key)

        linear = dict(hf.get("linear_attn_config") or {})
        unknown = set(linear) - _LINEAR_ATTN_KEYS
        if unknown:
            raise ConfigError(
                f"linear_attn_config key(s) {', '.join(sorted(unknown))} are not supported "
                "(transformers' KimiLinear has no such option)."
            )
        sizes = {key: get(key) for key in _SIZES}
        sizes |= {k: linear[v] for k, v in (("linear_head_dim", "head_dim"),
                  ("linear_num_heads", "num_heads"),
                  ("linear_conv_kernel_dim", "short_conv_kernel_size")) if v in linear}  # fmt: skip
        for key, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        layers, heads = sizes["num_hidden_layers"], sizes["num_attention_heads"]
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ConfigError(
                f"num_key_value_heads={hf['num_key_value_heads']} is not supported: multi-head "
                f"latent attention makes keys and values for every one of the {heads} heads."
            )
        shared = get("num_shared_experts")
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(
                f"num_shared_experts={shared!r} is not supported: KimiLinearForCausalLM always "
                "has a shared expert MLP (num_shared_experts >= 1)."
            )
        cfg = KimiLinearConfig(
            vocab_size=sizes["vocab_size"],
            dim=sizes["hidden_size"],
            num_layers=layers,
            norm_eps=float(get("rms_norm_eps")),
            max_seq_len=get("model_max_length"),
            tie_embeddings=False,  # transformers' class never ties, whatever the key says
            num_heads=heads,
            q_lora_rank=hf.get("q_lora_rank") or None,
            kv_lora_rank=sizes["kv_lora_rank"],
            qk_nope_head_dim=sizes["qk_nope_head_dim"],
            qk_rope_head_dim=sizes["qk_rope_head_dim"],
            v_head_dim=sizes["v_head_dim"],
            kda_num_heads=sizes["linear_num_heads"],
            kda_head_dim=sizes["linear_head_dim"],
            kda_conv_size=sizes["linear_conv_kernel_dim"],
            full_attention_layers=_full_attention_layers(hf, linear, layers),
            ffn_dim=sizes["intermediate_size"],
            first_dense_layers=_first_dense_layers(hf, get("first_k_dense_replace"), layers),
            moe=MoEConfig(
                num_experts=sizes["num_experts"],
                top_k=sizes["num_experts_per_token"],
                expert_dim=sizes["moe_intermediate_size"],
                num_shared_experts=shared,
                score_func="sigmoid",
                num_groups=get("num_expert_group"),
                top_groups=get("topk_group"),
                normalize_top_k=bool(get("moe_renormalize")),
                route_scale=float(get("routed_scaling_factor")),
                expert_bias=True,
            ),
        )
        cfg.validate()
        return cfg

    def config_to_hf(
        self,
        cfg: KimiLinearConfig,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """A config.json for ``cfg`` that transformers loads as KimiLinearForCausalLM (and
        that Moonshot's own code reads: linear_attn_config, first_k_dense_replace)."""
        moe = cfg.moe
        check_sigmoid_routing(moe, "KimiLinearForCausalLM", "num_shared_experts")
        if cfg.tie_embeddings:
            raise ConfigError(
                "This model ties its output head to the embedding; transformers' "
                "KimiLinearForCausalLM never ties them, so it cannot be exported as one. Untie it "
                "first (--model.transforms '[\"untie_embeddings\"]')."
            )
        if not cfg.mla_use_nope:
            raise ConfigError(
                "This model rotates its MLA layers (mla_use_nope false); transformers' "
                "KimiLinearForCausalLM has NoPE MLA only, so it cannot be exported as one."
            )
        full = set(cfg.full_attention_layers)
        specs = cfg.layer_specs()
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_heads,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "model_max_length": cfg.max_seq_len,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            **{key: values[0] for key, values in self.family_options.items()},
            "intermediate_size": cfg.ffn_dim,
            "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "layer_types": ["full_attention" if spec.mixer == "mla" else "linear_attention"
                            for spec in specs],
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in range(cfg.num_layers) if i not in full],
                "full_attn_layers": [i + 1 for i in sorted(full)],
                "num_heads": cfg.kda_num_heads,
                "head_dim": cfg.kda_head_dim,
                "short_conv_kernel_size": cfg.kda_conv_size,
            },
            "mlp_layer_types": ["dense" if spec.ffn == "swiglu" else "sparse" for spec in specs],
            "first_k_dense_replace": cfg.first_dense_layers,
            "moe_intermediate_size": moe.expert_dim,
            "num_experts": moe.num_experts,
            "num_experts_per_token": moe.top_k,
            "num_shared_experts": moe.num_shared_experts,
            "num_expert_group": moe.num_groups,
            "topk_group": moe.top_groups,
            "moe_renormalize": moe.normalize_top_k,
            "routed_scaling_factor": moe.route_scale,
            "use_cache": True,
        }  # fmt: skip
        if dtype is not None:
            hf["dtype"] = hf["torch_dtype"] = dtype
        if bos_token_id is not None:
            hf["bos_token_id"] = bos_token_id
        if eos_token_id is not None:
            hf["eos_token_id"] = eos_token_id
        # transformers' defaults are Moonshot's vocabulary's ids; a small vocabulary has none.
        hf.setdefault("pad_token_id", None)
        hf.setdefault("bos_token_id", None)
        hf.setdefault("eos_token_id", None)
        return hf

    # Tensor names: MoE layers under block_sparse_moe, experts as w1 / w3 / w2.
    def hf_names(self, name: str, config: Any) -> str | list[str]:
        match = _OUR_MOE.fullmatch(name)
        if match and match.group(2) == "experts":
            return _expert_names(match.group(1), match.group(3), config.moe.num_experts)
        return self.to_hf_name(name)

    def to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        match = _OUR_MOE.fullmatch(name)
        if match and match.group(2) == "experts":
            names = _expert_names(match.group(1), match.group(3), tensor.shape[0])
            yield from zip(names, tensor.unbind(0))
            return
        yield self.to_hf_name(name), tensor

    def to_hf_name(self, name: str) -> str:
        match = _OUR_MOE.fullmatch(name)
        if match:
            index, part, rest = match.groups()
            if part == "router":
                rest = {"weight": "weight", "expert_bias": "e_score_correction_bias"}[rest]
                return f"model.layers.{index}.block_sparse_moe.gate.{rest}"
            return f"model.layers.{index}.block_sparse_moe.{part}.{rest}"
        return super().to_hf_name(name)

    def held_name(self, hf_name: str, available: set[str]) -> str:
        """A dense layer's SwiGLU as transformers writes it (under block_sparse_moe) when the
        folder does not hold Moonshot's name (under mlp)."""
        if hf_name not in available and ".mlp." in hf_name:
            written = hf_name.replace(".mlp.", ".block_sparse_moe.")
            if written in available:
                return written
        return hf_name


def _expert_names(index: str, proj: str, experts: int) -> list[str]:
    """Moonshot's per-expert tensors of one stacked projection of layer ``index``, in order."""
    file_name = _EXPERT_FILE_NAMES[proj]
    return [f"model.layers.{index}.block_sparse_moe.experts.{e}.{file_name}.weight"
            for e in range(experts)]  # fmt: skip


def _full_attention_layers(
    hf: dict[str, Any], linear: dict[str, Any], layers: int
) -> tuple[int, ...]:
    """The MLA layers (from 0), with transformers' precedence: layer_types, then Moonshot's
    1-indexed linear_attn_config lists, then transformers' default (every fourth from 4)."""
    types = hf.get("layer_types")
    if types is not None:
        if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
            raise ConfigError(
                f"layer_types must list {layers} of 'full_attention' / 'linear_attention', "
                f"got {types}."
            )
        return tuple(i for i, kind in enumerate(types) if kind == "full_attention")
    if "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = list(linear["full_attn_layers"]), list(linear["kda_layers"])
        if sorted(full + kda) != list(range(1, layers + 1)):
            raise ConfigError(
                f"linear_attn_config's full_attn_layers {full} and kda_layers {kda} must "
                f"together list the layers 1..{layers} once each."
            )
        return tuple(sorted(i - 1 for i in full))
    return tuple(i for i in range(layers) if i and i % 4 == 0)


def _first_dense_layers(hf: dict[str, Any], first_k_dense: int, layers: int) -> int:
    """Dense layers form a prefix (mlp_layer_types first, else first_k_dense_replace)."""
    types = hf.get("mlp_layer_types")
    if types is None:
        return min(int(first_k_dense), layers)
    dense = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    if len(types) != layers or any(kind != "sparse" for kind in types[dense:]):
        raise ConfigError(
            f"mlp_layer_types {types} is not supported: torchloom builds {layers} layers whose "
            "dense ones come first, then 'sparse' (MoE) ones."
        )
    return dense
