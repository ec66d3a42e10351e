"""Linear-attention token mixers: Gated DeltaNet (Yang et al. 2024) as Qwen3-Next and Qwen3.5
define it.

A Gated DeltaNet layer keeps, per value head, a recurrent state S [key_dim, value_dim] updated
by the gated delta rule (torchloom/kernels/delta_rule.py) instead of attending to past keys:

- q, k, v come from one projection through a short causal depthwise convolution and SiLU;
  q and k are L2-normalised per head, and each key head serves num_v_heads / num_k_heads
  consecutive value heads;
- the decay is g = -exp(A_log) * softplus(a + dt_bias) and the write strength beta = sigmoid(b),
  with a and b one number per value head from their own projections;
- each head's output goes through an RMSNorm gated by silu(z) (z projected from the input),
  then out_proj.

Two checkpoint layouts hold the same projections. Qwen3-Next fuses them per key-head group
(``fused_projections``): in_proj_qkvz's rows are, for each key head, its q, its k, then the v
and z of its value heads; in_proj_ba's are, for each key head, the b then the a of its value
heads. The module keeps these as they are. Qwen3.5's are separate, except that its in_proj_qkv
stacks all q rows, then all k, then all v: the module holds them as in_proj_q, in_proj_k and
in_proj_v (the HF adapter reads and writes the stacked tensor). Likewise the checkpoints'
conv1d, whose channels are all q, all k, all v, is q_conv1d, k_conv1d and v_conv1d here. With
every parameter laid out by heads, tensor parallelism splits each by rows (``tp_plan``).

Generation state: ``RecurrentState`` (models/components/cache.py), the recurrent state and the
convolution's last inputs.
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
from torchloom.kernels.flash_attention4 import Fa4Documents
from torchloom.kernels.rmsnorm import rms_norm
from torchloom.models.components.cache import BoundRecurrent, RecurrentState
from torchloom.models.components.head_parallel import HeadParallel, local_shard, shared_by_heads
from torchloom.models.components.param_init import ParamInit


def document_ids(documents: Any, layers: str) -> torch.Tensor | None:
    """The document ids a linear-attention layer reads from what its model's attention kernel
    takes in their place in one forward (``shared_attention_input``): the ids themselves, or
    fa4's ``Fa4Documents``, which carries them; ConfigError for anything else (flex's block
    masks, which hold none the layer can use)."""
    if documents is None or isinstance(documents, torch.Tensor):
        return documents
    if isinstance(documents, Fa4Documents):
        return documents.doc_ids_BT
    raise ConfigError(
        f"{layers} read packed documents as ids, but the attention kernel handed them a "
        f"{type(documents).__name__}; use --model.attn_backend sdpa or fa4."
    )


def causal_conv1d(
    x_BTC: torch.Tensor,
    weight_C1W: torch.Tensor,
    doc_ids_BT: torch.Tensor | None = None,
    fixed_order: bool = False,
) -> torch.Tensor:
    """Depthwise causal convolution along T: output t sees inputs t - width + 1 .. t (with
    ``doc_ids_BT``, only those of its own document). With documents, ``fixed_order`` or under
    torch.compile it runs tap after tap as elementwise multiply-adds, which a decode step
    repeats bit for bit (``BoundRecurrent.convolve``; batch-invariant mode)."""
    width = weight_C1W.shape[-1]
    weight_C1W = weight_C1W.to(x_BTC.dtype)
    if doc_ids_BT is None and fixed_order:
        doc_ids_BT = torch.zeros(x_BTC.shape[:2], dtype=torch.long, device=x_BTC.device)
    if doc_ids_BT is None and not torch.compiler.is_compiling():
        x_BCT = F.pad(x_BTC.transpose(1, 2), (width - 1, 0))
        return F.conv1d(x_BCT, weight_C1W, groups=x_BTC.shape[-1]).transpose(1, 2)
    # Compiled, the taps fuse into one kernel (and the weight gradient into one reduction):
    # several times faster on a GPU than F.conv1d's depthwise kernels over thousands of channels.
    T = x_BTC.shape[1]
    x_BLC = F.pad(x_BTC, (0, 0, width - 1, 0))
    if doc_ids_BT is not None:
        docs_BL = F.pad(doc_ids_BT, (width - 1, 0), value=-1)  # -1: no document
    out_BTC = torch.zeros_like(x_BTC)
    for tap in range(width):  # tap j reads input t - (width - 1 - j)
        term_BTC = weight_C1W[:, 0, tap] * x_BLC[:, tap : tap + T]
        if doc_ids_BT is not None:
            term_BTC = term_BTC * (docs_BL[:, tap : tap + T] == doc_ids_BT)[..., None]
        out_BTC = out_BTC + term_BTC
    return out_BTC


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times silu(gate): weight * (x / rms(x)) * silu(z), the
    statistics and the gate in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6, invariant: bool = False) -> None:
        super().__init__()
        self.eps, self.invariant = eps, invariant
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        weight = shared_by_heads(self.weight)  # under tp, applied to this rank's heads only
        if self.invariant:
            normed = batch_invariant.rms_norm(x, weight, self.eps)
            return (normed * batch_invariant.pointwise(F.silu, gate.float())).to(x.dtype)
        return (rms_norm(x, weight, self.eps) * F.silu(gate.float())).to(x.dtype)

    def init_weights(self, init: ParamInit) -> None:
        init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (module docstring): ``forward(x_BTD, cos, sin, documents,
    cache=None)``, cos/sin unused (no positions).

    Head counts are read from the local projection shapes in forward, so a tensor-parallel
    rank holding a share of the heads (``tp_plan``) runs the same code."""

    def __init__(
        self,
        dim: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        fused_projections: bool = False,
        init_std: float = 0.02,
        out_std: float | None = None,
        invariant: bool = False,
    ) -> None:
        """``invariant``: batch-invariant mode, every op in a fixed order (the delta rule token
        by token, kernels/batch_invariant.py), so a token's output does not depend on its batch
        or on prefill vs decode."""
        super().__init__()
        self.invariant = invariant
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.fused_projections = fused_projections
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(dim, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_q = nn.Linear(dim, self.key_dim, bias=False)
            self.in_proj_k = nn.Linear(dim, self.key_dim, bias=False)
            self.in_proj_v = nn.Linear(dim, self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(dim, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(dim, num_v_heads, bias=False)
        # Depthwise: weights [channels, 1, kernel]; their padding is applied by causal_conv1d.
        widths = {"q": self.key_dim, "k": self.key_dim, "v": self.value_dim}
        for part, width in widths.items():
            conv = nn.Conv1d(width, width, conv_kernel, groups=width, bias=False)
            setattr(self, f"{part}_conv1d", conv)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps, invariant)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor | None = None,
        sin_BTd: torch.Tensor | None = None,
        doc_ids_BT: Any = None,
        cache: BoundRecurrent | None = None,
    ) -> torch.Tensor:
        """With ``doc_ids_BT`` (packed rows) every document starts from a zero state and its
        convolution sees only its own tokens. With ``cache`` (generation), each row continues
        from its slot's state and leaves its state there."""
        doc_ids_BT = document_ids(doc_ids_BT, "Gated DeltaNet layers")
        B, T, _ = x_BTD.shape
        q_BTC, k_BTC, v_BTC, z_BTHv, b_BTH, a_BTH = self._projections(x_BTD)
        key_width, value_width = q_BTC.shape[-1], v_BTC.shape[-1]  # this rank's heads
        qkv_BTC = torch.cat([q_BTC, k_BTC, v_BTC], dim=-1)
        weight_C1W = torch.cat(
            [local_shard(c.weight) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        )
        fixed = self.invariant
        if cache is None:
            qkv_BTC = causal_conv1d(qkv_BTC, weight_C1W, doc_ids_BT, fixed_order=fixed)
        else:
            qkv_BTC = cache.convolve(qkv_BTC, weight_C1W, fixed_order=fixed)
        qkv_BTC = batch_invariant.pointwise(F.silu, qkv_BTC) if fixed else F.silu(qkv_BTC)
        q_BTC, k_BTC, v_BTC = qkv_BTC.split([key_width, key_width, value_width], -1)
        # Each key head serves num_v_heads / num_k_heads consecutive value heads; the delta rule
        # L2-normalises q and k and repeats them (fla inside its kernels).
        q_BTNk = q_BTC.reshape(B, T, -1, self.head_k_dim)
        k_BTNk = k_BTC.reshape(B, T, -1, self.head_k_dim)
        v_BTHv = v_BTC.reshape(B, T, -1, self.head_v_dim)
        A_log, dt_bias = local_shard(self.A_log), local_shard(self.dt_bias)
        if fixed:  # the transcendental ops through pointwise; the rule token by token
            beta_BTH = batch_invariant.pointwise(torch.sigmoid, b_BTH)
            decay_H = batch_invariant.pointwise(torch.exp, A_log.float())
            g_BTH = -decay_H * batch_invariant.pointwise(F.softplus, a_BTH.float() + dt_bias)
        else:
            beta_BTH = b_BTH.sigmoid()
            g_BTH = -A_log.float().exp() * F.softplus(a_BTH.float() + dt_bias)
        if cache is not None:
            o_BTHv = cache.delta_rule(
                q_BTNk, k_BTNk, v_BTHv, g_BTH, beta_BTH, normalize_qk=True, fixed_order=fixed
            )
        else:
            o_BTHv, _ = delta_rule(
                q_BTNk, k_BTNk, v_BTHv, g_BTH, beta_BTH, impl="fixed_order" if fixed else "auto",
                doc_ids_BT=doc_ids_BT, normalize_qk=True,
            )  # fmt: skip
        o_BTHv = self.norm(o_BTHv, z_BTHv)
        return self.out_proj(o_BTHv.reshape(B, T, -1))

    def _projections(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k [B, T, key channels], v [B, T, value channels], z [B, T, Hv, dv], b, a
        [B, T, Hv], of this rank's heads."""
        B, T, _ = x_BTD.shape
        if not self.fused_projections:
            z_BTHv = self.in_proj_z(x_BTD).view(B, T, -1, self.head_v_dim)
            q_BTC, k_BTC, v_BTC = (
                p(x_BTD) for p in (self.in_proj_q, self.in_proj_k, self.in_proj_v)
            )
            return q_BTC, k_BTC, v_BTC, z_BTHv, self.in_proj_b(x_BTD), self.in_proj_a(x_BTD)
        # Per key head: q, k, then the v and z of its group of value heads (module docstring).
        group = self.num_v_heads // self.num_k_heads
        dk, gv = self.head_k_dim, group * self.head_v_dim
        qkvz_BTNx = self.in_proj_qkvz(x_BTD).view(B, T, -1, 2 * dk + 2 * gv)
        q, k, v, z = qkvz_BTNx.split([dk, dk, gv, gv], dim=-1)
        b_BTNg, a_BTNg = self.in_proj_ba(x_BTD).view(B, T, -1, 2 * group).chunk(2, -1)
        q_BTC, k_BTC, v_BTC = (t.reshape(B, T, -1) for t in (q, k, v))
        z_BTHv = z.reshape(B, T, -1, self.head_v_dim)
        return q_BTC, k_BTC, v_BTC, z_BTHv, b_BTNg.reshape(B, T, -1), a_BTNg.reshape(B, T, -1)

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> RecurrentState:
        """The recurrent state of every value head this rank holds and the convolution's last
        inputs."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        channels = sum(local_shard(c.weight).shape[0] for c in convs)
        heads = local_shard(self.A_log).shape[0]
        kernel = self.q_conv1d.weight.shape[-1]
        return RecurrentState(
            slots, channels, kernel, heads, self.head_k_dim, self.head_v_dim, device, dtype
        )

    def init_weights(self, init: ParamInit) -> None:
        """Projections normal (out_proj at out_std), the convolutions uniform in
        +-1/sqrt(width) (torch's default bound), dt_bias 1 and log A uniform in [0, log 16]
        (A in [1, 16], as Mamba-2 draws it); the gated norm at one."""
        for module in self.children():
            if isinstance(module, nn.Linear) and module is not self.out_proj:
                init.trunc_normal_(module.weight, self.init_std)
        init.trunc_normal_(self.out_proj.weight, self.out_std)
        bound = self.q_conv1d.weight.shape[-1] ** -0.5
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            init.uniform_(conv.weight, -bound, bound)
        init.ones_(self.dt_bias)
        init.uniform_(self.A_log, 0.0, math.log(16.0))
        self.norm.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per projection weight, plus the chunked delta rule's
        per-head work, about 6 x (4 key_dim x value_dim + 2 x chunk x (key_dim + value_dim)):
        the state read and update per token and the intra-chunk products (chunk 64)."""
        weights = sum(
            m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear | nn.Conv1d)
        )
        per_head = 4 * self.head_k_dim * self.head_v_dim + 128 * (self.head_k_dim + self.head_v_dim)
        return 6 * weights + 6 * self.num_v_heads * per_head

    def check_tp(self, tp: int) -> None:
        """ConfigError unless ``tp`` divides the key heads (each rank takes whole key heads and
        the value heads that read them)."""
        if self.num_k_heads % tp:
            raise ConfigError(
                f"--parallel.tp {tp} does not divide the model's linear_num_key_heads "
                f"({self.num_k_heads}): every tensor-parallel rank must hold whole Gated "
                f"DeltaNet heads. Choose a tp that divides {self.num_k_heads}."
            )

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """Heads split: every input projection column-wise (the fused ones are grouped per key
        head, the separate ones per head, so a contiguous share of rows is whole heads), the
        convolutions, A_log and dt_bias by rows, out_proj row-wise; the output norm's weight
        is replicated (its gradient summed over tp). With ``sequence_parallel`` the input is
        gathered first and out_proj's output scattered back along the sequence."""
        rows = Shard(0)
        plan: dict[str, ParallelStyle] = {
            "": HeadParallel(
                {"q_conv1d.weight": rows, "k_conv1d.weight": rows, "v_conv1d.weight": rows,
                 "A_log": rows, "dt_bias": rows, "norm.weight": Replicate()},
                gather_input=sequence_parallel,
            ),
            "out_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel
            else RowwiseParallel(),
        }  # fmt: skip
        for name, module in self.named_children():
            if name.startswith("in_proj_") and isinstance(module, nn.Linear):
                plan[name] = ColwiseParallel()
        return plan
