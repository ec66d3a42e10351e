"""Grouped-query self-attention (Ainslie et al. 2023) with pluggable kernels.

A backend is a plain function ``(q_BHTd, k_BKTd, v_BKTd, doc_ids_BT | None, mask) -> out_BHTd``:
attention under ``mask`` (an ``AttentionMask``, kernels/attention_mask.py: causal, and with
``doc_ids_BT`` same-document, by default) with softmax scale 1/sqrt(head_dim), where K (kv
heads) divides H (query heads) and query head h reads kv head h // (H / K). Register new
kernels in ATTENTION_BACKENDS. The flex backend also takes, in place of ``doc_ids_BT``, the
``FlexBlockMasks`` the model builds once per forward: one BlockMask per distinct layer mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
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
    SequenceParallel,
)
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchloom.config.errors import ConfigError
from torchloom.kernels import batch_invariant
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.kernels.flash_attention4 import Fa4Documents, fa4_attention, fa4_documents
from torchloom.models.components.cache import KVState
from torchloom.models.components.fused_linear import fuse_linears
from torchloom.models.components.norms import NORM_IMPLS, WeightlessRMSNorm
from torchloom.models.components.param_init import ParamInit, local_tensor
from torchloom.models.components.rope import ROPE_IMPLS

AttentionBackend = Callable[..., torch.Tensor]
"""``(q_BHTd, k_BKTd, v_BKTd, doc_ids_BT, mask=CAUSAL) -> out_BHTd`` (module docstring)."""


def sdpa_attention(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | None,
    mask: AttentionMask = CAUSAL,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention (flash / memory-efficient / math kernels), with
    ``mask``'s dense form unless it is plain causal attention over one document."""
    if doc_ids_BT is None and mask.plain:
        return F.scaled_dot_product_attention(
            q_BHTd, k_BKTd, v_BKTd, is_causal=True, enable_gqa=True
        )
    # The kernels that take a mask do not support enable_gqa (only flash and math do), so the
    # kv heads are repeated to keep the memory-efficient kernel eligible.
    group = q_BHTd.shape[1] // k_BKTd.shape[1]
    k_BHSd = k_BKTd.repeat_interleave(group, dim=1)
    v_BHSd = v_BKTd.repeat_interleave(group, dim=1)
    T, S = q_BHTd.shape[2], k_BKTd.shape[2]
    mask_B1TS = mask.dense(T, q_BHTd.device, doc_ids_BT, S)
    return F.scaled_dot_product_attention(q_BHTd, k_BHSd, v_BHSd, attn_mask=mask_B1TS)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def _flex_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The fused kernel needs flex_attention compiled. Inside a compiled model the outer compile
    fuses it; outside one, compile it once here. On CPU use the eager reference: it materializes
    the scores and has no backward, so on CPU "flex" is forward-only (use torch.no_grad())."""
    if torch.compiler.is_compiling() or device.type == "cpu":
        return flex_attention
    return _compiled_flex_attention()


def flex_block_mask(
    mask: AttentionMask,
    doc_ids_BT: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> BlockMask:
    """FlexAttention block mask of ``mask`` (with doc_ids, per row)."""
    rows = None if doc_ids_BT is None or not mask.document else doc_ids_BT.shape[0]
    return create_block_mask(mask.mask_mod(doc_ids_BT), rows, None, q_len, kv_len, device=device)


class FlexBlockMasks:
    """What flex layers take in place of ``doc_ids_BT`` in one forward: a BlockMask per
    distinct layer mask (interleaved sliding and global layers: two), built up front, since
    building one is a pass over the T x T mask, as costly as a layer's attention."""

    def __init__(
        self,
        masks: Iterable[AttentionMask],
        doc_ids_BT: torch.Tensor | None,
        T: int,
        device: torch.device,
    ) -> None:
        self.doc_ids_BT, self.T, self.device = doc_ids_BT, T, device
        self.built = {mask: flex_block_mask(mask, doc_ids_BT, T, T, device) for mask in masks}

    def get(self, mask: AttentionMask) -> BlockMask:
        if mask not in self.built:  # a layer the model did not announce: build its own
            self.built[mask] = flex_block_mask(mask, self.doc_ids_BT, self.T, self.T, self.device)
        return self.built[mask]


