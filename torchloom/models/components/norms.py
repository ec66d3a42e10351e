"""RMSNorm (Zhang & Sennrich 2019) and the registry of its implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


NORM_IMPLS: dict[str, type[nn.Module]] = {"torch": RMSNorm}
"""Named RMSNorm implementations (the ``norm_impl`` slot). Each is built as ``cls(dim, eps)``,
owns a ``weight`` of shape [dim] and a ``reset_parameters()``; fused kernels register here."""
