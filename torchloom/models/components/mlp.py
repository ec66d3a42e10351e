"""SwiGLU feed-forward (Shazeer 2020), as used by Llama and Qwen."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchloom.kernels import batch_invariant
from torchloom.kernels.swiglu import swiglu, swiglu_fused

MLP_IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch": swiglu,
    "triton": swiglu_fused,
    "batch_invariant": batch_invariant.swiglu,
}
"""Named implementations of the gate silu(gate) * up between the linears (the ``mlp_impl``
slot): the PyTorch reference, the fused Triton kernel (on CUDA; the reference elsewhere), or
batch-invariant mode's (the Triton kernel on CUDA; elsewhere a silu whose every element takes
the same code path)."""


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); no biases."""

    def __init__(self, dim: int, ffn_dim: int, impl: str = "torch") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)
        self.gated = MLP_IMPLS[impl]

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(self.gate_proj(x_BTD), self.up_proj(x_BTD)))