def flex_attention_backend(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | FlexBlockMasks | None,
    mask: AttentionMask = CAUSAL,
) -> torch.Tensor:
    """torch.nn.attention.flex_attention under ``mask``'s block mask: the model's, or one built
    here from ``doc_ids_BT``."""
    if isinstance(doc_ids_BT, FlexBlockMasks):
        block_mask = doc_ids_BT.get(mask)
    else:
        T, S = q_BHTd.shape[2], k_BKTd.shape[2]
        block_mask = flex_block_mask(mask, doc_ids_BT, T, S, q_BHTd.device)
    attend = _flex_kernel(q_BHTd.device)
    return attend(q_BHTd, k_BKTd, v_BKTd, block_mask=block_mask, enable_gqa=True)


def batch_invariant_attention(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | None,
    mask: AttentionMask = CAUSAL,
) -> torch.Tensor:
    """The batch-invariant kernel (kernels/batch_invariant.py): plain masks only."""
    mask.require_plain("attn_backend 'batch_invariant'", batch_invariant.MASK_FIX)
    return batch_invariant.causal_attention(q_BHTd, k_BKTd, v_BKTd, doc_ids_BT)


def shared_attention_input(
    mixers: Iterable[nn.Module],
    doc_ids_BT: torch.Tensor | None,
    T: int,
    device: torch.device,
) -> torch.Tensor | FlexBlockMasks | Fa4Documents | None:
    """What every layer takes in place of ``doc_ids_BT``, built once per forward from the
    token mixers ``mixers``: with flex layers, their ``FlexBlockMasks`` (one BlockMask per
    distinct mask); with fa4 layers, the documents' starts (``Fa4Documents``); the document
    ids themselves for every other kernel."""
    mixers = list(mixers)
    if doc_ids_BT is not None and any(getattr(m, "attend", None) is fa4_attention for m in mixers):
        return fa4_documents(doc_ids_BT)
    flex_masks = {
        getattr(mixer, "mask", CAUSAL)
        for mixer in mixers
        if getattr(mixer, "attend", None) is flex_attention_backend
    }
    if flex_masks:
        return FlexBlockMasks(sorted(flex_masks, key=repr), doc_ids_BT, T, device)
    return doc_ids_BT


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "sdpa": sdpa_attention,
    "flex": flex_attention_backend,
    "batch_invariant": batch_invariant_attention,
    "fa4": fa4_attention,
}
"""Named attention kernels (the ``attn_backend`` slot); each computes the same function for
the masks it honours and refuses, in one line, those it does not."""


