"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-V3): keys and values are
reconstructed per head from one small latent vector per token, so generation caches the latent
instead of every head's keys and values.

Per token x (module names are those of transformers' DeepseekV3Attention, so its weights load
under the same names):

- queries: ``q_proj(x)``, or with a low-rank query ``q_b_proj(q_a_layernorm(q_a_proj(x)))``;
  each head's query is a ``qk_nope_head_dim`` part without position and a ``qk_rope_head_dim``
  part that RoPE rotates;
- ``kv_a_proj_with_mqa(x)`` gives the latent c (``kv_lora_rank``, normed by
  ``kv_a_layernorm``) and one rotated key part shared by every head (decoupled RoPE);
- ``kv_b_proj(c)`` gives each head's key part without position and its value;
- the softmax scale is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale^2 under
  DeepSeek's YaRN (``mla_softmax_scale``).

Without RoPE tables (``cos_BTd`` None: a model whose config has no rotary, as Kimi Linear's
MLA layers) nothing is rotated: the "rope" parts are plain query/key channels (NoPE).

DeepSeek checkpoints lay each rotated part out as interleaved pairs (x0, x1), (x2, x3), ...
(``rope_interleave``); the pairs are gathered into the "rotate half" layout before the shared
RoPE rotation, which gives the numbers transformers computes with its interleaved rotation.

