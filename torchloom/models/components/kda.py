"""Kimi Delta Attention (KDA; Kimi Linear, arXiv 2510.26692): the gated delta rule with a forget
gate per key channel, the linear-attention token mixer of Kimi Linear (mixer kind ``kda``).

Per token x (module names are those of Kimi Linear's checkpoints, so its weights load under
the same names):

- ``q_proj``, ``k_proj``, ``v_proj`` (``num_heads * head_dim`` each), each through its short
  causal depthwise convolution (``q_conv1d``, ``k_conv1d``, ``v_conv1d``, ``conv_size`` taps)
  and SiLU; q and k L2-normalised per head;
- the forget gate, a log decay per head and key channel:
  ``g = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (a low-rank projection);
- the update strength ``beta = sigmoid(b_proj(x))``, one per head;
- the gated delta rule (kernels/delta_rule.py) with scale head_dim^-1/2;
- each head's output RMS-normed and gated, ``o_norm(o) * sigmoid(g_b_proj(g_a_proj(x)))``,
  then ``o_proj``.

Training runs the chunked delta rule over whole rows; in packed rows the recurrence and the
convolutions start afresh at every document (the delta rule's and ``causal_conv1d``'s document
ids, as Gated DeltaNet's; fla's kernels take the documents as variable-length sequences).
Generation keeps, per slot, the recurrent state [heads, head_dim, head_dim] (fp32) and
the last ``conv_size - 1`` convolution inputs (``RecurrentState``, models/components/cache.py,
as Gated DeltaNet's): a prefill runs the chunked rule from the slot's state, a decode step the
one-token update.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from torchloom.config.errors import ConfigError
from torchloom.kernels import batch_invariant
from torchloom.kernels.delta_rule import delta_rule
from torchloom.models.components.cache import BoundRecurrent, RecurrentState
from torchloom.models.components.head_parallel import (
    HeadParallel,
    ReplicatedModule,
    local_shard,
    shared_by_heads,
)
from torchloom.models.components.linear_attention import causal_conv1d, document_ids
from torchloom.models.components.param_init import ParamInit, local_tensor


class SigmoidGatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, times sigmoid(gate); in fp32, cast back at the end."""

    def __init__(self, dim: int, eps: float, invariant: bool = False) -> None:
        super().__init__()
        self.eps, self.invariant = eps, invariant
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.invariant:  # the same fp32 arithmetic in a fixed order (batch-invariant mode)
            weight = shared_by_heads(self.weight).float()
            normed = batch_invariant.rms_norm(x.float(), weight, self.eps)
            return (normed * batch_invariant.pointwise(torch.sigmoid, gate.float())).to(x.dtype)
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = shared_by_heads(self.weight)  # under tp, applied to this rank's heads only
        return (weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)

    def init_weights(self, init: ParamInit) -> None:
        init.ones_(self.weight)


