"""Model-config transforms: named pure functions DecoderConfig -> DecoderConfig.

A job lists them in ``model.transforms``; they run in order after the flavor, the overrides and
the component slots are applied. A transform returns a new config (``dataclasses.replace``)
and never mutates its input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.models.components.decoder import DecoderConfig

Transform = Callable[[DecoderConfig], DecoderConfig]

_TRANSFORMS: dict[str, Transform] = {}


def register_transform(name: str) -> Callable[[Transform], Transform]:
    """Decorator: make ``fn`` available as ``--model.transforms '["name"]'``."""

    def register(fn: Transform) -> Transform:
        if name in _TRANSFORMS:
            raise ValueError(f"model transform '{name}' is already registered")
        _TRANSFORMS[name] = fn
        return fn

    return register


def apply_transforms(cfg: DecoderConfig, names: Iterable[str]) -> DecoderConfig:
    """Apply the named transforms in order."""
    if isinstance(names, str):  # iterating it would apply one transform per character
        raise TypeError(f"model transforms must be a list of names; got the string {names!r}.")
    for name in names:
        if name not in _TRANSFORMS:
            raise ConfigError(
                f"Unknown model transform '{name}'.{did_you_mean(name, _TRANSFORMS)} "
                f"Available: {', '.join(sorted(_TRANSFORMS))}."
            )
        cfg = _TRANSFORMS[name](cfg)
    return cfg


def list_transforms() -> list[tuple[str, str]]:
    """(name, first line of its docstring) for every transform, sorted by name."""
    return [
        (name, (_TRANSFORMS[name].__doc__ or "").strip().split("\n")[0])
        for name in sorted(_TRANSFORMS)
    ]


@register_transform("tie_embeddings")
def tie_embeddings(cfg: DecoderConfig) -> DecoderConfig:
    """Use the embedding matrix as the output head (saves vocab_size * dim parameters)."""
    return replace(cfg, tie_embeddings=True)


@register_transform("untie_embeddings")
def untie_embeddings(cfg: DecoderConfig) -> DecoderConfig:
    """Give the output head its own weight, separate from the embedding."""
    return replace(cfg, tie_embeddings=False)


@register_transform("flex_attention")
def flex_attention(cfg: DecoderConfig) -> DecoderConfig:
    """Run attention with FlexAttention (forward-only on CPU: it has no CPU backward)."""
    return replace(cfg, attn_backend="flex")


@register_transform("sdpa_attention")
def sdpa_attention(cfg: DecoderConfig) -> DecoderConfig:
    """Run attention with torch's scaled_dot_product_attention."""
    return replace(cfg, attn_backend="sdpa")


@register_transform("float8_rowwise")
def float8_rowwise(cfg: DecoderConfig) -> DecoderConfig:
    """Float8 training of the blocks' linears, one scale per row (torchao; GPU 8.9+)."""
    return replace(cfg, float8="rowwise")


@register_transform("float8_tensorwise")
def float8_tensorwise(cfg: DecoderConfig) -> DecoderConfig:
    """Float8 training of the blocks' linears, one scale per tensor (torchao; GPU 8.9+)."""
    return replace(cfg, float8="tensorwise")


@register_transform("triton_kernels")
def triton_kernels(cfg: DecoderConfig) -> DecoderConfig:
    """Fused Triton RMSNorm, RoPE and SwiGLU kernels on CUDA (PyTorch elsewhere; no tp > 1)."""
    return replace(cfg, norm_impl="triton", rope_impl="triton", mlp_impl="triton")
