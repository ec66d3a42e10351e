"""Muse Spark's audio encoder: a causal convolutional pyramid over the raw mono waveform (no
spectrogram, no attention). Each stage folds ``patch_size`` steps into one (a linear over the
patch, then RMSNorm) and runs depthwise causal-conv blocks; after the last stage a projection to
the text width. At 24 kHz the default pyramid (16 * 6 * 5 * 4 = 1920 samples) gives one token
per 80 ms.

It is the ``AudioEncoder`` of models/components/multimodal.py.

Fixed shapes: ``audio_values`` ``[B, A, S, 1]`` (A clip slots per row, S samples, a multiple of
samples_per_token; mono as the feature extractor emits it) and ``audio_lengths`` ``[B, A]``
(0 = absent). Samples past a clip's length are zeroed (the feature extractor's padding value),
and since every operation looks only backwards in time, a clip padded on the right gives its
valid tokens exactly the values it has alone. ``audio_output_lengths`` says how many of the
``S / samples_per_token`` output tokens of each clip are its <|audio|> tokens.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.models.components.mlp import GeluMLP
from torchloom.models.components.param_init import ParamInit


@dataclass(frozen=True)
class MuseAudioConfig:
    """The conv pyramid and its projection into the text model's embedding space."""

    patch_sizes: tuple[int, ...] = (16, 6, 5, 4)
    """Steps each stage folds into one; their product is the samples per output token."""
    hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    """Channels of each stage."""
    depths: tuple[int, ...] = (2, 2, 2, 2)
    """Conv blocks per stage."""
    mlp_ratio: float = 4.0
    """A block's MLP hidden width over its channels."""
    conv_kernel_size: int = 7
    """Taps of the depthwise causal convolutions."""
    norm_eps: float = 1e-6
    """Epsilon of the encoder's RMSNorms."""
    text_dim: int = 8192
    """Width of the text model the features are scattered into."""
    text_norm_eps: float = 1e-5
    """Epsilon of the scale-free RMSNorm applied last (the text embedding's norm)."""
    init_std: float = 0.02
    """Std of the initial weights."""

    @property
    def samples_per_token(self) -> int:
        return math.prod(self.patch_sizes)

    def validate(self) -> None:
        stages = {len(self.patch_sizes), len(self.hidden_sizes), len(self.depths)}
        if len(stages) != 1 or not self.patch_sizes:
            raise ConfigError(
                "audio patch_sizes, hidden_sizes and depths need one entry per stage, got "
                f"{len(self.patch_sizes)}, {len(self.hidden_sizes)} and {len(self.depths)}."
            )
        sizes = (*self.patch_sizes, *self.hidden_sizes, self.conv_kernel_size, self.text_dim)
        if min(sizes) <= 0 or min(self.depths) < 0 or self.mlp_ratio <= 0:
            raise ConfigError("audio sizes, depths and mlp_ratio must be positive.")


class MuseRMSNorm(nn.Module):
    """x / rms(x) * weight in fp32, cast back once (Muse's norm; ``dim=None``: no weight)."""

    def __init__(self, dim: int | None, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if dim is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)


class AudioConvBlock(nn.Module):
    """x + mlp(norm(causal_depthwise_conv(x))) over [I, T, C]."""

    def __init__(self, channels: int, kernel_size: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels)
        self.norm = MuseRMSNorm(channels, eps)
        self.mlp = GeluMLP(channels, int(channels * mlp_ratio))

    def forward(self, x_ITC: torch.Tensor) -> torch.Tensor:
        # Left padding only: step t reads steps t - k + 1 .. t.
        h_ICT = self.conv(F.pad(x_ITC.transpose(1, 2), (self.conv.kernel_size[0] - 1, 0)))
        return x_ITC + self.mlp(self.norm(h_ICT.transpose(1, 2)))