class KimiDeltaAttention(nn.Module):
    """KDA with the forward of the other token mixers: ``(x_BTD, cos_BTd, sin_BTd, doc_ids_BT,
    cache=None)``; it uses no position tables (the recurrence orders the tokens).

    Head counts are read from the local projection shapes in forward, so a tensor-parallel
    rank holding a share of the heads (``tp_plan``) runs the same code."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int,
        conv_size: int = 4,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        out_std: float | None = None,
        invariant: bool = False,
    ) -> None:
        """``invariant``: batch-invariant mode, every op in a fixed order (the delta rule token
        by token, kernels/batch_invariant.py), as GatedDeltaNet does."""
        super().__init__()
        self.num_heads, self.head_dim, self.conv_size = num_heads, head_dim, conv_size
        self.invariant = invariant
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        width = num_heads * head_dim
        self.q_proj = nn.Linear(dim, width, bias=False)
        self.k_proj = nn.Linear(dim, width, bias=False)
        self.v_proj = nn.Linear(dim, width, bias=False)
        # Depthwise, causal (left-padded in forward): weights [width, 1, conv_size].
        self.q_conv1d = nn.Conv1d(width, width, conv_size, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, conv_size, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, conv_size, groups=width, bias=False)
        self.f_a_proj = nn.Linear(dim, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1))  # the checkpoints' layout
        self.b_proj = nn.Linear(dim, num_heads, bias=False)
        self.g_a_proj = nn.Linear(dim, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, norm_eps, invariant)
        self.o_proj = nn.Linear(width, dim, bias=False)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor | None = None,
        sin_BTd: torch.Tensor | None = None,
        doc_ids_BT: Any = None,
        cache: BoundRecurrent | None = None,
    ) -> torch.Tensor:
        """With ``doc_ids_BT`` (packed rows) every document starts from a zero state and its
        convolutions see only its own tokens. With ``cache`` (generation) the rows continue
        their slots' states (a row at position 0 starts afresh) and leave them there."""
        doc_ids_BT = document_ids(doc_ids_BT, "Kimi Delta Attention layers")
        B, T, _ = x_BTD.shape
        d = self.head_dim
        qkv_BTC = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], -1)
        H = qkv_BTC.shape[-1] // (3 * d)  # this rank's heads
        weight_C1W = torch.cat(
            [local_shard(c.weight) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        )
        fixed = self.invariant
        if cache is None:
            qkv_BTC = causal_conv1d(qkv_BTC, weight_C1W, doc_ids_BT, fixed_order=fixed)
        else:
            qkv_BTC = cache.convolve(qkv_BTC, weight_C1W, fixed_order=fixed)
        qkv_BTC = batch_invariant.pointwise(F.silu, qkv_BTC) if fixed else F.silu(qkv_BTC)
        q_BTHd, k_BTHd, v_BTHd = (t.view(B, T, H, d) for t in qkv_BTC.chunk(3, dim=-1))
        g_BTHd = self.forget_gate(x_BTD)
        b_BTH = self.b_proj(x_BTD).float()
        beta_BTH = batch_invariant.pointwise(torch.sigmoid, b_BTH) if fixed else b_BTH.sigmoid()
        # q and k are L2-normalised per head by the delta rule (by fla inside its kernels).
        if cache is not None:
            o_BTHd = cache.delta_rule(
                q_BTHd, k_BTHd, v_BTHd, g_BTHd, beta_BTH, normalize_qk=True, fixed_order=fixed
            )
        else:
            o_BTHd, _ = delta_rule(
                q_BTHd, k_BTHd, v_BTHd, g_BTHd, beta_BTH, impl="fixed_order" if fixed else "auto",
                doc_ids_BT=doc_ids_BT, normalize_qk=True,
            )  # fmt: skip
        gate_BTHd = self.g_b_proj(self.g_a_proj(x_BTD)).view(B, T, H, d)
        o_BTHd = self.o_norm(o_BTHd.to(x_BTD.dtype), gate_BTHd)
        return self.o_proj(o_BTHd.reshape(B, T, H * d))

    def forget_gate(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Log decay per head and key channel, [B, T, H, head_dim] fp32 (<= 0)."""
        B, T, _ = x_BTD.shape
        raw = self.f_b_proj(self.f_a_proj(x_BTD)).float() + local_shard(self.dt_bias).float()
        # softplus, taken as the identity above 20 (as FLA and transformers do)
        raw_BTHd = raw.view(B, T, -1, self.head_dim)
        A_log = local_shard(self.A_log).float()
        if self.invariant:  # the transcendental ops through pointwise (batch-invariant mode)
            softplus = batch_invariant.pointwise(F.softplus, raw_BTHd)
            return -batch_invariant.pointwise(torch.exp, A_log) * softplus
        softplus = torch.where(raw_BTHd > 20.0, raw_BTHd, torch.log1p(torch.exp(raw_BTHd)))
        return -torch.exp(A_log) * softplus

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> RecurrentState:
        """This layer's generation state: per slot the fp32 recurrent state of the heads this
        rank holds and the last conv_size - 1 convolution inputs (its size does not grow with
        max_len)."""
        d = self.head_dim
        heads = local_shard(self.q_conv1d.weight).shape[0] // d
        return RecurrentState(slots, 3 * heads * d, self.conv_size, heads, d, d, device, dtype)

    @torch.no_grad()
    def init_weights(self, init: ParamInit) -> None:
        """Projections normal truncated at 3 std (o_proj at out_std); convolutions uniform in
        +-1/sqrt(conv_size) (PyTorch's Conv1d default); FLA's gate init: exp(A_log) uniform in
        [1, 16] and softplus(dt_bias) log-uniform in [1e-3, 1e-1]; the norm at one."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.f_b_proj,
                     self.b_proj, self.g_a_proj, self.g_b_proj):  # fmt: skip
            init.trunc_normal_(proj.weight, self.init_std)
        init.trunc_normal_(self.o_proj.weight, self.out_std)
        bound = 1 / math.sqrt(self.conv_size)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            init.uniform_(conv.weight, -bound, bound)
        init.uniform_(self.A_log, 1.0, 16.0)
        local_tensor(self.A_log).log_()
        init.uniform_(self.dt_bias, math.log(1e-3), math.log(1e-1))
        dt = local_tensor(self.dt_bias).exp().clamp_min(1e-4)
        local_tensor(self.dt_bias).copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
        self.o_norm.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per weight (projections and convolution taps), plus the
        recurrence's three head_dim x head_dim products per head (k^T S, the rank-one update,
        q^T S) at 2 FLOPs each, times 3 for forward and backward; independent of seq_len."""
        weights = sum(p.numel() for name, p in self.named_parameters()
                      if name.endswith("weight") and "norm" not in name)  # fmt: skip
        return 6 * weights + 18 * self.num_heads * self.head_dim * self.head_dim

    def check_tp(self, tp: int) -> None:
        """ConfigError unless ``tp`` divides the heads (each rank takes whole heads)."""
        if self.num_heads % tp:
            raise ConfigError(
                f"--parallel.tp {tp} does not divide the model's KDA heads ({self.num_heads}): "
                "every tensor-parallel rank must hold whole heads. Choose a tp that divides "
                f"{self.num_heads}."
            )

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """Heads split: q/k/v, b, and the gates' second (per-channel) projections column-wise,
        the convolutions and dt_bias by rows and A_log by head, o_proj row-wise. The gates'
        low-rank first projections are replicated (their gradients are whole on every rank:
        the column-wise layers after them sum their input's gradient), and so is the output
        norm's weight (its gradient summed over tp). With ``sequence_parallel`` the input is
        gathered first and o_proj's output scattered back along the sequence."""
        rows = Shard(0)
        colwise = ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_b_proj")
        return {
            "": HeadParallel(
                {"q_conv1d.weight": rows, "k_conv1d.weight": rows, "v_conv1d.weight": rows,
                 "dt_bias": rows, "A_log": Shard(2), "o_norm.weight": Replicate()},
                gather_input=sequence_parallel,
            ),
            **{name: ColwiseParallel() for name in colwise},
            "f_a_proj": ReplicatedModule(),
            "g_a_proj": ReplicatedModule(),
            "o_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel
            else RowwiseParallel(),
        }  # fmt: skip