Training and prefill without a cache attend with the model's attention backend (the value head
dim may differ from the query/key one; the batch-invariant kernel, and SDPA on CUDA so that its
flash kernel runs, get values zero-padded to the query width). Generation stores the latent and the rotated shared key
(``LatentState``, models/components/cache.py) and attends in latent space with kv_b_proj
absorbed into the query and the output.
"""

from __future__ import annotations

import math
from typing import Protocol

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
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.models.components.attention import ATTENTION_BACKENDS
from torchloom.models.components.cache import Binding, LatentState
from torchloom.models.components.head_parallel import ReplicatedModule, SumInputGradient
from torchloom.models.components.norms import NORM_IMPLS
from torchloom.models.components.param_init import ParamInit, local_tensor
from torchloom.models.components.rope import ROPE_IMPLS, RopeConfig, yarn_mscale


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN with
    mscale_all_dim set: DeepSeek's YaRN sharpens the whole score, not only the rotated part."""
    scale = qk_head_dim**-0.5
    if rope.scaling == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def interleaved_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Channels (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved
    rotation pairs become the (i, i + d/2) pairs of the "rotate half" layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class RopeKeyHeads(nn.Module):
    """The shared rotated key part, repeated for every local head. A module of its own so a
    tensor-parallel plan can sum its input's gradient over the ranks (each rank's heads
    contribute a part of it)."""

    def forward(self, k_rope_BT1r: torch.Tensor, heads: int) -> torch.Tensor:
        return k_rope_BT1r.expand(-1, -1, heads, -1)


class MultiHeadLatentAttention(nn.Module):
    """MLA with the forward of ``Attention``: ``(x_BTD, cos_BTd, sin_BTd, doc_ids_BT,
    cache=None)``, cos/sin over ``qk_rope_head_dim``. Head counts are read from the local
    projection shapes, so a plan that splits q_b_proj/q_proj and kv_b_proj by heads just works.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        backend: str = "sdpa",
        norm_impl: str = "torch",
        rope_impl: str = "torch",
        init_std: float = 0.02,
        out_std: float | None = None,
        mask: AttentionMask = CAUSAL,
    ) -> None:
        """``mask``: which keys each query sees, as ``Attention``'s; the absorbed decode and
        the batch-invariant kernel compute plain causal attention only and refuse the rest."""
        super().__init__()
        if not mask.plain:
            # Training could run a windowed mask through the backend, but generation's latent
            # cache masks causally: refuse here rather than decode a different model.
            mask.require_plain("multi-head latent attention", "give MLA layers the CAUSAL mask.")
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = softmax_scale
        # The backends scale by 1/sqrt(q's width): the rest of the scale goes into q.
        self.q_scale = softmax_scale * math.sqrt(self.qk_head_dim)
        self.rope_interleave = rope_interleave
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        norm_cls = NORM_IMPLS[norm_impl]
        q_width = num_heads * self.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: nn.Module | None = None
        self.q_b_proj: nn.Linear | None = None
        if q_lora_rank:
            self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_a_layernorm = norm_cls(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(dim, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = norm_cls(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, dim, bias=False)
        self.rope_key_heads = RopeKeyHeads()
        self.backend, self.mask = backend, mask
        self.attend = ATTENTION_BACKENDS[backend]
        self.rotate = ROPE_IMPLS[rope_impl]

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor | None,
        sin_BTd: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: BoundLatentCache | None = None,
    ) -> torch.Tensor:
        """With ``cache`` (generation), this call's latents are stored in it and the queries
        attend to every cached position up to their own."""
        B, T, _ = x_BTD.shape
        _, q_nope_BTHn, q_rope_BTHr, latent_BTc, k_rope_BT1r = self.project(x_BTD, cos_BTd, sin_BTd)
        if cache is not None and self.backend == "batch_invariant":
            # No absorbed weights: every step up-projects the cached latents as the trainer's
            # forward does, and attends with the same kernel at the queries' positions.
            cached_BLx = cache.stored(latent_BTc, k_rope_BT1r[:, :, 0]).to(latent_BTc.dtype)
            latent_BLc, k_rope_BLr = cached_BLx.split([self.kv_lora_rank, self.rope_dim], -1)
            out_BHTv = self._attend_full(
                q_nope_BTHn, q_rope_BTHr, latent_BLc, k_rope_BLr[:, :, None],
                positions_BT=cache.binding.positions_BT,
            )  # fmt: skip
        elif cache is not None:
            out_BHTv = cache.attend(
                q_nope_BTHn.transpose(1, 2), q_rope_BTHr.transpose(1, 2), latent_BTc,
                k_rope_BT1r[:, :, 0], local_tensor(self.kv_b_proj.weight), self.softmax_scale,
            )  # fmt: skip
        else:
            out_BHTv = self._attend_full(
                q_nope_BTHn, q_rope_BTHr, latent_BTc, k_rope_BT1r, doc_ids_BT
            )
        return self.o_proj(out_BHTv.transpose(1, 2).reshape(B, T, -1))

    def project(
        self, x_BTD: torch.Tensor, cos_BTd: torch.Tensor | None, sin_BTd: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the normed query latent, None with a full-rank q_proj; each head's query parts
        without and with position; the normed latent; the rotated shared key part [B, T, 1, r])."""
        B, T, _ = x_BTD.shape
        q_latent_BTq = None
        if self.q_proj is not None:
            q_BTq = self.q_proj(x_BTD)
        else:
            q_latent_BTq = self.q_a_layernorm(self.q_a_proj(x_BTD))
            q_BTq = self.q_b_proj(q_latent_BTq)
        q_BTHe = q_BTq.view(B, T, -1, self.qk_head_dim)
        q_nope_BTHn, q_rope_BTHr = q_BTHe.split([self.nope_dim, self.rope_dim], dim=-1)
        latent_BTc, k_rope_BTr = self.kv_a_proj_with_mqa(x_BTD).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent_BTc = self.kv_a_layernorm(latent_BTc)
        k_rope_BT1r = k_rope_BTr[:, :, None]
        if cos_BTd is not None:  # no tables: NoPE (Kimi Linear), the parts stay as they are
            q_rope_BTHr = self.rotate(self._halves(q_rope_BTHr), cos_BTd, sin_BTd)
            k_rope_BT1r = self.rotate(self._halves(k_rope_BT1r), cos_BTd, sin_BTd)
        return q_latent_BTq, q_nope_BTHn, q_rope_BTHr, latent_BTc, k_rope_BT1r

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        return interleaved_to_halves(x) if self.rope_interleave else x

    def _attend_full(
        self,
        q_nope_BTHn: torch.Tensor,
        q_rope_BTHr: torch.Tensor,
        latent_BLc: torch.Tensor,
        k_rope_BL1r: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        positions_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every head's keys and values up-projected from the latents (this call's, or with
        ``positions_BT`` a cache's, key index = position), then the backend (with
        ``positions_BT`` the batch-invariant kernel at the queries' positions)."""
        B, L, H = *latent_BLc.shape[:2], q_nope_BTHn.shape[2]
        kv_BLHx = self.kv_b_proj(latent_BLc).view(B, L, H, self.nope_dim + self.v_dim)
        k_nope_BLHn, v_BLHv = kv_BLHx.split([self.nope_dim, self.v_dim], dim=-1)
        k_BLHe = torch.cat([k_nope_BLHn, self.rope_key_heads(k_rope_BL1r, H)], dim=-1)
        q_BTHe = torch.cat([q_nope_BTHn, q_rope_BTHr], dim=-1)
        if self.q_scale != 1.0:
            q_BTHe = q_BTHe * self.q_scale
        # The batch-invariant kernel, and SDPA's flash kernel on CUDA, need one head dim for
        # q, k and v: the values get zero columns (exact: the first v_dim outputs are the same
        # sums), without which CUDA SDPA falls back to a slower kernel.
        padded = self.backend == "batch_invariant" or (self.backend == "sdpa" and q_BTHe.is_cuda)
        pad = max(self.qk_head_dim - self.v_dim, 0) if padded else 0
        v_BHLx = (F.pad(v_BLHv, (0, pad)) if pad > 0 else v_BLHv).transpose(1, 2)
        q_BHTe, k_BHLe = q_BTHe.transpose(1, 2), k_BLHe.transpose(1, 2)
        if positions_BT is None:
            out_BHTx = self.attend(q_BHTe, k_BHLe, v_BHLx, doc_ids_BT, self.mask)
        else:
            out_BHTx = batch_invariant.attention(q_BHTe, k_BHLe, v_BHLx, positions_BT)
        return out_BHTx[..., : self.v_dim] if pad > 0 else out_BHTx

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> LatentState:
        """This layer's generation state: the normed latent and the rotated shared key of every
        position, [slots, max_len, kv_lora_rank + qk_rope_head_dim] (the same on every
        tensor-parallel rank: the heads are made from it)."""
        return LatentState(slots, max_len, self.kv_lora_rank, self.rope_dim, device, dtype)

    def init_weights(self, init: ParamInit) -> None:
        """Normal weights truncated at 3 std (o_proj at out_std); norms at one."""
        for proj in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa,
                     self.kv_b_proj):  # fmt: skip
            if proj is not None:
                init.trunc_normal_(proj.weight, self.init_std)
        init.trunc_normal_(self.o_proj.weight, self.out_std)
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                norm.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per projection weight, plus attention: QK^T over
        qk_head_dim and AV over v_head_dim per head, halved by the causal mask, times 3 for
        forward and backward."""
        projections = (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa,
                       self.kv_b_proj, self.o_proj)  # fmt: skip
        weights = sum(p.weight.numel() for p in projections if p is not None)
        heads = self.o_proj.weight.shape[1] // self.v_dim
        return 6 * weights + 3 * heads * (self.qk_head_dim + self.v_dim) * seq_len

    def check_tp(self, tp: int) -> None:
        """ConfigError unless ``tp`` divides the heads (each rank takes whole heads)."""
        heads = self.o_proj.weight.shape[1] // self.v_dim
        if heads % tp:
            raise ConfigError(
                f"--parallel.tp {tp} does not divide the model's num_heads ({heads}): every "
                f"tensor-parallel rank must hold whole heads. Choose a tp that divides {heads}."
            )

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """Heads split: q_proj / q_b_proj and kv_b_proj column-wise, o_proj row-wise. The
        low-rank projections and their norms are replicated (every rank computes the whole
        latent); their gradients are whole on every rank because the column-wise layers sum
        their input's gradient over tp, and ``rope_key_heads`` does the same for the shared
        rotated key. With ``sequence_parallel`` the input is gathered first and o_proj's
        output scattered back along the sequence."""
        replicated = ReplicatedModule()
        plan: dict[str, ParallelStyle] = {
            "kv_a_proj_with_mqa": replicated,
            "kv_a_layernorm": replicated,
            "kv_b_proj": ColwiseParallel(),
            "rope_key_heads": SumInputGradient(),
            "o_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel
            else RowwiseParallel(),
        }  # fmt: skip
        if self.q_proj is not None:
            plan["q_proj"] = ColwiseParallel()
        else:
            plan |= {"q_a_proj": replicated, "q_a_layernorm": replicated,
                     "q_b_proj": ColwiseParallel()}  # fmt: skip
        if sequence_parallel:
            plan[""] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
                use_local_output=True,
            )
        return plan


class BoundLatentCache(Protocol):
    """What MLA's forward receives as ``cache`` (``LatentState.bound``)."""

    binding: Binding

    def stored(self, latent_BTc: torch.Tensor, k_rope_BTr: torch.Tensor) -> torch.Tensor: ...

    def attend(
        self,
        q_nope_BHTn: torch.Tensor,
        q_rope_BHTr: torch.Tensor,
        latent_BTc: torch.Tensor,
        k_rope_BTr: torch.Tensor,
        kv_b_weight: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor: ...
