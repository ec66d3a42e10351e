"""The job's ``model`` section and its resolution into the family's config."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.kernels.linear_cross_entropy import LOSS_IMPLS
from torchloom.models.components.decoder import DecoderConfig
from torchloom.models.registry import check_field_types, get_model_spec
from torchloom.models.transforms import apply_transforms

# Fields chosen by their own ModelConfig slot, so there is one way to set them.
_SLOTS = (
    "attn_backend", "norm_impl", "rope_impl", "mlp_impl", "loss_impl", "batch_invariant", "float8",
)  # fmt: skip


@dataclass
class ModelConfig:
    """Which model to build: a family, one of its flavors, and changes on top of it."""

    name: str = "llama3"
    """Model family ('llama3', 'qwen3')."""
    flavor: str = "debug"
    """Named size of the family ('debug', '8B', ...): see docs/models.md."""
    transforms: list[str] = field(default_factory=list)
    """Model-config transforms applied in order, e.g. ["tie_embeddings"]."""
    attn_backend: str = "sdpa"
    """Attention kernel: 'sdpa', 'flex' (no backward on CPU) or 'fa4' (FlashAttention 4 on
    Hopper and newer, causal within each document, packed rows included; needs flash-attn-4; a
    PyTorch reference on CPU)."""
    norm_impl: str = "torch"
    """RMSNorm implementation: 'torch' (PyTorch) or 'triton' (fused forward and backward
    kernels on CUDA, PyTorch elsewhere; not with tensor parallelism). Same parameters either way;
    the transform triton_kernels sets this, rope_impl and mlp_impl at once."""
    rope_impl: str = "torch"
    """How RoPE rotates queries and keys: 'torch' (PyTorch) or 'triton' (one fused kernel
    forward and one backward on CUDA, PyTorch elsewhere)."""
    mlp_impl: str = "torch"
    """The SwiGLU gate silu(gate) * up between the MLP's linears: 'torch' (PyTorch) or 'triton'
    (fused kernels on CUDA, PyTorch elsewhere)."""
    loss_impl: str = "full"
    """Output head + loss: 'full' (logits, then cross-entropy) or 'chunked' (fused over token
    chunks, never materializing [batch, seq, vocab] logits; not with tensor or pipeline
    parallelism)."""
    batch_invariant: bool = False
    """Batch-invariant mode: fixed-order linears, attention and RMSNorm, so a sequence's logits
    are bitwise identical whatever shares its batch, in decode and in full forwards, in the
    trainer and the generator (Triton kernels on CUDA, slow reference kernels on the CPU; fp32
    or bf16; no tp/cp/pp)."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 training of the transformer blocks' linears (torchao; output head and embedding
    stay high precision): 'tensorwise' or 'rowwise' scaling, 'none' off. Needs torchao
    (pip install 'torchloom[float8]') and a GPU of compute capability 8.9+ (the CPU runs a
    slow reference); saved models and exports stay high precision."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Architecture fields to change, e.g. {"num_layers": 4, "rope.theta": 1e6}."""

    def validate(self) -> None:
        """Field types, and the slots no family config checks (the others are checked when it
        is resolved)."""
        check_field_types(self, "--model.")
        if self.loss_impl not in LOSS_IMPLS:
            raise ConfigError(
                f"Unknown --model.loss_impl {self.loss_impl!r}."
                f"{did_you_mean(self.loss_impl, LOSS_IMPLS)} Available: {', '.join(LOSS_IMPLS)}."
            )


def resolve_model_config(model_cfg: ModelConfig) -> DecoderConfig:
    """flavor -> overrides -> component slots -> transforms -> validate."""
    model_cfg.validate()
    cfg = get_model_spec(model_cfg.name).flavor(model_cfg.flavor)
    cfg = apply_overrides(cfg, model_cfg.overrides)
    return apply_component_choices(cfg, model_cfg)


def apply_component_choices(cfg: DecoderConfig, model_cfg: ModelConfig) -> DecoderConfig:
    """The component slots, then the transforms, of ``model_cfg`` on ``cfg``; validated.

    Also the last step for an architecture that comes from elsewhere (a Hugging Face config).
    """
    model_cfg.validate()
    if model_cfg.batch_invariant and (
        model_cfg.attn_backend != "sdpa"
        or model_cfg.loss_impl != "full"
        or model_cfg.float8 != "none"
    ):
        raise ConfigError(
            "--model.batch_invariant true brings its own attention, norm, linears and loss; "
            "leave --model.attn_backend (sdpa), --model.loss_impl (full) and --model.float8 "
            "(none) at their defaults."
        )
    cfg = replace(
        cfg,
        attn_backend=model_cfg.attn_backend,
        norm_impl=model_cfg.norm_impl,
        rope_impl=model_cfg.rope_impl,
        mlp_impl=model_cfg.mlp_impl,
        batch_invariant=model_cfg.batch_invariant,
        float8=model_cfg.float8,
    )
    if model_cfg.batch_invariant:
        cfg = batch_invariant_config(cfg)
    cfg = apply_transforms(cfg, model_cfg.transforms)
    check_field_types(cfg)
    cfg.validate()
    _check_buildable(cfg, model_cfg.name)
    return cfg