class LayerCache(Protocol):
    """One layer's KV state bound to a forward (models/components/cache.py)."""

    def attend(
        self, q_BHTd: torch.Tensor, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's rotated keys/values; attend the queries to the cached ones."""
        ...


class Attention(nn.Module):
    """Multi-head self-attention with grouped kv heads, optional q/k RMSNorm (Qwen3) and RoPE.

    Gated attention (Qwen3-Next, ``output_gate``): q_proj also emits, per head, a gate for the
    head's output, which is multiplied by sigmoid(gate) before o_proj. ``rotary_dim`` below
    head_dim rotates only each head's first rotary_dim channels (partial RoPE); cos/sin then
    have rotary_dim channels.

    Muse's attention (Glimmer, Spark) adds, each off by default: ``gate_proj``, the output gate
    from a projection of its own (sigmoid(gate_proj(x)) per channel) instead of from q_proj;
    ``q_scale``, a constant the normed queries are multiplied by (on top of 1/sqrt(head_dim));
    ``rotary=False``, no RoPE (NoPE layers); ``out_norm``, a weightless RMSNorm over each
    head's output before the gate.

    ``mask`` says which keys each query sees (default causal, same-document); sliding-window
    and chunked layers (Gemma, Qwen3's ``layer_types``, Muse) pass theirs, and the backend, the
    generation cache and context parallelism each honour it or refuse it in one line. Sinks,
    compressed and top-k keys are layers of their own, not this one's.

    Head counts are read from the projection shapes at run time (``view(B, T, -1, head_dim)``),
    so a tensor-parallel plan that shards q/k/v column-wise and o row-wise just works.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        backend: str = "sdpa",
        norm_impl: str = "torch",
        rope_impl: str = "torch",
        init_std: float = 0.02,
        out_std: float | None = None,
        output_gate: bool = False,
        rotary_dim: int | None = None,
        make_norm: Callable[[int], nn.Module] | None = None,
        gate_proj: bool = False,
        q_scale: float = 1.0,
        rotary: bool = True,
        mask: AttentionMask = CAUSAL,
        out_norm: bool = False,
    ) -> None:
        """``init_std``: q/k/v; ``out_std``: o, the residual branch's output (default
        init_std). ``make_norm(dim)`` builds the q/k norms (default: norm_impl's RMSNorm)."""
        super().__init__()
        if mask.sink or mask.compress is not None or mask.topk is not None:
            raise ConfigError(
                f"Attention computes token-to-token attention, not this layer's mask "
                f"({mask.describe()}): sinks, compressed and top-k keys need their own layer."
            )
        if backend == "batch_invariant":
            mask.require_plain("attn_backend 'batch_invariant'", batch_invariant.MASK_FIX)
        if backend == "fa4":
            mask.require_plain("attn_backend 'fa4'", "use --model.attn_backend sdpa or flex.")
        if output_gate and gate_proj:
            raise ValueError("output_gate (from q_proj) and gate_proj are two ways to one gate")
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.output_gate = output_gate
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        q_width = num_heads * head_dim * (2 if output_gate else 1)  # per head: query, gate
        self.q_proj = nn.Linear(dim, q_width, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)
        if make_norm is None:
            make_norm = functools.partial(NORM_IMPLS[norm_impl], eps=norm_eps)
        self.q_norm = make_norm(head_dim) if qk_norm else None
        self.k_norm = make_norm(head_dim) if qk_norm else None
        self.gate_proj = nn.Linear(dim, num_heads * head_dim, bias=False) if gate_proj else None
        self.out_norm = WeightlessRMSNorm(norm_eps) if out_norm else None
        self.q_scale, self.rotary, self.mask = q_scale, rotary, mask
        self.backend = backend  # new_state: the batch-invariant kernel decodes its own way
        self.attend = ATTENTION_BACKENDS[backend]
        self.rotate = ROPE_IMPLS[rope_impl]
        self.fused_in: torch.Tensor | None = None  # q/k/v(/gate) stacked (fuse_projections)

    def fuse_projections(self) -> bool:
        """From now on run q/k/v (and gate_proj) as one matmul over their stacked weights
        (fused_linear.py); whether it did. In batch-invariant mode only where that changes no
        bit of q/k/v (``batch_invariant.stacking_keeps_bits``)."""
        if self.fused_in is not None:
            return False
        invariant = self.backend == "batch_invariant"
        self.fused_in = fuse_linears(self._in_projections(), invariant)
        return self.fused_in is not None

    def _in_projections(self) -> list[nn.Linear]:
        projections = [self.q_proj, self.k_proj, self.v_proj]
        return projections + ([self.gate_proj] if self.gate_proj is not None else [])

    def _project(
        self, x_BTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q_proj, k_proj, v_proj and gate_proj (None without it) of ``x_BTD``; by the stacked
        weight only without autograd (it is no parameter: no gradient would reach q/k/v)."""
        if self.fused_in is None or torch.is_grad_enabled():
            gate_BTX = self.gate_proj(x_BTD) if self.gate_proj is not None else None
            return self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD), gate_BTX
        widths = [p.weight.shape[0] for p in self._in_projections()]
        matmul = batch_invariant.linear if self.backend == "batch_invariant" else F.linear
        parts = matmul(x_BTD, self.fused_in).split(widths, -1)
        return parts[0], parts[1], parts[2], parts[3] if len(parts) == 4 else None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """With ``cache`` (generation), this call's keys and values are stored in it and the
        queries attend to every cached position up to their own."""
        B, T, _ = x_BTD.shape
        q_BTX, k_BTX, v_BTX, gate_BTX = self._project(x_BTD)
        if self.output_gate:
            q_BTHd, gate_BTHd = q_BTX.view(B, T, -1, 2 * self.head_dim).chunk(2, -1)
            gate_BTX = gate_BTHd.reshape(B, T, -1)
        else:
            q_BTHd = q_BTX.view(B, T, -1, self.head_dim)
        k_BTKd = k_BTX.view(B, T, -1, self.head_dim)
        v_BTKd = v_BTX.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHd, k_BTKd = self.q_norm(q_BTHd), self.k_norm(k_BTKd)
        if self.q_scale != 1.0:
            q_BTHd = q_BTHd * self.q_scale
        if self.rotary:
            q_BTHd = self._rotate(q_BTHd, cos_BTd, sin_BTd)
            k_BTKd = self._rotate(k_BTKd, cos_BTd, sin_BTd)
        q_BHTd, k_BKTd = q_BTHd.transpose(1, 2), k_BTKd.transpose(1, 2)
        v_BKTd = v_BTKd.transpose(1, 2)
        if cache is not None:
            out_BHTd = cache.attend(q_BHTd, k_BKTd, v_BKTd)
        else:
            out_BHTd = self.attend(q_BHTd, k_BKTd, v_BKTd, doc_ids_BT, self.mask)
        out_BTHd = out_BHTd.transpose(1, 2)
        if self.out_norm is not None:
            out_BTHd = self.out_norm(out_BTHd)
        out_BTX = out_BTHd.reshape(B, T, -1)
        if gate_BTX is not None:
            if self.backend == "batch_invariant":
                out_BTX = out_BTX * batch_invariant.pointwise(torch.sigmoid, gate_BTX)
            else:
                out_BTX = out_BTX * torch.sigmoid(gate_BTX)
        return self.o_proj(out_BTX)

    def _rotate(
        self, x_BTHd: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor
    ) -> torch.Tensor:
        """RoPE on each head's first rotary_dim channels; the rest pass unrotated."""
        if self.rotary_dim == self.head_dim:
            return self.rotate(x_BTHd, cos_BTr, sin_BTr)
        rotated, passed = x_BTHd.split([self.rotary_dim, self.head_dim - self.rotary_dim], -1)
        return torch.cat([self.rotate(rotated.contiguous(), cos_BTr, sin_BTr), passed], dim=-1)

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVState:
        """This layer's generation state: keys and values of the kv heads this rank holds
        (its share of k_proj under tensor parallelism), attended with the batch-invariant
        kernel when that is this layer's backend."""
        kv_heads = local_tensor(self.k_proj.weight).shape[0] // self.head_dim
        invariant = self.backend == "batch_invariant"
        return KVState(slots, kv_heads, max_len, self.head_dim, device, dtype, invariant, self.mask)

    def init_weights(self, init: ParamInit) -> None:
        """Normal weights truncated at 3 std; q/k norms at one."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj):
            if proj is not None:
                init.trunc_normal_(proj.weight, self.init_std)
        init.trunc_normal_(self.o_proj.weight, self.out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per weight of q/k/v/o, plus attention itself. QK^T and AV
        each cost 2 * head_dim * seq_len per query head and token, halved by the causal mask,
        times 3 for forward and backward: 6 * heads * head_dim * seq_len."""
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj)
        weights = sum(p.weight.numel() for p in projections if p is not None)
        # ``keys`` is twice the mean a query sees: a window's queries see up to ``window``, a
        # chunk's half of ``chunk`` on average.
        keys = seq_len
        if self.mask.window is not None:
            keys = min(keys, 2 * self.mask.window)
        if self.mask.chunk is not None:
            keys = min(keys, self.mask.chunk)
        return 6 * weights + 6 * self.o_proj.weight.shape[1] * keys

    def check_tp(self, tp: int) -> None:
        """ConfigError unless ``tp`` divides both head counts (each rank takes whole heads)."""
        heads = self.o_proj.weight.shape[1] // self.head_dim
        kv_heads = self.k_proj.weight.shape[0] // self.head_dim
        for name, value in (("num_heads", heads), ("num_kv_heads", kv_heads)):
            if value % tp:
                raise ConfigError(
                    f"--parallel.tp {tp} does not divide the model's {name} ({value}): every "
                    f"tensor-parallel rank must hold whole heads. Choose a tp that divides "
                    f"num_heads={heads} and num_kv_heads={kv_heads}."
                )

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """q/k/v split by heads (column-wise), o row-wise. With ``sequence_parallel`` the input
        arrives split along the sequence and is gathered first, and o's output is scattered
        back along it; q/k norms then run per local head, their weight's gradient summed."""
        plan: dict[str, ParallelStyle] = {
            "q_proj": ColwiseParallel(),
            "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(),
            **({"gate_proj": ColwiseParallel()} if self.gate_proj is not None else {}),
            "o_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel
            else RowwiseParallel(),
        }  # fmt: skip
        if not sequence_parallel:
            return plan
        # Gather the normed sequence; cos, sin and doc_ids are already full and replicated.
        plan[""] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        )
        if self.q_norm is not None:
            # q_BTHd / k_BTKd carry the local heads on dim 2: a per-head norm is "sequence
            # parallel" over that dim, which also sums its weight's gradient over tp.
            for norm in ("q_norm", "k_norm"):
                plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return plan