class AudioStage(nn.Module):
    """Fold ``patch_size`` steps into one (linear + RMSNorm), then the stage's conv blocks."""

    def __init__(self, cfg: MuseAudioConfig, index: int) -> None:
        super().__init__()
        channels_in = 1 if index == 0 else cfg.hidden_sizes[index - 1]
        channels = cfg.hidden_sizes[index]
        self.patch_size = cfg.patch_sizes[index]
        self.patch_proj = nn.Linear(channels_in * self.patch_size, channels)
        self.patch_norm = MuseRMSNorm(channels, cfg.norm_eps)
        self.blocks = nn.ModuleList(
            AudioConvBlock(channels, cfg.conv_kernel_size, cfg.mlp_ratio, cfg.norm_eps)
            for _ in range(cfg.depths[index])
        )

    def forward(self, x_ITC: torch.Tensor) -> torch.Tensor:
        items, T, _ = x_ITC.shape
        patches = x_ITC.reshape(items, T // self.patch_size, -1)  # (step, channel) per patch
        x_ITC = self.patch_norm(self.patch_proj(patches))
        for block in self.blocks:
            x_ITC = block(x_ITC)
        return x_ITC


class MuseAudioEncoder(nn.Module):
    """audio_values [B, A, S, 1] + audio_lengths [B, A] -> features [B, A, S / spt, text_dim]."""

    def __init__(self, cfg: MuseAudioConfig) -> None:
        super().__init__()
        self.config = cfg
        self.stages = nn.ModuleList(AudioStage(cfg, i) for i in range(len(cfg.patch_sizes)))
        self.norm = MuseRMSNorm(cfg.hidden_sizes[-1], cfg.norm_eps)
        self.proj = nn.Linear(cfg.hidden_sizes[-1], cfg.text_dim)
        self.proj_norm = MuseRMSNorm(cfg.text_dim, cfg.norm_eps)
        self.text_norm = MuseRMSNorm(None, cfg.text_norm_eps)

    def forward(self, audio_values: torch.Tensor, audio_lengths: torch.Tensor) -> torch.Tensor:
        B, A, S, F_ = audio_values.shape
        spt = self.config.samples_per_token
        if F_ != 1 or S % spt:
            raise ValueError(
                f"audio_values [B, A, S, F] = {tuple(audio_values.shape)}: F must be 1 (mono) "
                f"and S a multiple of samples_per_token ({spt})."
            )
        lengths_I = audio_lengths.reshape(B * A)
        inside_IS = torch.arange(S, device=audio_values.device) < lengths_I[:, None]
        x_ITC = torch.where(inside_IS[..., None], audio_values.reshape(B * A, S, 1), 0.0)
        x_ITC = x_ITC.to(self.proj.weight.dtype)
        for stage in self.stages:
            x_ITC = stage(x_ITC)
        out_ITD = self.text_norm(self.proj_norm(self.proj(self.norm(x_ITC))))
        step_T = torch.arange(S // spt, device=out_ITD.device)
        valid_IT = step_T < self.audio_output_lengths(lengths_I)[:, None]
        out_ITD = torch.where(valid_IT[..., None], out_ITD, 0.0)
        return out_ITD.view(B, A, S // spt, -1)

    def audio_output_lengths(self, audio_lengths: torch.Tensor) -> torch.Tensor:
        """Tokens each clip gives the text: ceil(samples / samples_per_token); 0 when absent."""
        return (audio_lengths + self.config.samples_per_token - 1) // self.config.samples_per_token

    def init_weights(self, init: ParamInit) -> None:
        """Linear and conv weights: truncated normal(0, init_std); biases 0; norm weights 1."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d)):
                init.trunc_normal_(module.weight, self.config.init_std)
                init.zeros_(module.bias)
            elif isinstance(module, MuseRMSNorm) and module.weight is not None:
                init.ones_(module.weight)

    def flops(self, audio_lengths: torch.Tensor) -> int:
        """Training FLOPs (6 per weight each step uses, the depthwise taps included) of the valid
        clips in ``audio_lengths``: each stage counted on the steps a clip's samples reach."""
        cfg = self.config
        total = 0
        for samples in audio_lengths.reshape(-1).tolist():
            stride, channels_in = 1, 1
            for patch, channels, depth in zip(cfg.patch_sizes, cfg.hidden_sizes, cfg.depths):
                stride *= patch
                steps = -(-samples // stride)
                mlp = 2 * channels * int(channels * cfg.mlp_ratio)
                block = channels * cfg.conv_kernel_size + mlp
                total += 6 * steps * (channels_in * patch * channels + depth * block)
                channels_in = channels
            total += 6 * -(-samples // stride) * channels_in * cfg.text_dim
        return total


# -- Hugging Face ---------------------------------------------------------------------------

_HF_RENAMES = [
    (r"^stages\.(\d+)\.patch_proj\.", r"layers.\1.patch_embedder.proj."),
    (r"^stages\.(\d+)\.patch_norm\.", r"layers.\1.patch_embedder.norm."),
    (r"^stages\.(\d+)\.blocks\.", r"layers.\1.conv_blocks."),
    (r"^proj_norm\.", "post_proj_norm."),
    (r"^(norm|proj)\.", r"\1."),
]


def muse_audio_hf_name(name: str, prefix: str = "model.audio_tower.") -> str:
    """The Hugging Face tensor (MuseSparkForConditionalGeneration) holding our parameter
    ``name``."""
    for pattern, replacement in _HF_RENAMES:
        hf, count = re.subn(pattern, replacement, name)
        if count:
            return prefix + hf
    raise KeyError(f"no Hugging Face name for audio parameter {name!r}")


def muse_audio_config_from_hf(hf: dict[str, Any], **overrides: Any) -> MuseAudioConfig:
    """Our config from a MuseSpark ``config.json`` dict (the top level), refusing by name what
    this encoder does not implement."""
    audio, text = hf["audio_config"], hf["text_config"]
    if audio["hidden_act"] != "gelu":
        raise ConfigError(f"Muse audio hidden_act {audio['hidden_act']!r} is not supported (gelu).")
    if audio["out_hidden_size"] != text["hidden_size"]:
        raise ConfigError(
            f"Muse audio out_hidden_size {audio['out_hidden_size']} must equal the text "
            f"hidden_size {text['hidden_size']}."
        )
    cfg = MuseAudioConfig(
        patch_sizes=tuple(audio["patch_sizes"]), hidden_sizes=tuple(audio["hidden_sizes"]),
        depths=tuple(audio["depths"]), mlp_ratio=audio["mlp_ratio"],
        conv_kernel_size=audio["conv_kernel_size"], norm_eps=audio["rms_norm_eps"],
        text_dim=text["hidden_size"], text_norm_eps=text["rms_norm_eps"], **overrides,
    )  # fmt: skip
    cfg.validate()
    return cfg
