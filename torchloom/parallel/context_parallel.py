"""Context parallelism: every sequence is split over the ``cp`` ranks, attention gathers K/V.

Sharding. Each row of T tokens is cut into 2 * cp chunks of T / (2 * cp); rank r keeps chunks
r and 2 * cp - 1 - r, in that order. Under a causal mask a query's work grows with its index,
so pairing an early chunk with the mirrored late one gives every rank the same work. Every per-token
field (tokens, labels, positions, doc ids, extras) is sharded alike; positions and doc ids keep their global values,
so RoPE and the document mask need no change.

Attention. Each rank projects q/k/v for its own tokens, all-gathers K and V (and doc ids) over
the cp group, and attends with its local queries to all T keys under the layer's
``AttentionMask`` read on global indices (causal and same document by default; a sliding
window or chunk is the same rule on the same indices, so it holds as it does without cp). The all-gather's backward sums
the ranks' gradients of each K/V shard (a reduce-scatter). K/V memory per rank is O(T), like
Llama 3's all-gather CP; a ring (send/recv) variant would bring it to O(T / cp).

The global index of every local token follows from (cp rank, cp size, local length) alone (see
``global_token_index``), so the attention wrapper needs no per-forward context from the trainer.

Gradients. cp ranks hold the same parameters and see different tokens of the same rows: their
gradients must be summed. FSDP shards over ``dp_shard_cp``, which contains cp, so its
reduce-scatter does this (also for cp alone: then dp_shard_cp *is* the cp mesh); the trainer
sums token losses and label counts over ``dp_cp``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchloom.config.errors import ConfigError
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.models.components.attention import Attention, AttentionBackend


def check_context_parallel(seq_len: int, cp: int) -> None:
    """Load balancing cuts every row into 2 * cp equal chunks."""
    if seq_len % (2 * cp):
        raise ConfigError(
            f"--training.seq_len {seq_len} is not divisible by 2 x --parallel.cp = {2 * cp}: "
            f"context parallelism cuts each sequence into {2 * cp} equal chunks (two per rank, "
            f"to balance causal attention). Use a multiple of {2 * cp} "
            f"(e.g. {(seq_len // (2 * cp) + 1) * 2 * cp})."
        )


def global_token_index(cp_rank: int, cp_size: int, local_len: int) -> torch.Tensor:
    """[local_len] int64: the position in the full row of each of ``cp_rank``'s tokens."""
    chunk = local_len // 2
    steps = torch.arange(chunk)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first + steps, second + steps])


def shard_sequence(t_BT: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This cp rank's tokens of every row of a ``[B, T, ...]`` tensor (see the module docstring
    for which ones); apply it to every per-token field of a batch alike."""
    T = t_BT.shape[1]
    check_context_parallel(T, cp_size)
    index = global_token_index(cp_rank, cp_size, T // cp_size).to(t_BT.device)
    return t_BT.index_select(1, index)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of the sharding: the full sequence from every cp rank's shard, in rank order."""
    cp_size, local_len = len(shards), shards[0].shape[dim]
    index = torch.cat([global_token_index(r, cp_size, local_len) for r in range(cp_size)])
    gathered = torch.cat(shards, dim=dim)
    full = torch.empty_like(gathered)
    full.index_copy_(dim, index.to(gathered.device), gathered)
    return full


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` in rank order; backward sums the ranks' gradients of each shard
    and hands each rank its own (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size = dist.get_world_size(group)
        x0 = x.movedim(dim, 0).contiguous()
        out = x0.new_empty((size * x0.shape[0], *x0.shape[1:]))
        dist.all_gather_into_tensor(out, x0, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, size = ctx.group, dist.get_world_size(ctx.group)
        g0 = grad.movedim(ctx.dim, 0).contiguous()
        local = g0.new_empty((g0.shape[0] // size, *g0.shape[1:]))
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(g0, group=group)
            local.copy_(g0.chunk(size)[dist.get_rank(group)])
        else:
            dist.reduce_scatter_tensor(local, g0, group=group)
        return local.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather of ``x`` along ``dim`` over ``group``, in rank order."""
    return _GatherSequence.apply(x, dim, group)


class ContextParallelAttention:
    """An attention backend for a cp rank's tokens: local queries against the gathered keys.

    Replaces any backend (each computes the same function); it runs SDPA with an explicit
    boolean mask, since the keys are out of order and the mask follows global indices.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.rank, self.size = mesh.get_local_rank(), mesh.size()

    def __call__(
        self,
        q_BHtd: torch.Tensor,
        k_BKtd: torch.Tensor,
        v_BKtd: torch.Tensor,
        doc_ids_Bt: torch.Tensor | None,
        mask: AttentionMask = CAUSAL,
    ) -> torch.Tensor:
        local_len, device = q_BHtd.shape[2], q_BHtd.device
        # One collective for K and V together; t is local, T = cp * t is the full row.
        kv_BKTd = gather_sequence(torch.cat([k_BKtd, v_BKtd], dim=-1), 2, self.group)
        k_BKTd, v_BKTd = kv_BKTd.split(k_BKtd.shape[-1], dim=-1)
        q_index_t = global_token_index(self.rank, self.size, local_len).to(device)
        k_index_T = torch.cat(
            [global_token_index(r, self.size, local_len) for r in range(self.size)]
        ).to(device)
        mask_BtT = mask.visible(q_index_t[:, None], k_index_T[None, :]).unsqueeze(0)
        if doc_ids_Bt is not None and mask.document:
            doc_ids_BT = gather_sequence(doc_ids_Bt, 1, self.group)
            mask_BtT = mask_BtT & (doc_ids_Bt[:, :, None] == doc_ids_BT[:, None, :])
        # Masked kernels take no enable_gqa (see sdpa_attention): repeat the kv heads.
        group = q_BHtd.shape[1] // k_BKTd.shape[1]
        k_BHTd = k_BKTd.repeat_interleave(group, dim=1)
        v_BHTd = v_BKTd.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(
            q_BHtd, k_BHTd, v_BHTd, attn_mask=mask_BtT.unsqueeze(1)
        )


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make every Attention module of ``model`` attend across the cp group (in place). The
    model must then be fed ``shard_sequence``'s shards; nothing else in it changes. Each layer
    keeps its mask (the backend is called with it)."""
    backend: AttentionBackend = ContextParallelAttention(cp_mesh)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = backend
