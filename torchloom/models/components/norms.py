"""RMSNorm (Zhang & Sennrich 2019) and the registry of its implementations."""

from __future__ import annotations

import torch
from torch import nn

from torchloom.kernels import batch_invariant
from torchloom.kernels.rmsnorm import rms_norm, rms_norm_fused
from torchloom.models.components.param_init import ParamInit


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def init_weights(self, init: ParamInit) -> None:
        init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class TritonRMSNorm(RMSNorm):
    """The same RMSNorm (same parameter, same numbers up to rounding) by the fused Triton
    kernels on CUDA; the PyTorch reference elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fused(x, self.weight, self.eps)


class BatchInvariantRMSNorm(RMSNorm):
    """The same RMSNorm with each row's statistics in a fixed order: the Triton kernel on CUDA,
    a fixed-order reference elsewhere (torchloom/kernels/batch_invariant.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant.rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32 and cast back once: the weight is stored as its
    offset from one, so it starts at zero (Qwen3-Next, Qwen3.5, Gemma 3). ``impl`` names the
    kernel as NORM_IMPLS does."""

    def __init__(self, dim: int, eps: float = 1e-6, impl: str = "torch") -> None:
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = _NORM_FUNCTIONS[self.impl]
        return norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)

    def init_weights(self, init: ParamInit) -> None:
        init.zeros_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero-centered"


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32, cast back to x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class WeightlessRMSNorm(nn.Module):
    """x / rms(x) in fp32, cast back: an RMSNorm without a learned scale (no parameters)."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalized(x, self.eps)

    def init_weights(self, init: ParamInit) -> None:
        """Nothing to initialize."""

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weightless"


class ScaleThenNormRMSNorm(ZeroCenteredRMSNorm):
    """(1 + weight) * x, rounded to x's dtype, then divided by its rms: the scale comes before
    the normalization (Muse Spark's post-feed-forward and expert-output norms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = (x.float() * (1.0 + self.weight.float())).to(x.dtype)
        return normalized(scaled, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, scale then normalize"


_NORM_FUNCTIONS = {
    "torch": rms_norm,
    "triton": rms_norm_fused,
    "batch_invariant": batch_invariant.rms_norm,
}

NORM_IMPLS: dict[str, type[nn.Module]] = {
    "torch": RMSNorm,
    "triton": TritonRMSNorm,
    "batch_invariant": BatchInvariantRMSNorm,
}
"""Named RMSNorm implementations (the ``norm_impl`` slot). Each is built as ``cls(dim, eps)``,
owns a ``weight`` of shape [dim], ``reset_parameters()`` and ``init_weights(ParamInit)``; fused
kernels register here."""
