"""SwiGLU feed-forward (Shazeer 2020), as used by Llama and Qwen; the plain GELU MLP of vision
and audio encoders."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from torchloom.config.errors import ConfigError
from torchloom.kernels import batch_invariant
from torchloom.kernels.swiglu import swiglu, swiglu_fused
from torchloom.models.components.fused_linear import fuse_linears
from torchloom.models.components.param_init import ParamInit

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

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        impl: str = "torch",
        init_std: float = 0.02,
        out_std: float | None = None,
    ) -> None:
        """``init_std``: gate and up; ``out_std``: down, the residual branch's output (default
        init_std)."""
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)
        self.gated = MLP_IMPLS[impl]
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        self.gate_up: torch.Tensor | None = None  # gate and up stacked (fuse_projections)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or torch.is_grad_enabled():  # gate_up is no parameter
            return self.down_proj(self.gated(self.gate_proj(x_BTD), self.up_proj(x_BTD)))
        invariant = self.gated is MLP_IMPLS["batch_invariant"]
        matmul = batch_invariant.linear if invariant else F.linear
        gate_BTF, up_BTF = matmul(x_BTD, self.gate_up).chunk(2, -1)
        return self.down_proj(self.gated(gate_BTF, up_BTF))

    def fuse_projections(self) -> bool:
        """From now on run gate and up as one matmul over their stacked weights
        (fused_linear.py); whether it did. In batch-invariant mode only where that changes no
        bit of gate and up (``batch_invariant.stacking_keeps_bits``)."""
        if self.gate_up is not None:
            return False
        invariant = self.gated is MLP_IMPLS["batch_invariant"]
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj], invariant)
        return self.gate_up is not None

    def init_weights(self, init: ParamInit) -> None:
        """Normal weights truncated at 3 std."""
        init.trunc_normal_(self.gate_proj.weight, self.init_std)
        init.trunc_normal_(self.up_proj.weight, self.init_std)
        init.trunc_normal_(self.down_proj.weight, self.out_std)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per weight of the three matmuls (2 forward, 4 backward)."""
        return 6 * 3 * self.gate_proj.weight.numel()

    def check_tp(self, tp: int) -> None:
        """ConfigError unless ``tp`` divides the hidden width."""
        ffn_dim = self.gate_proj.weight.shape[0]
        if ffn_dim % tp:
            raise ConfigError(
                f"--parallel.tp {tp} does not divide the model's ffn_dim ({ffn_dim}): every "
                "tensor-parallel rank must hold a whole share of it. Choose a tp that divides it."
            )

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """gate/up split column-wise (by hidden unit), down row-wise; with
        ``sequence_parallel`` the input is gathered first and down's output scattered back."""
        if not sequence_parallel:
            return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                    "down_proj": RowwiseParallel()}  # fmt: skip
        return {
            "": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
            "gate_proj": ColwiseParallel(),
            "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }  # fmt: skip


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))) with biases (exact GELU): the feed-forward of ViT-style encoders."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
