"""Rotary position embeddings (RoPE, Su et al. 2021) with Llama 3 and YaRN frequency scaling.

Layout: the Hugging Face "rotate half" convention. Channel ``i`` of a head is rotated together
with channel ``i + head_dim / 2`` by the angle ``position * inv_freq[i]``, so checkpoints
published for ``transformers`` load without permuting q/k weights.

cos/sin are computed on the fly from a ``positions`` tensor (positions may restart at every
document of a packed row), in fp32. No buffers are kept, so a model built on the ``meta``
device needs no special care after ``to_empty``. The rotation itself (``apply_rotary``) lives in
torchloom/kernels/rope.py next to its fused Triton variant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.kernels.batch_invariant import pointwise
from torchloom.kernels.rope import apply_rotary, apply_rotary_fused

RopeScaling = Literal["none", "llama3", "yarn"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies and their long-context scaling."""

    theta: float = 10000.0
    """Base of the geometric frequency ladder: inv_freq[i] = theta ** (-2i / head_dim)."""
    scaling: RopeScaling = "none"
    """Frequency scaling for long context: 'none', 'llama3' (Llama 3.1) or 'yarn' (YaRN)."""
    factor: float = 1.0
    """Context extension factor (llama3, yarn): low frequencies are divided by it."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_seq_len / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_seq_len / high_freq_factor are left unscaled."""
    original_max_seq_len: int = 8192
    """llama3, yarn: the context length the model was pre-trained with before extension."""
    beta_fast: float = 32.0
    """yarn: rotations over the original context above which a frequency is not interpolated."""
    beta_slow: float = 1.0
    """yarn: rotations over the original context below which a frequency is fully interpolated."""
    mscale: float = 1.0
    """yarn: scales log(factor) in the attention factor (used only with mscale_all_dim)."""
    mscale_all_dim: float = 0.0
    """yarn: when non-zero, attention factor = mscale(factor, mscale) / mscale(factor, this)."""
    attention_factor: float | None = None
    """yarn: multiplier applied to cos/sin; None derives it from factor (0.1 ln(factor) + 1)."""
    truncate: bool = True
    """yarn: round the interpolation ramp bounds to whole dimensions (as the paper's code)."""

    def validate(self) -> None:
        """Raise ConfigError for values no formula accepts."""
        options = get_args(RopeScaling)
        if self.scaling not in options:
            raise ConfigError(
                f"Unknown rope scaling '{self.scaling}'.{did_you_mean(self.scaling, options)} "
                f"Choose one of {', '.join(options)}."
            )
        if self.theta <= 0 or self.factor <= 0 or self.original_max_seq_len <= 0:
            raise ConfigError(
                "rope.theta, rope.factor and rope.original_max_seq_len must be positive, "
                f"got {self.theta}, {self.factor}, {self.original_max_seq_len}."
            )
        if self.scaling == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"rope.low_freq_factor ({self.low_freq_factor}) must be smaller than "
                f"rope.high_freq_factor ({self.high_freq_factor}) for llama3 scaling."
            )
        if self.scaling == "yarn" and not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ConfigError(
                f"rope.beta_fast ({self.beta_fast}) and rope.beta_slow ({self.beta_slow}) "
                "must be positive for yarn scaling."
            )


