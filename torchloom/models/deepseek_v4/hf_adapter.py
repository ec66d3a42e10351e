"""DeepSeek-V4 <-> transformers' DeepseekV4ForCausalLM (config.json model_type "deepseek_v4").

Tensor names on disk are DeepSeek's original ones, which transformers' ``save_pretrained``
writes too (its conversion mapping renames them only in memory): ``model.layers.{i}.attn.wq_a``,
``attn.compressor.wkv``, ``attn.indexer.compressor.ape``, ``hc_attn_fn``, ``ffn.gate.bias``,
per-expert ``ffn.experts.{e}.w1/w2/w3`` (stacked into our gate_proj / down_proj / up_proj),
``head.weight``. DeepSeek's published folders drop the ``model.`` prefix and call the top-level
tensors ``embed.weight``, ``norm.weight`` and ``hc_head_fn``, and the attention's key/value
norm ``attn.kv_norm`` (transformers' saves: ``attn.norm``): both spellings load, exports write
transformers'. The hash layers' token -> experts table ``ffn.gate.tid2eid`` is int64 and loads
as it is.

Multi-token prediction. DeepSeek's published folders hold MTP depth k under ``mtp.{k}.``
(config.json's ``num_nextn_predict_layers``): the depth's own ``enorm``, ``e_proj``, ``hnorm``,
``h_proj``, ``norm`` and ``hc_head_fn`` / ``hc_head_base`` / ``hc_head_scale``, and its
sliding-window block under a layer's names (``attn.wq_a``, ``hc_attn_fn``, ``ffn.gate.bias``,
``ffn.experts.{e}.w1``, ...); exports write the same. transformers builds no MTP: it skips
these tensors and its ``save_pretrained`` drops them while writing ``num_nextn_predict_layers``
(1 by default). So, as for DeepSeek-V3, a folder announcing MTP depths but holding none of them
(no ``mtp.{k}.e_proj.weight``) loads without MTP, one holding other depths than it announces is
refused, and with no MTP in the config any ``mtp.*`` tensor is skipped. The loss weight is a
training setting no config.json holds (0.3, DeepSeekV4Config.mtp_loss_weight).

Not read: the published FP8/FP4 expert weights (dequantize first; the loader refuses them by
name).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.compressed_attention import ATTENTION_KINDS, CSA, HCA, SLIDING
from torchloom.models.components.rope import RopeConfig
from torchloom.models.deepseek_v4.config import DeepSeekV4Config, _moe
from torchloom.models.hf_adapter import (
    HFAdapter,
    config_for_held_mtp,
    refuse_unknown_keys,
    rope_from_hf,
    rope_to_hf,
)

# DeepseekV4Config's defaults (transformers 5) for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6, "n_routed_experts": 256,
    "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "rms_norm_eps": 1e-6, "num_hash_layers": 3,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}  # fmt: skip
# Keys read below, or that cannot change the network: metadata, training-only settings, and
# DeepSeek-V3-shaped keys older V4 files carry that transformers' DeepseekV4 never reads
# (kv_lora_rank, qk_nope_head_dim, v_head_dim, first_k_dense_replace, n_group, ...).
_KNOWN = set(_DEFAULTS) | {
    "model_type", "architectures", "layer_types", "mlp_layer_types", "compress_rates",
    "compress_ratios", "compress_rate_csa", "compress_rate_hca", "rope_parameters",
    "rope_scaling", "partial_rotary_factor", "qk_rope_head_dim", "norm_topk_prob",
    "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "hidden_act", "attention_bias", "attention_dropout", "mlp_bias",
    "topk_method", "expert_dtype", "quantization_config", "compress_rope_parameters",
    "n_group", "topk_group", "kv_lora_rank", "qk_nope_head_dim", "first_k_dense_replace",
    "intermediate_size", "pretraining_tp", "rope_interleave", "v_head_dim",
}  # fmt: skip
# Must hold these values for the network we compute (None: the default).
_FIXED = {
    "hidden_act": ("silu", "swish"), "attention_bias": (False,), "attention_dropout": (0.0,),
    "mlp_bias": (False,), "num_key_value_heads": (1,), "n_shared_experts": (1,),
    "scoring_func": ("sqrtsoftplus",), "norm_topk_prob": (True,), "router_jitter_noise": (0.0,),
    "quantization_config": (None,), "n_group": (None, 0, 1), "topk_group": (None, 0, 1),
}  # fmt: skip

# ours -> the checkpoint's name inside layer i (after "layers.{i}."): transformers writes (and
# DeepSeek publishes) DeepSeek's original module names.
_LAYER_NAMES = [
    ("attention_hc.", "hc_attn_"), ("mlp_hc.", "hc_ffn_"),
    ("attention_norm.", "attn_norm."), ("mlp_norm.", "ffn_norm."),
    ("attention.indexer.weights_proj.", "attn.indexer.weights_proj."),
    ("attention.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("attention.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("attention.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("attention.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("attention.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("attention.compressor.kv_proj.", "attn.compressor.wkv."),
    ("attention.compressor.gate_proj.", "attn.compressor.wgate."),
    ("attention.compressor.position_bias", "attn.compressor.ape"),
    ("attention.compressor.kv_norm.", "attn.compressor.norm."),
    ("attention.q_a_proj.", "attn.wq_a."), ("attention.q_a_norm.", "attn.q_norm."),
    ("attention.q_b_proj.", "attn.wq_b."), ("attention.kv_proj.", "attn.wkv."),
    ("attention.kv_norm.", "attn.norm."), ("attention.o_a_proj.", "attn.wo_a."),
    ("attention.o_b_proj.", "attn.wo_b."), ("attention.sinks", "attn.attn_sink"),
    ("mlp.router.weight", "ffn.gate.weight"), ("mlp.router.expert_bias", "ffn.gate.bias"),
    ("mlp.router.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
]  # fmt: skip
_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_PROJ = {w: proj for proj, w in _W.items()}
_TOP = {"embed_tokens.weight": "model.embed_tokens.weight", "output.weight": "head.weight",
        "norm.weight": "model.norm.weight", "hc_head.hc_fn": "model.hc_head.hc_fn",
        "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale"}  # fmt: skip
_FROM_TOP = {disk: ours for ours, disk in _TOP.items()}
# DeepSeek's published files: no "model." prefix, and three top-level names of their own.
_PUBLISHED_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                  "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
                  "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip
_FROM_PUBLISHED_TOP = {published: disk for disk, published in _PUBLISHED_TOP.items()}
# The attention's own key/value norm: DeepSeek's published files call it attn.kv_norm (as its
# inference code does), transformers' save_pretrained writes attn.norm (its renaming of the
# compressors' "norm" to "kv_norm", reversed, catches this one too). Both load; exports write
# transformers' spelling.
_ATTN_NORM = re.compile(r"(.*\.attn\.)norm\.weight")
_PUBLISHED_ATTN_NORM = re.compile(r"(.*\.attn\.)kv_norm\.weight")
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_DISK_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_DISK_EXPERT = re.compile(r"model\.layers\.(\d+)\.ffn\.experts\.\d+\.(w[123])\.weight")
# An MTP depth: its block's tensors are named as layer k's would be, then moved under mtp.{k}.;
# its own modules (ours -> DeepSeek's, after "mtp.{k}.") keep DeepSeek's names.
_OUR_MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_MTP_OWN = [("enorm.", "enorm."), ("e_proj.", "e_proj."), ("hnorm.", "hnorm."),
            ("h_proj.", "h_proj."), ("norm.", "norm."), ("hc_head.hc_", "hc_head_")]  # fmt: skip
_DISK_MTP_E_PROJ = re.compile(r"mtp\.(\d+)\.e_proj\.weight")


class DeepSeekV4HFAdapter(HFAdapter):
    model_type = "deepseek_v4"
    architecture = "DeepseekV4ForCausalLM"
    qk_norm = False
    defaults = _DEFAULTS

    def config_from_hf(self, hf: dict[str, Any]) -> DeepSeekV4Config:  # type: ignore[override]
        """The DeepSeekV4Config of an HF config.json; ConfigError for what we cannot run."""
        if hf.get("model_type") != self.model_type:
            raise ConfigError(f"model_type is {hf.get('model_type')!r}, not {self.model_type!r}.")
        refuse_unknown_keys(hf, _KNOWN, "a deepseek_v4 config.json")
        if hf.get("architectures") and list(hf["architectures"]) != [self.architecture]:
            raise ConfigError(
                f"architectures {hf['architectures']} is not supported; torchloom reads "
                f"{self.architecture} checkpoints (the decoder with its language-model head)."
            )
        if hf.get("quantization_config") is not None:
            raise ConfigError(
                "this folder holds quantized weights (quantization_config); torchloom loads "
                "floating-point weights only: dequantize the checkpoint to bfloat16 first."
            )
        for key, allowed in _FIXED.items():
            if hf.get(key) is not None and hf[key] not in allowed:
                raise ConfigError(
                    f"{key}={hf[key]!r} is not supported (torchloom reads deepseek_v4 "
                    f"checkpoints with {key} in {allowed} only)."
                )

        def get(key: str) -> Any:
            return _DEFAULTS.get(key) if hf.get(key) is None else hf[key]

        # transformers reads intermediate_size as moe_intermediate_size (an attribute alias).
        width, alias = hf.get("moe_intermediate_size"), hf.get("intermediate_size")
        if alias is not None and width is not None and alias != width:
            raise ConfigError(
                f"intermediate_size={alias} and moe_intermediate_size={width} disagree; "
                "transformers reads both as the experts' width: keep one."
            )
        if width is None and alias is not None:
            hf = hf | {"moe_intermediate_size": alias}

        layers, head_dim = get("num_hidden_layers"), get("head_dim")
        rope_dim = hf.get("qk_rope_head_dim") or round(head_dim * (hf.get("partial_rotary_factor") or 0.125))  # fmt: skip
        rates = {CSA: 4, HCA: 128} | (hf.get("compress_rates") or {})
        rates[CSA] = hf.get("compress_rate_csa") or rates[CSA]
        rates[HCA] = hf.get("compress_rate_hca") or rates[HCA]
        kinds = hf.get("layer_types")
        if kinds is None and hf.get("compress_ratios") is not None:
            ratio_kind = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
            kinds = [ratio_kind.get(r) for r in hf["compress_ratios"]][:layers]
        if kinds is not None and any(k not in ATTENTION_KINDS for k in kinds):
            raise ConfigError(f"layer_types / compress_ratios has an unknown kind: {kinds}.")
        hash_layers = get("num_hash_layers")
        mlp_kinds = hf.get("mlp_layer_types")
        if mlp_kinds is not None:
            hash_layers = sum(1 for kind in mlp_kinds if kind == "hash_moe")
            if list(mlp_kinds) != ["hash_moe"] * hash_layers + ["moe"] * (layers - hash_layers):
                raise ConfigError(
                    f"mlp_layer_types {mlp_kinds} is not supported: the hash-routed layers must "
                    "come first."
                )
        cfg = DeepSeekV4Config(
            vocab_size=get("vocab_size"), dim=get("hidden_size"), num_layers=layers,
            norm_eps=float(get("rms_norm_eps")), max_seq_len=get("max_position_embeddings"),
            tie_embeddings=bool(get("tie_word_embeddings")), num_heads=get("num_attention_heads"),
            head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=get("q_lora_rank"),
            o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"),
            sliding_window=get("sliding_window"), csa_ratio=rates[CSA], hca_ratio=rates[HCA],
            index_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"),
            index_topk=get("index_topk"), attention_kinds=tuple(kinds or ()),
            hash_layers=min(hash_layers, layers), hc_streams=get("hc_mult"),
            hc_sinkhorn_iters=get("hc_sinkhorn_iters"), hc_eps=float(get("hc_eps")),
            moe=replace(
                _moe(get("n_routed_experts"), get("moe_intermediate_size"),
                     float(get("routed_scaling_factor"))),
                top_k=get("num_experts_per_tok"), swiglu_limit=float(get("swiglu_limit")),
            ),
            mtp_layers=get("num_nextn_predict_layers"), **_ropes(hf, get),
        )  # fmt: skip
        cfg.validate()
        return cfg

    def config_to_hf(  # type: ignore[override]
        self, cfg: DeepSeekV4Config, dtype: str | None = None, bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """A config.json for ``cfg`` that transformers 5 loads as DeepseekV4ForCausalLM."""
        moe = cfg.moe
        if moe.score_func != "sqrtsoftplus" or not moe.expert_bias or not moe.normalize_top_k:
            raise ConfigError(
                "transformers' DeepSeek-V4 routes by normalised sqrt(softplus) scores with a "
                "choice bias; this model's moe differs and cannot be exported as one."
            )
        if cfg.rope.scaling != "none":
            raise ConfigError("transformers' DeepSeek-V4 rotates sliding layers without scaling.")
        compress = rope_to_hf(cfg.compress_rope)
        hf: dict[str, Any] = {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": 1,
            "head_dim": cfg.head_dim, "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
            "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
            "sliding_window": cfg.sliding_window,
            "compress_rates": {CSA: cfg.csa_ratio, HCA: cfg.hca_ratio},
            "layer_types": list(cfg.kinds()),
            "mlp_layer_types": [s.ffn for s in cfg.layer_specs()],
            "index_n_heads": cfg.index_heads, "index_head_dim": cfg.index_head_dim,
            "index_topk": cfg.index_topk, "hc_mult": cfg.hc_streams,
            "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
            "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_dim, "n_shared_experts": 1,
            "routed_scaling_factor": moe.route_scale, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True, "swiglu_limit": moe.swiglu_limit,
            "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "rope_theta": cfg.rope.theta, "compress_rope_theta": cfg.compress_rope.theta,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": cfg.rope.theta,
                         "partial_rotary_factor": cfg.rope_dim / cfg.head_dim},
                "compress": compress | {"partial_rotary_factor": cfg.rope_dim / cfg.head_dim},
            },
            "num_nextn_predict_layers": cfg.mtp_layers, "use_cache": True,
        }  # fmt: skip
        if dtype is not None:
            hf["dtype"] = dtype
        if bos_token_id is not None:
            hf["bos_token_id"] = bos_token_id
        if eos_token_id is not None:
            hf["eos_token_id"] = eos_token_id
        return hf

    def config_for_tensors(
        self, config: DeepSeekV4Config, tensor_names: Callable[[], Iterable[str]]
    ) -> DeepSeekV4Config:
        """Without MTP when the folder holds no MTP depth (a transformers save); the announced
        depths when it holds exactly those; ConfigError otherwise."""
        if not config.mtp_layers:
            return config
        held = sorted(int(m.group(1)) for m in map(_DISK_MTP_E_PROJ.fullmatch, tensor_names()) if m)
        return config_for_held_mtp(config, held, lambda k: f"mtp.{k}")

    # Tensor names: an MTP depth's block is named as layer k's, moved under "mtp.{k}.".
    def hf_names(self, name: str, config: Any) -> Any:
        layer = _mtp_block_as_layer(name)
        if layer is None:
            return super().hf_names(name, config)
        depth, layer_name = layer
        names = super().hf_names(layer_name, config)
        if isinstance(names, str):
            return _layer_to_mtp(depth, names)
        return [_layer_to_mtp(depth, n) for n in names]

    def to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        layer = _mtp_block_as_layer(name)
        if layer is None:
            yield from super().to_hf(name, tensor)
            return
        depth, layer_name = layer
        for hf_name, part in super().to_hf(layer_name, tensor):
            yield _layer_to_mtp(depth, hf_name), part

    def expert_names(self, index: str, proj: str, experts: int) -> list[str]:
        """The checkpoint's per-expert tensors (DeepSeek's ffn.experts.{e}.w1/w2/w3)."""
        return [f"model.layers.{index}.ffn.experts.{e}.{_W[proj]}.weight" for e in range(experts)]

    def held_name(self, hf_name: str, available: set[str]) -> str:
        """transformers' name, or where DeepSeek's published files keep that tensor (no
        "model." prefix; embed, norm and hc_head_* at the top)."""
        if hf_name in available or hf_name == "head.weight":
            return hf_name
        published = _PUBLISHED_TOP.get(hf_name, hf_name.removeprefix("model."))
        spellings = [published]
        if _ATTN_NORM.fullmatch(hf_name):  # the attention's kv_norm, as DeepSeek names it
            spellings += [_ATTN_NORM.sub(r"\1kv_norm.weight", n) for n in (hf_name, published)]
        return next((name for name in spellings if name in available), hf_name)

    def loads_integer(self, hf_name: str) -> bool:
        """The hash layers' token -> experts table is stored as integers and loads as such."""
        return hf_name.endswith(".ffn.gate.tid2eid")

    def to_hf_name(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        layer = _mtp_block_as_layer(name)
        if layer is not None:
            return _layer_to_mtp(layer[0], self.to_hf_name(layer[1]))
        match = _OUR_MTP.fullmatch(name)
        if match:
            depth, rest = match.groups()
            for ours, disk in _MTP_OWN:
                if rest.startswith(ours):
                    return f"mtp.{depth}.{disk}{rest.removeprefix(ours)}"
        match = _OUR_LAYER.fullmatch(name)
        if match is None:
            raise ValueError(f"deepseek_v4 has no Hugging Face name for {name!r}")
        index, rest = match.groups()
        for ours, disk in _LAYER_NAMES:
            if rest.startswith(ours):
                return f"model.layers.{index}.{disk}{rest.removeprefix(ours)}"
        raise ValueError(f"deepseek_v4 has no Hugging Face name for {name!r}")

    def from_hf_name(self, hf_name: str) -> str | None:
        if hf_name.startswith(("mtp.", "model.mtp.")):
            # MTP depths the model does not have (config_for_tensors refuses a folder holding
            # other depths than it announces): skipped, as transformers skips them.
            return None
        hf_name = _FROM_PUBLISHED_TOP.get(hf_name, hf_name)
        hf_name = _PUBLISHED_ATTN_NORM.sub(r"\1norm.weight", hf_name)
        if hf_name.startswith("layers."):
            hf_name = "model." + hf_name
        if hf_name in _FROM_TOP:
            return _FROM_TOP[hf_name]
        match = _DISK_EXPERT.fullmatch(hf_name)
        if match:
            index, w = match.groups()
            return f"layers.{index}.mlp.experts.{_PROJ[w]}"
        match = _DISK_LAYER.fullmatch(hf_name)
        if match:
            index, rest = match.groups()
            for ours, disk in _LAYER_NAMES:
                if rest.startswith(disk):
                    return f"layers.{index}.{ours}{rest.removeprefix(disk)}"
        raise ConfigError(f"Unexpected tensor '{hf_name}' in a {self.architecture} checkpoint.")


def _mtp_block_as_layer(name: str) -> tuple[str, str] | None:
    """(k, the name it would have in layer k) for a parameter of MTP depth k's block
    ('mtp.layers.0.block.attention.q_a_proj.weight' -> ('0', 'layers.0.attention.q_a_proj.
    weight')); None for any other parameter."""
    match = _OUR_MTP.fullmatch(name)
    if match is None or not match.group(2).startswith("block."):
        return None
    depth, rest = match.groups()
    return depth, f"layers.{depth}.{rest.removeprefix('block.')}"


def _layer_to_mtp(depth: str, hf_name: str) -> str:
    """Layer k's checkpoint name moved under MTP depth k ('model.layers.0.attn.wq_a.weight' ->
    'mtp.0.attn.wq_a.weight')."""
    return f"mtp.{depth}." + hf_name.removeprefix(f"model.layers.{depth}.")


def _ropes(hf: dict[str, Any], get: Any) -> dict[str, RopeConfig]:
    """The "main" (sliding layers) and "compress" RoPE of a config.json: transformers 5 nests
    them in rope_parameters; older files give rope_theta, compress_rope_theta and one
    rope_scaling, which applies to the compressed layers only (transformers' reading)."""
    params = hf.get("rope_parameters") or {}
    max_len = get("max_position_embeddings")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main = {k: v for k, v in params["main"].items() if k != "partial_rotary_factor"}
        compress = {k: v for k, v in params["compress"].items() if k != "partial_rotary_factor"}
    else:
        scaling = (
            hf.get("rope_scaling")
            or hf.get("compress_rope_parameters")
            or {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        )
        main = {"rope_type": "default", "rope_theta": get("rope_theta")}
        compress = {
            k: v for k, v in scaling.items() if k not in ("partial_rotary_factor", "rope_theta")
        }
        compress["rope_theta"] = get("compress_rope_theta")
        compress.setdefault("rope_type", compress.pop("type", "default"))
        compress.pop("type", None)
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    return {
        "rope": rope_from_hf({"rope_parameters": main}, max_len),
        "compress_rope": rope_from_hf({"rope_parameters": compress}, max_len),
    }
