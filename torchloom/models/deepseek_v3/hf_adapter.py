"""DeepSeek-V3 <-> transformers' DeepseekV3ForCausalLM (config.json model_type "deepseek_v3").

Tensor names are transformers' (the MLA modules keep their names: q_a_proj, kv_a_proj_with_mqa,
kv_b_proj, ...), per-expert weights are stacked (models/hf_adapter.py), and the rotated
query/key channels load as they are: ``rope_interleave`` is applied at run time.

Multi-token prediction. DeepSeek-V3's checkpoints hold MTP depth k as layer
``model.layers.{num_hidden_layers + k - 1}`` (enorm, hnorm, eh_proj, shared_head.norm, and the
decoder block's usual names) with config.json's ``num_nextn_predict_layers``; such a layer also
repeats the embedding and the head (``embed_tokens``, ``shared_head.head``), which torchloom
shares with the main model and so neither reads nor writes. transformers' model ignores these
layers, and its ``save_pretrained`` drops them while still writing ``num_nextn_predict_layers``
(1 by default); so a folder whose config.json announces MTP layers but which holds none of
their tensors loads without MTP (``mtp_layers`` 0), and one holding only some of them is refused.

What transformers' DeepseekV3 always computes, and so the only routing exported or read:
sigmoid scores with the balancing bias (``e_score_correction_bias``), group-limited top-k, and
shared experts. The bias update rate and the loss weight lambda are training settings no
config.json holds: a loaded model keeps its bias fixed and uses lambda 0.3.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.moe import MoEConfig
from torchloom.models.deepseek_v3.config import DeepSeekV3Config
from torchloom.models.hf_adapter import (
    HFAdapter,
    check_sigmoid_routing,
    config_for_held_mtp,
    rope_from_hf,
)

# DeepseekV3Config's defaults (transformers 5) for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "num_nextn_predict_layers": 1, "aux_loss_alpha": 0.0, "seq_aux": True,
}  # fmt: skip
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
          "num_hidden_layers", "num_attention_heads", "n_routed_experts", "kv_lora_rank",
          "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "num_experts_per_tok")  # fmt: skip
# The MTP depth's own modules: ours -> the name inside its HF layer.
_MTP_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
_OUR_MTP = re.compile(r"mtp\.layers\.(\d+)\.(\w+)\.(.+)")
_HF_MTP_COPY = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight")
_HF_EH_PROJ = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


class DeepSeekV3HFAdapter(HFAdapter):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    qk_norm = False
    defaults = _DEFAULTS
    family_options = {
        "scoring_func": ("sigmoid",),  # the original DeepSeek-V3 code's keys
        "topk_method": ("noaux_tc",),
        "moe_layer_freq": (1,),
        "pretraining_tp": (1,),
    }
    # Read by config_from_hf; ep_size is how the original code was deployed; the router
    # logits transformers can return change nothing computed.
    ignored_keys = frozenset(_DEFAULTS) | {
        "num_mtp_layers", "qk_head_dim", "ep_size", "output_router_logits",
    }  # fmt: skip

    def config_from_hf(self, hf: dict[str, Any]) -> DeepSeekV3Config:
        """The DeepSeekV3Config of an HF config.json; ConfigError for what we cannot run."""
        self._check_keys(hf)

        def get(key: str) -> Any:
            value = hf.get(key)
            return _DEFAULTS.get(key) if value is None else value

        for key in _SIZES:
            value = get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        heads = get("num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ConfigError(
                f"num_key_value_heads={hf['num_key_value_heads']} is not supported: multi-head "
                f"latent attention makes keys and values for every one of the {heads} heads."
            )
        nope, rope_dim = get("qk_nope_head_dim"), get("qk_rope_head_dim")
        for key, implied in (("head_dim", rope_dim), ("qk_head_dim", nope + rope_dim)):
            if hf.get(key) not in (None, implied):
                raise ConfigError(
                    f"{key}={hf[key]} contradicts qk_nope_head_dim={nope} and "
                    f"qk_rope_head_dim={rope_dim} (transformers derives it as {implied})."
                )
        shared = get("n_shared_experts")
        if not isinstance(shared, int) or shared < 1:
            raise ConfigError(
                f"n_shared_experts={shared!r} is not supported: DeepseekV3ForCausalLM always "
                "has shared experts (n_shared_experts >= 1)."
            )
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers"))
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if scaling.get("mscale_all_dim") and not scaling.get("mscale"):
            raise ConfigError(
                "rope mscale_all_dim without mscale is not supported; set both (DeepSeek's "
                "configs set mscale = mscale_all_dim)."
            )
        alpha = float(get("aux_loss_alpha"))
        cfg = DeepSeekV3Config(
            vocab_size=get("vocab_size"),
            dim=get("hidden_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            q_lora_rank=hf.get("q_lora_rank", _DEFAULTS["q_lora_rank"]) or None,
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=get("v_head_dim"),
            rope_interleave=bool(get("rope_interleave")),
            ffn_dim=get("intermediate_size"),
            first_dense_layers=min(get("first_k_dense_replace"), get("num_hidden_layers")),
            norm_eps=float(get("rms_norm_eps")),
            max_seq_len=get("max_position_embeddings"),
            tie_embeddings=bool(get("tie_word_embeddings")),
            rope=rope_from_hf(hf, get("max_position_embeddings")),
            moe=MoEConfig(
                num_experts=get("n_routed_experts"),
                top_k=get("num_experts_per_tok"),
                expert_dim=get("moe_intermediate_size"),
                num_shared_experts=shared,
                score_func="sigmoid",
                num_groups=get("n_group"),
                top_groups=get("topk_group"),
                normalize_top_k=bool(get("norm_topk_prob")),
                route_scale=float(get("routed_scaling_factor")),
                expert_bias=True,
                # The original code's complementary balance loss (training only).
                balance_loss=("sequence" if get("seq_aux") else "batch") if alpha else "none",
                balance_loss_coef=alpha,
            ),
            mtp_layers=_DEFAULTS["num_nextn_predict_layers"] if mtp is None else mtp,
        )
        cfg.validate()
        return cfg

    def config_to_hf(
        self,
        cfg: DeepSeekV3Config,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """A config.json for ``cfg`` that transformers loads as DeepseekV3ForCausalLM."""
        moe = cfg.moe
        check_sigmoid_routing(moe, "DeepseekV3ForCausalLM", "n_shared_experts")
        hf = self.shared_hf_config(cfg, dtype, bos_token_id, eos_token_id)
        hf |= {
            "intermediate_size": cfg.ffn_dim,
            "moe_intermediate_size": moe.expert_dim,
            "num_key_value_heads": cfg.num_heads,
            "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "rope_interleave": cfg.rope_interleave,
            "first_k_dense_replace": cfg.first_dense_layers,
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "n_shared_experts": moe.num_shared_experts,
            "n_group": moe.num_groups,
            "topk_group": moe.top_groups,
            "norm_topk_prob": moe.normalize_top_k,
            "routed_scaling_factor": moe.route_scale,
            "num_nextn_predict_layers": cfg.mtp_layers,
        }
        if moe.balance_loss != "none":
            hf |= {"aux_loss_alpha": moe.balance_loss_coef,
                   "seq_aux": moe.balance_loss == "sequence"}  # fmt: skip
        return hf

    def config_for_tensors(
        self, config: DeepSeekV3Config, tensor_names: Callable[[], Iterable[str]]
    ) -> DeepSeekV3Config:
        """Without MTP when the folder holds no MTP layer (a transformers save); the announced
        depths when it holds them all; ConfigError when it holds some."""
        if not config.mtp_layers:
            return config
        first = config.num_layers
        held = sorted(
            int(m.group(1)) - first
            for m in map(_HF_EH_PROJ.fullmatch, tensor_names())
            if m and int(m.group(1)) >= first
        )
        return config_for_held_mtp(config, held, lambda k: f"model.layers.{first + k}")

    # Tensor names: an MTP depth's parameters sit under its HF layer index.
    def hf_names(self, name: str, config: Any) -> str | list[str]:
        return super().hf_names(_as_layer(name), config)

    def to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return super().to_hf(_as_layer(name), tensor)

    def to_hf_name(self, name: str) -> str:
        return super().to_hf_name(_as_layer(name))

    def from_hf_name(self, hf_name: str) -> str | None:
        if _HF_MTP_COPY.fullmatch(hf_name):
            return None  # an MTP layer's copy of the shared embedding or head
        return super().from_hf_name(hf_name)


def _as_layer(name: str) -> str:
    """An MTP depth's parameter named as if its HF layer were one of ours
    ('mtp.layers.61.block.attention.kv_b_proj.weight' -> 'layers.61.attention.kv_b_proj.weight',
    'mtp.layers.61.norm.weight' -> 'layers.61.shared_head.norm.weight'); others unchanged."""
    match = _OUR_MTP.fullmatch(name)
    if match is None:
        return name
    index, module, rest = match.groups()
    if module == "block":
        return f"layers.{index}.{rest}"
    return f"layers.{index}.{_MTP_OWN[module]}.{rest}"