def inverse_frequencies(
    cfg: RopeConfig, head_dim: int, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """Per-pair rotation speeds ``inv_freq_F`` (F = head_dim / 2, fp32) and the cos/sin scale."""
    exponent_F = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    theta_pow_F = cfg.theta**exponent_F
    inv_freq_F = 1.0 / theta_pow_F
    if cfg.scaling == "llama3":
        return _llama3_scaled(cfg, inv_freq_F), 1.0
    if cfg.scaling == "yarn":
        return _yarn_scaled(cfg, theta_pow_F, head_dim), _yarn_attention_factor(cfg)
    return inv_freq_F, 1.0


def _llama3_scaled(cfg: RopeConfig, inv_freq_F: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by factor, blend smoothly in between."""
    low_freq_wavelen = cfg.original_max_seq_len / cfg.low_freq_factor
    high_freq_wavelen = cfg.original_max_seq_len / cfg.high_freq_factor
    wavelen_F = 2 * math.pi / inv_freq_F
    scaled_F = torch.where(wavelen_F > low_freq_wavelen, inv_freq_F / cfg.factor, inv_freq_F)
    smooth_F = (cfg.original_max_seq_len / wavelen_F - cfg.low_freq_factor) / (
        cfg.high_freq_factor - cfg.low_freq_factor
    )
    smoothed_F = (1 - smooth_F) * scaled_F / cfg.factor + smooth_F * scaled_F
    is_medium_F = (wavelen_F >= high_freq_wavelen) & (wavelen_F <= low_freq_wavelen)
    return torch.where(is_medium_F, smoothed_F, scaled_F)


def _yarn_scaled(cfg: RopeConfig, theta_pow_F: torch.Tensor, head_dim: int) -> torch.Tensor:
    """YaRN (Peng et al. 2023): interpolate slow pairs, extrapolate fast ones, linear ramp between."""

    def pair_index_for(rotations: float) -> float:
        # The (fractional) pair index whose wavelength fits `rotations` times in the old context.
        return (head_dim * math.log(cfg.original_max_seq_len / (rotations * 2 * math.pi))) / (
            2 * math.log(cfg.theta)
        )

    low, high = pair_index_for(cfg.beta_fast), pair_index_for(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    pair_F = torch.arange(head_dim // 2, dtype=torch.float32, device=theta_pow_F.device)
    extrapolate_F = 1 - torch.clamp((pair_F - low) / (high - low), 0, 1)
    interpolated_F = 1.0 / (cfg.factor * theta_pow_F)
    extrapolated_F = 1.0 / theta_pow_F
    return interpolated_F * (1 - extrapolate_F) + extrapolated_F * extrapolate_F


def _yarn_attention_factor(cfg: RopeConfig) -> float:
    """YaRN's cos/sin multiplier, which sharpens attention as the context grows."""
    if cfg.attention_factor is not None:
        return cfg.attention_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return yarn_mscale(cfg.factor, cfg.mscale) / yarn_mscale(cfg.factor, cfg.mscale_all_dim)
    return yarn_mscale(cfg.factor)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention sharpening for a context extended ``factor`` times: 0.1 m ln(factor) + 1
    (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    """Maps token positions to the cos/sin tables that `apply_rotary` consumes."""

    def __init__(self, cfg: RopeConfig, head_dim: int, batch_invariant: bool = False) -> None:
        """``batch_invariant``: take cos and sin through ``batch_invariant.pointwise``, so a
        position's values do not depend on the other positions of the call (on the CPU)."""
        super().__init__()
        self.cfg = cfg
        self.head_dim = head_dim
        self.batch_invariant = batch_invariant

    def forward(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_BTd, sin_BTd in fp32, each pair's angle repeated in both halves of head_dim."""
        inv_freq_F, scale = inverse_frequencies(self.cfg, self.head_dim, positions_BT.device)
        return self.tables(positions_BT[..., None].float() * inv_freq_F, scale)

    def tables(self, angles_BTF: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every pair's angle, repeated in both halves of head_dim, times scale."""
        angles_BTd = torch.cat((angles_BTF, angles_BTF), dim=-1)
        if self.batch_invariant:
            cos_BTd, sin_BTd = (pointwise(f, angles_BTd) for f in (torch.cos, torch.sin))
        else:
            cos_BTd, sin_BTd = angles_BTd.cos(), angles_BTd.sin()
        return cos_BTd * scale, sin_BTd * scale


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL's M-RoPE, in Qwen3-VL's interleaved layout): a token has a
    (t, h, w) position, and each frequency pair turns by one of the three. Pair f follows h when
    f % 3 == 1 and f < 3 * sections[1], w when f % 3 == 2 and f < 3 * sections[2], and t
    otherwise, so every axis gets low and high frequencies. Text tokens hold the same position
    on all three axes, which makes this plain RoPE; ``[B, T]`` positions are read that way."""

    def __init__(
        self,
        cfg: RopeConfig,
        head_dim: int,
        sections: tuple[int, int, int],
        batch_invariant: bool = False,
    ) -> None:
        """``sections``: frequency pairs per axis (t, h, w), summing to head_dim / 2."""
        super().__init__(cfg, head_dim, batch_invariant)
        self.sections = tuple(sections)

    def axis_of_pairs(self, device: torch.device | None = None) -> torch.Tensor:
        """The position axis (0 t, 1 h, 2 w) each frequency pair turns by, int64 [head_dim/2]."""
        pair_F = torch.arange(self.head_dim // 2, device=device)
        axis_F = torch.zeros_like(pair_F)
        for axis in (1, 2):
            axis_F[(pair_F % 3 == axis) & (pair_F < 3 * self.sections[axis])] = axis
        return axis_F

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_BTd, sin_BTd of positions ``[B, T, 3]`` (t, h, w) or ``[B, T]`` (text)."""
        if positions.dim() == 2:
            return super().forward(positions)
        inv_freq_F, scale = inverse_frequencies(self.cfg, self.head_dim, positions.device)
        axis_BTF = self.axis_of_pairs(positions.device).expand(*positions.shape[:2], -1)
        return self.tables(positions.gather(-1, axis_BTF).float() * inv_freq_F, scale)


ROPE_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch": apply_rotary,
    "triton": apply_rotary_fused,
}
"""Named ways to apply the rotation (the ``rope_impl`` slot), each ``(x_BTHd, cos_BTd, sin_BTd)
-> x rotated``: the PyTorch reference, or the fused Triton kernel (on CUDA; the reference
elsewhere)."""
