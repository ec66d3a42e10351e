"""A learned gate joining a branch to the residual stream (Muse Spark), in place of the sum:

    beta = sigmoid(g / t),  alpha = sqrt(max(sigmoid(-g / t) * (1 + beta), eps)),
    x' = alpha * x + beta * branch,

per channel, with g a learned vector (kept and computed in fp32) and t a temperature. A block
installs it through its config's ``make_residual`` (models/components/decoder.py).
"""

from __future__ import annotations

import torch
from torch import nn

from torchloom.models.components.param_init import ParamInit


class ResidualGate(nn.Module):
    """``forward(x_BTD, branch_BTD)``: alpha * x + beta * branch (module docstring)."""

    def __init__(
        self, dim: int, temperature: float, init_std: float = 0.02, eps: float = 1e-3
    ) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(dim))
        self.temperature, self.init_std, self.eps = temperature, init_std, eps

    def forward(self, x_BTD: torch.Tensor, branch_BTD: torch.Tensor) -> torch.Tensor:
        w_D = self.gate.float() / self.temperature
        beta_D = torch.sigmoid(w_D)
        alpha_D = torch.sqrt(torch.clamp(torch.sigmoid(-w_D) * (1.0 + beta_D), min=self.eps))
        return (alpha_D * x_BTD + beta_D * branch_BTD).to(x_BTD.dtype)

    def init_weights(self, init: ParamInit) -> None:
        """normal(0, init_std), as transformers initializes it."""
        init.normal_(self.gate, self.init_std)

    def extra_repr(self) -> str:
        return f"{self.gate.shape[0]}, temperature={self.temperature}"