def _check_buildable(cfg: DecoderConfig, family: str) -> None:
    """What the family's own validation lets through but its model cannot build or train:
    hash-routed MoE layers in a family whose blocks do not hand their MoE the token ids (the
    families that do have hash-routed layers: ``hash_layers``). A non-finite number anywhere
    is DecoderConfig.validate's."""
    moe = getattr(cfg, "moe", None)
    if getattr(moe, "hash_routing", False) and not hasattr(cfg, "hash_layers"):
        raise ConfigError(
            f"model moe.hash_routing needs the token ids in every MoE layer, which {family}'s "
            "blocks do not pass (deepseek_v4's do: its first hash_layers layers are "
            "hash-routed); leave moe.hash_routing false."
        )


def batch_invariant_config(cfg: DecoderConfig) -> DecoderConfig:
    """``cfg`` in batch-invariant mode: fixed-order attention, linears, RMSNorm and SwiGLU gate
    (torchloom/kernels/batch_invariant.py: Triton kernels on CUDA, fixed-order references
    elsewhere) and the Triton RoPE (elementwise IEEE arithmetic, so invariant either way; on
    CUDA it replaces a dozen small eager kernels per block in a decode step that cannot be
    compiled; see docs/batch_invariance.md)."""
    return replace(
        cfg, batch_invariant=True, attn_backend="batch_invariant", norm_impl="batch_invariant",
        rope_impl="triton", mlp_impl="batch_invariant",
    )  # fmt: skip


def apply_overrides(cfg: DecoderConfig, overrides: dict[str, Any]) -> DecoderConfig:
    """Return ``cfg`` with the given fields of its family config replaced; fields of a nested
    config (rope) as 'rope.theta'."""
    hints = typing.get_type_hints(type(cfg))
    nested = {f.name for f in fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}
    top = {f.name for f in fields(cfg)} - set(_SLOTS) - nested
    leaves = {f"{n}.{f.name}": n for n in nested for f in fields(getattr(cfg, n))}
    top_values: dict[str, Any] = {}
    nested_values: dict[str, dict[str, Any]] = {n: {} for n in nested}
    for key, value in overrides.items():
        if key in _SLOTS:
            raise ConfigError(
                f"model.overrides cannot set '{key}'; use --model.{key} {value} instead."
            )
        if key in nested:
            raise ConfigError(
                f"model.overrides: set {key} fields one by one as '{key}.<field>', e.g. "
                f"'{next(leaf for leaf, n in leaves.items() if n == key)}'. Fields: "
                f"{', '.join(sorted(leaf for leaf, n in leaves.items() if n == key))}."
            )
        if key in top:
            top_values[key] = _check_type(key, value, hints[key])
        elif key in leaves:
            parent, leaf = leaves[key], key.split(".", 1)[1]
            leaf_hints = typing.get_type_hints(type(getattr(cfg, parent)))
            nested_values[parent][leaf] = _check_type(key, value, leaf_hints[leaf])
        else:
            known = top | set(leaves)
            raise ConfigError(
                f"Unknown model override '{key}'.{did_you_mean(key, known)} "
                f"Overridable fields: {', '.join(sorted(known))}."
            )
    for parent, values in nested_values.items():
        if values:
            top_values[parent] = replace(getattr(cfg, parent), **values)
    return replace(cfg, **top_values)


def _check_type(key: str, value: Any, expected: Any) -> Any:
    """``value`` if it fits ``expected`` (ints are accepted for floats), else ConfigError."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(
            f"model.overrides '{key}' must be one of {', '.join(map(repr, args))}, got {value!r}."
            + (did_you_mean(value, args) if isinstance(value, str) else "")
        )
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (expected,) = [a for a in args if a is not type(None)]
        return _check_type(key, value, expected)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list
        if isinstance(value, list | tuple):
            return tuple(_check_type(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        raise ConfigError(f"model.overrides '{key}' must be a list, got {value!r}.")
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"model.overrides '{key}' must be {expected.__name__}, "
        f"got {type(value).__name__} {value!r}."
    )
