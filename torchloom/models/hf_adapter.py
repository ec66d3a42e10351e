"""Hugging Face <-> torchloom for families built on the generic Transformer: the fields of an HF
``config.json`` and the tensor names of a ``*ForCausalLM`` checkpoint.

A family subclasses HFAdapter with only what differs (its ``model_type``, the defaults of its
transformers config class, its own options). Every config.json key is mapped, checked against
the one value we support, or known to be metadata; any other key is refused by name, so an
option that would change the network is never silently dropped.

No q/k permutation: our RoPE rotates channel i with channel i + head_dim/2 ("rotate half"),
the layout transformers uses, so HF q_proj/k_proj rows load as they are (the parity tests in
tests/models/test_*_hf.py prove it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple

import torch

from torchloom.config.errors import ConfigError
from torchloom.models.components.moe import MoEConfig
from torchloom.models.components.rope import RopeConfig
from torchloom.models.components.transformer import TransformerConfig

# Keys describing the file, the tokenizer or generation defaults, not the network (transformers
# 4.x wrote many of them into every config.json). Read by nobody here.
_METADATA_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_bfloat16", "auto_map",
    "_attn_implementation", "_attn_implementation_autoset", "id2label", "label2id", "num_labels",
    "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "return_dict", "output_attentions", "output_hidden_states", "torchscript", "tf_legacy_loss",
    "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "use_cache",
    "initializer_range", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "encoder_no_repeat_ngram_size", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})  # fmt: skip

# HF key -> TransformerConfig field, for the plain sizes.
_SIZES = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "ffn_dim",
}
_ROPE_KEYS = frozenset({"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"})
_MAPPED_KEYS = frozenset(_SIZES) | _ROPE_KEYS | {
    "model_type", "architectures", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings",
}  # fmt: skip

# Options every family supports with exactly these values (None counts as the default).
_COMMON_OPTIONS: dict[str, tuple[Any, ...]] = {
    "attention_bias": (False,),
    "attention_dropout": (0.0,),
    "hidden_act": ("silu", "swish"),  # the same function in transformers' ACT2FN
    "quantization_config": (None,),
}

# Keys allowed inside rope_parameters / rope_scaling, per rope type.
_ROPE_TYPE_KEYS = {
    "default": set(),
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"},
}  # fmt: skip
_ROPE_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


class RowSlice(NamedTuple):
    """Rows [start, stop) of one Hugging Face tensor: a parameter that transformers keeps
    fused with others in one tensor (Qwen3.5's in_proj_qkv holds q, k and v). ``dim`` is the
    dim they are rows of (1: Muse Spark's stacked gate_up_proj [experts, 2 * width, dim])."""

    name: str
    start: int
    stop: int
    dim: int = 0


class FusedExperts(NamedTuple):
    """Rows [start, stop) of every expert's matrix in one ``[experts, rows, cols]`` Hugging
    Face tensor holding all experts (transformers' fused ``gate_up_proj`` / ``down_proj``). A
    checkpoint may store it transposed, ``[experts, cols, rows]`` (the released Qwen3-VL-MoE
    files); the stored shape tells which (square: untransposed, as transformers reads it)."""

    name: str
    start: int
    stop: int
    rows: int


class HFAdapter:
    """Config and tensor-name mapping between one family and its transformers class."""

    model_type: ClassVar[str]
    """``model_type`` in config.json ('llama')."""
    architecture: ClassVar[str]
    """The transformers class the checkpoint is for ('LlamaForCausalLM')."""
    qk_norm: ClassVar[bool]
    """Whether the transformers class has q_norm/k_norm."""
    defaults: ClassVar[dict[str, Any]]
    """Defaults of the transformers config class for keys a config.json may leave out."""
    family_options: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Family-only options and the values we support (the first is written on export)."""
    ignored_keys: ClassVar[frozenset[str]] = frozenset()
    """Family keys that cannot change the network as configured (checked elsewhere)."""
    reads_also: ClassVar[tuple[str, ...]] = ()
    """Further config.json model_types this adapter reads (a multimodal checkpoint whose
    language model is this family's); export always writes ``model_type``."""

    def config_from_hf(self, hf: dict[str, Any]) -> TransformerConfig:
        """The TransformerConfig of an HF config.json; ConfigError for what we cannot run."""
        self._check_keys(hf)
        missing = [key for key in _SIZES if hf.get(key) is None]
        if missing:
            raise ConfigError(f"the required field(s) {', '.join(missing)} are missing.")
        for key in _SIZES:
            if not isinstance(hf[key], int) or isinstance(hf[key], bool) or hf[key] <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {hf[key]!r}.")

        def get(key: str) -> Any:
            value = hf.get(key)
            return self.defaults.get(key) if value is None else value

        sizes = {ours: hf[key] for key, ours in _SIZES.items()}
        head_dim = get("head_dim")
        implied = hf["hidden_size"] // hf["num_attention_heads"]
        if self.defaults["head_dim"] is None and head_dim == implied:
            head_dim = None  # implicit, as in this family's flavors (dim // num_heads)
        if head_dim is None and hf["hidden_size"] % hf["num_attention_heads"]:
            raise ConfigError(
                f"hidden_size {hf['hidden_size']} is not divisible by "
                f"num_attention_heads {hf['num_attention_heads']} and there is no head_dim."
            )
        cfg = TransformerConfig(
            **sizes,
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            norm_eps=float(get("rms_norm_eps")),
            rope=rope_from_hf(hf, get("max_position_embeddings")),
            max_seq_len=get("max_position_embeddings"),
            qk_norm=self.qk_norm,
            tie_embeddings=bool(get("tie_word_embeddings")),
        )
        cfg.validate()
        return cfg

    def config_to_hf(
        self,
        cfg: TransformerConfig,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """A config.json for ``cfg`` that transformers 5 (and 4.x) loads as ``architecture``."""
        if cfg.qk_norm != self.qk_norm:
            raise ConfigError(
                f"This {self.model_type} model has qk_norm={cfg.qk_norm}, but transformers' "
                f"{self.architecture} has qk_norm={self.qk_norm}; it cannot be exported as one."
            )
        hf = self.shared_hf_config(cfg, dtype, bos_token_id, eos_token_id)
        hf |= {
            "intermediate_size": cfg.ffn_dim,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.resolved_head_dim,
        }
        return hf

    def shared_hf_config(
        self,
        cfg: Any,
        dtype: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> dict[str, Any]:
        """The config.json keys every family writes alike: architecture, sizes, norm, RoPE
        (transformers 5 reads rope_parameters; 4.x rope_theta + rope_scaling), the family's
        fixed options, dtype and special tokens."""
        rope = rope_to_hf(cfg.rope)
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            **{key: values[0] for key, values in self.family_options.items()},
            "rope_parameters": rope,
            "rope_theta": cfg.rope.theta,
            "rope_scaling": None if cfg.rope.scaling == "none" else without_key(rope, "rope_theta"),
            "use_cache": True,
        }
        if dtype is not None:
            hf["dtype"] = hf["torch_dtype"] = dtype  # 5.x and 4.x spellings
        if bos_token_id is not None:
            hf["bos_token_id"] = bos_token_id
        if eos_token_id is not None:
            hf["eos_token_id"] = eos_token_id
        return hf

    def config_for_tensors(self, config: Any, tensor_names: Callable[[], Iterable[str]]) -> Any:
        """``config`` (read from config.json) fitted to what the checkpoint holds, given the
        names of its tensors (read only if a family needs them): itself, unless a family's
        config.json may announce parts that writers drop (DeepSeek-V3's MTP layers)."""
        return config

    def _check_keys(self, hf: dict[str, Any]) -> None:
        if hf.get("model_type") != self.model_type:
            raise ConfigError(f"model_type is {hf.get('model_type')!r}, not {self.model_type!r}.")
        architectures = hf.get("architectures")
        if architectures and list(architectures) != [self.architecture]:
            raise ConfigError(
                f"architectures {architectures} is not supported; torchloom reads "
                f"{self.architecture} checkpoints (a decoder with its language-model head)."
            )
        options = _COMMON_OPTIONS | self.family_options
        for key, value in hf.items():
            if key in options:
                if value is not None and value not in options[key]:
                    allowed = " or ".join(repr(v) for v in options[key])
                    raise ConfigError(
                        f"{key}={value!r} is not supported (torchloom reads "
                        f"{self.model_type} checkpoints with {key}={allowed} only)."
                    )
            elif key not in _MAPPED_KEYS | _METADATA_KEYS | self.ignored_keys:
                raise ConfigError(
                    f"unknown option {key}={value!r}. torchloom does not know what "
                    f"it changes in a {self.model_type} model, so it refuses rather than ignores it."
                )

    # Tensor names. Ours mirror HF's minus the "model." prefix, with a few renamed modules, and
    # per-expert weights stacked into one parameter per projection.
    def hf_names(self, name: str, config: Any) -> str | list[str] | RowSlice | FusedExperts:
        """The Hugging Face tensor(s) torchloom's parameter ``name`` of a model of ``config`` is
        made of: one name, a list of tensors stacked along a new first dim (the experts), or
        some rows of one tensor (a part of a fused tensor)."""
        match = _OUR_EXPERTS.fullmatch(name)
        if match:
            return self.expert_names(*match.groups(), config.moe.num_experts)
        return self.to_hf_name(name)

    def expert_names(self, index: str, proj: str, experts: int) -> list[str]:
        """The checkpoint's per-expert tensors of layer ``index``'s stacked projection ``proj``
        (gate_proj, up_proj, down_proj), in expert order: transformers' names by default."""
        return [f"model.layers.{index}.mlp.experts.{e}.{proj}.weight" for e in range(experts)]

    def loads_integer(self, hf_name: str) -> bool:
        """Whether the HF tensor ``hf_name`` is an integer table loaded as it is (DeepSeek-V4's
        hash routing table); weights must be floating point."""
        return False

    def held_name(self, hf_name: str, available: set[str]) -> str:
        """The name under which a folder holding the tensors ``available`` keeps the tensor
        ``hf_names`` calls ``hf_name``: itself, unless a family's writers disagree on a name
        (Kimi Linear's dense feed-forward)."""
        return hf_name

    def tensors_to_hf(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for a stream of torchloom parameters (``to_hf`` of each, unless a
        family joins several parameters into one tensor)."""
        for name, tensor in named_tensors:
            yield from self.to_hf(name, tensor)

    def to_hf(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of a torchloom parameter: itself, or its stacked parts one by one."""
        match = _OUR_EXPERTS.fullmatch(name)
        if match is None:
            yield self.to_hf_name(name), tensor
            return
        yield from zip(self.expert_names(*match.groups(), tensor.shape[0]), tensor.unbind(0))

    def to_hf_name(self, name: str) -> str:
        """torchloom parameter name -> transformers name ('norm.weight' -> 'model.norm.weight')."""
        if name.startswith("output."):
            return "lm_head." + name.removeprefix("output.")
        match = _OUR_LAYER.fullmatch(name)
        if match:
            index, module, rest = match.groups()
            module = _OURS_TO_HF.get(module, module)
            path = f"{module}.{rest}"
            return f"model.layers.{index}.{_IN_LAYER_TO_HF.get(path, path)}"
        return "model." + name

    def from_hf_name(self, hf_name: str) -> str | None:
        """transformers name -> torchloom name (an expert's tensor -> the stacked parameter);
        None for tensors that carry nothing to load."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None  # a buffer old checkpoints saved; RoPE frequencies come from the config
        if hf_name.startswith("lm_head."):
            return "output." + hf_name.removeprefix("lm_head.")
        match = _HF_EXPERT.fullmatch(hf_name)
        if match:
            index, proj = match.groups()
            return f"layers.{index}.mlp.experts.{proj}"
        match = _HF_LAYER.fullmatch(hf_name)
        if match:
            index, module, rest = match.groups()
            module = _HF_TO_OURS.get(module, module)
            path = f"{module}.{rest}"
            return f"layers.{index}.{_IN_LAYER_FROM_HF.get(path, path)}"
        if hf_name.startswith("model."):
            return hf_name.removeprefix("model.")
        raise ConfigError(
            f"Unexpected tensor '{hf_name}' in a {self.architecture} checkpoint (expected names "
            "under model. or lm_head.)."
        )


_HF_TO_OURS = {
    "self_attn": "attention",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "mlp_norm",
}
_OURS_TO_HF = {ours: hf for hf, ours in _HF_TO_OURS.items()}
# Inside a layer (after the renames above): the MoE router is transformers' "gate".
_IN_LAYER_FROM_HF = {
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
}
_IN_LAYER_TO_HF = {ours: hf for hf, ours in _IN_LAYER_FROM_HF.items()}
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")
_HF_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight"
)
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(\w+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(\w+)\.(.+)")


def config_for_held_mtp(config: Any, held: list[int], name: Callable[[int], str]) -> Any:
    """``config`` (a family config with ``mtp_layers``) for the MTP depths a checkpoint holds:
    ``held`` their indices from 0 (depth k's tensors under ``name(k)``). Without MTP when it
    holds none (transformers' saves drop them), as announced when it holds exactly those,
    ConfigError otherwise."""
    if not held:
        return replace(config, mtp_layers=0)
    if held != list(range(config.mtp_layers)):
        found = ", ".join(name(k) for k in held)
        raise ConfigError(
            f"config.json announces {config.mtp_layers} MTP layer(s) "
            f"(num_nextn_predict_layers) but the checkpoint holds MTP layer(s) {found}; set "
            f"num_nextn_predict_layers to match the layers {name(0)}.. it holds."
        )
    return config


def refuse_unknown_keys(values: dict[str, Any], known: Iterable[str], where: str) -> None:
    """ConfigError naming the first key of ``values`` (a config.json section, described by
    ``where``, e.g. "a kimi_k25 vision_config") that is neither in ``known`` nor metadata:
    torchloom does not know what it changes, so it refuses it rather than ignoring it."""
    accepted = _METADATA_KEYS.union(known)
    for key, value in values.items():
        if key not in accepted:
            raise ConfigError(
                f"unknown option {key}={value!r} in {where}. torchloom does not know what it "
                "changes, so it refuses rather than ignores it."
            )


def rope_from_hf(hf: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """RopeConfig from transformers 5's rope_parameters or 4.x's rope_theta + rope_scaling."""
    # transformers 5 prefers rope_scaling when both are present; so do we.
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if any(isinstance(value, dict) for value in params.values()):
        raise ConfigError("per-layer-type rope parameters are not supported.")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPE_KEYS:
        raise ConfigError(
            f"rope type {rope_type!r} is not supported; torchloom supports "
            f"{', '.join(_ROPE_TYPE_KEYS)} (or no rope_scaling)."
        )
    unknown = set(params) - _ROPE_TYPE_KEYS[rope_type] - _ROPE_COMMON_KEYS
    if unknown:
        raise ConfigError(
            f"rope parameter(s) {', '.join(sorted(unknown))} are not supported "
            f"with rope type {rope_type!r}."
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1.0):
        raise ConfigError(
            f"partial_rotary_factor={partial} is not supported (RoPE over the whole head only)."
        )
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return RopeConfig(theta=theta)

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise ConfigError(f"{rope_type} rope scaling needs {key}.")
        return params[key]

    original = int(need("original_max_position_embeddings"))
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            scaling="llama3",
            factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_seq_len=original,
        )
    # yarn: transformers derives a missing factor from the context lengths, and uses the
    # mscale pair only when both are set (we encode "unset" as mscale_all_dim 0).
    factor = params.get("factor") or max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and mscale_all_dim)
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        scaling="yarn",
        factor=float(factor),
        original_max_seq_len=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(mscale) if both else 1.0,
        mscale_all_dim=float(mscale_all_dim) if both else 0.0,
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def without_key(params: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != key}


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """transformers 5's rope_parameters for ``rope``."""
    if rope.scaling == "none":
        return {"rope_type": "default", "rope_theta": rope.theta}
    params: dict[str, Any] = {
        "rope_type": rope.scaling,
        "rope_theta": rope.theta,
        "factor": rope.factor,
        "original_max_position_embeddings": rope.original_max_seq_len,
    }
    if rope.scaling == "llama3":
        params |= {
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
        }
        return params
    params |= {"beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "truncate": rope.truncate}
    if rope.mscale and rope.mscale_all_dim:
        params |= {"mscale": rope.mscale, "mscale_all_dim": rope.mscale_all_dim}
    if rope.attention_factor is not None:
        params["attention_factor"] = rope.attention_factor
    return params


def check_sigmoid_routing(moe: MoEConfig, hf_class: str, shared_key: str) -> None:
    """Refuse, in one line, an MoE whose routing ``hf_class`` (DeepSeek-V3's kind: sigmoid
    scores with the balancing bias, ungated shared experts as wide as ``shared_key`` experts)
    does not compute, so it is never exported as one."""
    if (
        moe.score_func != "sigmoid"
        or not moe.expert_bias
        or not moe.num_shared_experts
        or moe.shared_expert_gate
        or moe.shared_expert_dim
    ):
        raise ConfigError(
            f"This model's routing (score_func {moe.score_func!r}, expert_bias "
            f"{moe.expert_bias}, num_shared_experts {moe.num_shared_experts}, "
            f"shared_expert_gate {moe.shared_expert_gate}, shared_expert_dim "
            f"{moe.shared_expert_dim}) is not what transformers' {hf_class} computes (sigmoid "
            f"scores with the balancing bias, and ungated shared experts as wide as "
            f"{shared_key} experts); it cannot be exported as one."
        )
