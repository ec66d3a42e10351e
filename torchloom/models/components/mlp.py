"""SwiGLU feed-forward (Shazeer 2020), as used by Llama and Qwen."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); no biases."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))
