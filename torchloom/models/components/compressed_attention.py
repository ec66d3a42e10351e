"""DeepSeek-V4's attention (DeepSeek-V4 §2.3): shared-key-value multi-query attention whose
keys are [a sliding window of tokens | compressed groups of tokens] and whose softmax has a
learned sink per head. Three layer kinds:

- ``sliding_attention``: the window only (window 128: a query sees itself and 127 before it);
- ``heavily_compressed_attention`` (HCA): plus one key per completed group of ``compress``
  (128) tokens, pooled by a gated compressor (``GatedCompressor``);
- ``compressed_sparse_attention`` (CSA): groups of 4 tokens pooled with overlap (each key
  pools its group and the group before, two series of channels), of which a lightning indexer
  (``GroupIndexer``) picks the top-k per query.

Per token x: a low-rank query ``q_b_proj(q_a_norm(q_a_proj(x)))``, RMS-scaled per head without
a weight; one key = value ``kv_norm(kv_proj(x))``; RoPE on the trailing ``rope_dim`` channels
of each head as interleaved pairs (sliding layers with the "main" RoPE, compressed layers with
the "compress" RoPE for everything); a compressed key is rotated at its group's first position.
The output is rotated back by its query's position (so each key's contribution depends on the
distance only), then projected per head group (``o_a_proj``, block-diagonal) and mixed
(``o_b_proj``).

Each key set's visibility is an ``AttentionMask`` (kernels/attention_mask.py): the window's
``window`` + causal (+ document), the groups' ``compress`` (a query sees completed groups only)
and, for CSA, ``topk`` with the indexer's picks. ``_attend`` is the dense reference: one
SDPA-like softmax in PyTorch over [window | groups | sink] with those masks, O(T * (T + S))
(the CPU default, generation, and the indexer loss, which reads its probabilities over the
groups). Without a generation cache the layer can instead give each query its own key list
([window | seen groups], -1 padded) to kernels/sparse_attention.py, whose cost grows with
T * (window + topk) (``sparse_attention``: "gather" in PyTorch, "triton" fused, "auto": triton
on CUDA). With packed documents a group is visible only when every token it pools lies in the
query's document.

Generation (``CompressedState``) keeps per slot what DeepSeek's design keeps: a ring of the
last ``window`` rotated keys, the completed groups' rotated keys (the compressor's and, CSA,
the indexer's), each pooled once by the call that stores its last token, and the projections
the next groups still need (the partial group; overlapping, also the group before). A call
attends over [ring | its own keys | completed groups] with the same masks, by position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from torchloom.config.errors import ConfigError
from torchloom.kernels.attention_mask import AttentionMask
from torchloom.kernels.sparse_attention import sparse_attention
from torchloom.kernels.triton_support import use_triton
from torchloom.models.components.cache import Binding
from torchloom.models.components.dsa import HeadSum, indexer_kl
from torchloom.models.components.head_parallel import (
    HeadParallel,
    ReplicatedModule,
    SumInputGradient,
    SumOverRanks,
    local_shard,
)
from torchloom.models.components.hyper_connections import unweighted_rms_norm
from torchloom.models.components.norms import RMSNorm
from torchloom.models.components.param_init import ParamInit
from torchloom.models.components.rope import RopeConfig, inverse_frequencies

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
ATTENTION_KINDS = (SLIDING, CSA, HCA)


def rope_tables(
    cfg: RopeConfig, rope_dim: int, positions_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_BTF, sin_BTF (one angle per interleaved pair, fp32) of ``positions_BT``."""
    inv_freq_F, scale = inverse_frequencies(cfg, rope_dim, positions_BT.device)
    angles_BTF = positions_BT[..., None].float() * inv_freq_F
    return angles_BTF.cos() * scale, angles_BTF.sin() * scale


def rotate_tail(x_BHTd: torch.Tensor, cos_BTF: torch.Tensor, sin_BTF: torch.Tensor) -> torch.Tensor:
    """RoPE on the trailing 2F channels of each head as interleaved pairs (x0, x1), (x2, x3),
    ... in fp32; the leading channels pass unrotated. ``sin`` negated rotates back."""
    cos = cos_BTF.repeat_interleave(2, dim=-1)[:, None]
    sin = sin_BTF.repeat_interleave(2, dim=-1)[:, None]
    rope_dim = cos.shape[-1]
    nope, rope = x_BHTd[..., :-rope_dim], x_BHTd[..., -rope_dim:].float()
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope * cos + swapped * sin).to(x_BHTd.dtype)], dim=-1)


class GatedCompressor(nn.Module):
    """One key per group of ``ratio`` tokens: sum over the group of softmax(gate + slot
    embedding) * kv, then RMSNorm. ``overlap`` (CSA): the projections give two series of
    channels, and group j pools the first series of group j - 1 with the second of group j
    (2 * ratio slots; the first group's missing half weighs zero)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, norm_eps: float,
                 init_std: float = 0.02) -> None:  # fmt: skip
        super().__init__()
        self.head_dim, self.ratio, self.overlap, self.init_std = head_dim, ratio, overlap, init_std
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(dim, width, bias=False)
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        """Learned slot embeddings: one gate offset per place in the group."""
        self.kv_norm = RMSNorm(head_dim, norm_eps)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """[B, S, head_dim]: the S = T // ratio completed groups (a partial last group waits)."""
        return self.pool(self.project(x_BTD))

    def project(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """[B, T, 2 * width]: each token's kv and gate (what generation stores per position)."""
        return torch.cat([self.kv_proj(x_BTD), self.gate_proj(x_BTD)], dim=-1)

    def pool(self, projected_BTx: torch.Tensor) -> torch.Tensor:
        """The completed groups of tokens 0..T-1 from their ``project`` outputs."""
        B, T, _ = projected_BTx.shape
        r, d = self.ratio, self.head_dim
        S = T // r
        kv_BTw, gate_BTw = projected_BTx[:, : S * r].chunk(2, dim=-1)
        kv_BSrw = kv_BTw.reshape(B, S, r, kv_BTw.shape[-1])
        gate_BSrw = gate_BTw.reshape(B, S, r, kv_BTw.shape[-1]) + local_shard(self.position_bias)
        if self.overlap:
            kv = kv_BSrw.new_zeros(B, S, 2 * r, d)
            gate = gate_BSrw.new_full((B, S, 2 * r, d), float("-inf"))
            kv[:, :, r:], gate[:, :, r:] = kv_BSrw[..., d:], gate_BSrw[..., d:]
            kv[:, 1:, :r], gate[:, 1:, :r] = kv_BSrw[:, :-1, :, :d], gate_BSrw[:, :-1, :, :d]
            kv_BSrw, gate_BSrw = kv, gate
        weights = gate_BSrw.softmax(dim=2, dtype=torch.float32).to(kv_BSrw.dtype)
        return self.kv_norm((kv_BSrw * weights).sum(dim=2))

    def keys(
        self, projected_BTx: torch.Tensor, rope: RopeConfig, rope_dim: int,
        first_group_B: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[B, S, head_dim]: ``pool``, each key rotated at its group's first position (the
        tokens' first group is row b's ``first_group_B[b]``; None: group 0)."""
        keys_BSd = self.pool(projected_BTx)
        B, S, _ = keys_BSd.shape
        index_BS = torch.arange(S, device=keys_BSd.device).expand(B, S)
        if first_group_B is not None:
            index_BS = index_BS + first_group_B[:, None]
        tables = rope_tables(rope, rope_dim, index_BS * self.ratio)
        return rotate_tail(keys_BSd[:, None], *tables)[:, 0]

    def group_span(self, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """First and last token index each of the S keys pools."""
        index_S = torch.arange(S, device=device)
        first_S = (index_S - 1).clamp(min=0) * self.ratio if self.overlap else index_S * self.ratio
        return first_S, (index_S + 1) * self.ratio - 1

    def init_weights(self, init: ParamInit) -> None:
        init.trunc_normal_(self.kv_proj.weight, self.init_std)
        init.trunc_normal_(self.gate_proj.weight, self.init_std)
        init.zeros_(self.position_bias)
        self.kv_norm.init_weights(init)


class GroupIndexer(GatedCompressor):
    """CSA's lightning indexer: its own (overlapping) compressor at ``head_dim`` gives index
    keys; a query's score for group s is sum_h w_h relu(q_h . k_s) (w from ``weights_proj``);
    the top ``topk`` completed groups are its picks (-1 where it has fewer)."""

    def __init__(self, dim: int, q_lora_rank: int, num_heads: int, head_dim: int, ratio: int,
                 topk: int, norm_eps: float, init_std: float = 0.02) -> None:  # fmt: skip
        super().__init__(dim, head_dim, ratio, True, norm_eps, init_std)
        self.num_heads, self.topk = num_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, num_heads, bias=False)

    def pick(
        self, keys_BSd: torch.Tensor, x_BTD: torch.Tensor, q_latent_BTQ: torch.Tensor,
        rope: RopeConfig, rope_dim: int, positions_BT: torch.Tensor, visible_BTS: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(picks_BTk, scores_BTS): the groups each query attends to and every group's index
        score, against the rotated index keys ``keys_BSd`` (``keys``); ``visible_BTS`` says
        which it may pick (the others score -inf)."""
        B, T, _ = x_BTD.shape
        S = keys_BSd.shape[1]
        q_BHTd = self.q_b_proj(q_latent_BTQ).view(B, T, self.num_heads, -1).transpose(1, 2)
        q_BTHd = rotate_tail(q_BHTd, *rope_tables(rope, rope_dim, positions_BT)).transpose(1, 2)
        scores_BTHS = torch.matmul(q_BTHd.float(), keys_BSd.transpose(-1, -2).float()[:, None])
        scores_BTHS = F.relu(scores_BTHS) * self.head_dim**-0.5
        weights_BTH = self.weights_proj(x_BTD).float() * self.num_heads**-0.5
        scores_BTS = (scores_BTHS * weights_BTH[..., None]).sum(dim=2)
        scores_BTS = scores_BTS.masked_fill(~visible_BTS, float("-inf"))
        # A stable sort, not topk: tied scores (relu zeroes every head) go to the earliest
        # groups whatever S is, so a prefill, its decode steps and a longer forward agree.
        order_BTS = scores_BTS.sort(dim=-1, descending=True, stable=True).indices
        picks_BTk = order_BTS[..., : min(self.topk, S)]
        chosen_BTk = visible_BTS.gather(-1, picks_BTk)
        return torch.where(chosen_BTk, picks_BTk, -1), scores_BTS

    def init_weights(self, init: ParamInit) -> None:
        super().init_weights(init)
        init.trunc_normal_(self.q_b_proj.weight, self.init_std)
        init.trunc_normal_(self.weights_proj.weight, self.init_std)


def _first_pass() -> bool:
    """False while the backward pass recomputes a checkpointed forward (report once)."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1


def _span(module: GatedCompressor) -> int:
    """Token projections a group needs: its own ratio (and, overlapping, the group before)."""
    return 2 * module.ratio if module.overlap else module.ratio


class CompressedState:
    """One DeepSeek-V4 layer's generation state, bounded by the window and the groups: per
    slot a ring of the last ``window`` rotated token keys and their positions (-1: none), and
    per pooling module (the compressor; CSA's indexer) the pooled rotated keys of completed
    groups [slots, max_len // ratio, d] and a ring of the latest token projections (the
    partial group; overlapping, also the group before, whose first series the next group
    pools). A group is pooled once, by the call that stores its last token."""

    def __init__(self, slots: int, max_len: int, window: int, head_dim: int,
                 pooled: list[GatedCompressor], device: torch.device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.keys = torch.zeros(slots, window, head_dim, device=device, dtype=dtype)
        self.key_positions = torch.full((slots, window), -1, device=device, dtype=torch.long)
        self.ratios = [m.ratio for m in pooled]
        self.groups = [torch.zeros(slots, max_len // m.ratio, m.head_dim, device=device,
                                   dtype=dtype) for m in pooled]  # fmt: skip
        self.partial = [torch.zeros(slots, _span(m), 2 * m.kv_proj.weight.shape[0],
                                    device=device, dtype=dtype) for m in pooled]  # fmt: skip

    def bound(self, binding: Binding) -> BoundCompressedState:
        return BoundCompressedState(self, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        """The rings hold the state after the source's last token, so ``length`` is the
        number of tokens it holds (the generator copies right after the shared prefill)."""
        for tensor in (self.keys, self.key_positions, *self.partial):
            tensor[dst_slots_S] = tensor[src_slot].clone()  # cloned: it may overlap the target
        for groups, ratio in zip(self.groups, self.ratios, strict=True):
            groups[dst_slots_S, : length // ratio] = groups[src_slot, : length // ratio].clone()


class BoundCompressedState:
    """A CompressedState bound to one forward's rows (``binding``): row b's tokens before
    ``lengths_B[b]`` are real (none for a dummy row that is not live); only those are stored."""

    def __init__(self, state: CompressedState, binding: Binding) -> None:
        self.state, self.binding = state, binding
        T = binding.positions_BT.shape[1]
        self.first_B = binding.positions_BT[:, 0]
        real_B = binding.lengths_B if binding.lengths_B is not None else torch.full_like(self.first_B, T)  # fmt: skip
        if binding.live_B is not None:
            real_B = real_B.masked_fill(~binding.live_B, 0)
        self.end_B = self.first_B + real_B

    def window_keys(self, keys_BTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([ring | this call's keys] [B, window + T, d], their positions [B, 1, window + T]);
        ring entries not of this sequence before this call sit at -window (never visible).
        Stores the call's last real keys in the ring."""
        state, slots_B = self.state, self.binding.slot_ids_B
        window = state.keys.shape[1]
        ring_pos_BW = state.key_positions[slots_B]
        stale_BW = (ring_pos_BW < 0) | (ring_pos_BW >= self.first_B[:, None])
        ring_pos_BW = ring_pos_BW.masked_fill(stale_BW, -window)
        keys_BLd = torch.cat([state.keys[slots_B].to(keys_BTd.dtype), keys_BTd], dim=1)
        pos_BL = torch.cat([ring_pos_BW, self.binding.positions_BT], dim=1)
        self._write_ring(state.keys, keys_BTd)
        self._write_ring(state.key_positions, self.binding.positions_BT)
        return keys_BLd, pos_BL[:, None]

    def pooled_keys(
        self, which: int, module: GatedCompressor, projected_BTx: torch.Tensor, rope: RopeConfig,
        rope_dim: int,
    ) -> torch.Tensor:  # fmt: skip
        """The slot's completed groups' rotated keys of pooling module ``which`` [B, S, d]
        (S: those a query of this call can have seen), pooling the groups this call completes
        from the ring's projections and ``projected_BTx``, and storing them and the ring."""
        state, slots_B, first_B = self.state, self.binding.slot_ids_B, self.first_B
        T, r, span = projected_BTx.shape[1], module.ratio, _span(module)
        partial, groups = state.partial[which], state.groups[which]
        # Row b's buffer starts at `base`, the first token its first new group pools.
        base_B = first_B // r * r - (span - r)
        width = -(-(span - 1 + T) // r) * r
        pos_BX = base_B[:, None] + torch.arange(width, device=first_B.device)
        from_ring_BX = pos_BX < first_B[:, None]
        ring_BXx = partial[slots_B[:, None], pos_BX % span].to(projected_BTx.dtype)
        call_BXx = _tokens_at(projected_BTx, (pos_BX - first_B[:, None]).clamp(0, T - 1))
        buffer_BXx = torch.where(from_ring_BX[..., None], ring_BXx, call_BXx)
        if module.overlap:  # before position 0: nothing (the first group's missing half)
            kv, gate = buffer_BXx.chunk(2, dim=-1)
            before_BX1 = (pos_BX < 0)[..., None]
            buffer_BXx = torch.cat([kv.masked_fill(before_BX1, 0.0),
                                    gate.masked_fill(before_BX1, float("-inf"))], dim=-1)  # fmt: skip
        skip = (span - r) // r  # the group before, pooled here only for its first series
        index_BS = first_B[:, None] // r + torch.arange(width // r - skip, device=first_B.device)
        new_BSd = module.keys(buffer_BXx, rope, rope_dim, first_B // r - skip)[:, skip:]
        done_BS = index_BS < (self.end_B // r)[:, None]
        if index_BS.shape[1] == 1:  # a decode step: no host synchronisation
            rows_B1, at_B1 = slots_B[:, None], index_BS.clamp(max=groups.shape[1] - 1)
            groups[rows_B1, at_B1] = torch.where(done_BS[..., None], new_BSd.to(groups.dtype), groups[rows_B1, at_B1])  # fmt: skip
        else:
            rows_BS = slots_B[:, None].expand_as(index_BS)
            groups[rows_BS[done_BS], index_BS[done_BS]] = new_BSd[done_BS].to(groups.dtype)
        self._write_ring(partial, projected_BTx)
        if self.binding.leading:
            return groups[: slots_B.shape[0]].to(projected_BTx.dtype)
        return groups[slots_B, : self.binding.length // r].to(projected_BTx.dtype)

    def _write_ring(self, ring: torch.Tensor, values_BT: torch.Tensor) -> None:
        """Store each row's last real values (up to the ring's size) at position % size."""
        size, T = ring.shape[1], values_BT.shape[1]
        slots_B1 = self.binding.slot_ids_B[:, None]
        pos_BN = self.end_B[:, None] - size + torch.arange(size, device=ring.device)
        new_BN = pos_BN >= self.first_B[:, None]
        value_BN = _tokens_at(values_BT, (pos_BN - self.first_B[:, None]).clamp(0, T - 1))
        if values_BT.dim() == 3:
            new_BN = new_BN[..., None]
        at_BN = pos_BN % size
        ring[slots_B1, at_BN] = torch.where(new_BN, value_BN.to(ring.dtype), ring[slots_B1, at_BN])


def _tokens_at(values_BT: torch.Tensor, index_BN: torch.Tensor) -> torch.Tensor:
    """Row b's values (``[B, T]`` or ``[B, T, x]``) at its token indices ``index_BN[b]``."""
    if values_BT.dim() == 3:
        index_BN = index_BN[..., None].expand(-1, -1, values_BT.shape[-1])
    return values_BT.gather(1, index_BN)


class CompressedSparseAttention(nn.Module):
    """One DeepSeek-V4 attention layer of ``kind`` (a key of ATTENTION_KINDS):
    ``forward(x_BTD, positions_BT, doc_ids_BT=None, cache=None) -> y_BTD``."""

    def __init__(
        self, kind: str, dim: int, num_heads: int, head_dim: int, rope_dim: int, q_lora_rank: int,
        o_groups: int, o_lora_rank: int, window: int, compress: int, rope: RopeConfig,
        index_heads: int = 0, index_head_dim: int = 0, index_topk: int = 0,
        norm_eps: float = 1e-6, init_std: float = 0.02, out_std: float | None = None,
        indexer_loss_weight: float = 0.0, sparse_attention: str = "auto",
    ) -> None:  # fmt: skip
        """``indexer_loss_weight``: the weight of the indexer's loss (``dsa.indexer_kl``);
        ``sparse_attention``: see DeepSeekV4Config.sparse_attention."""
        super().__init__()
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"unknown DeepSeek-V4 attention kind {kind!r}; one of {ATTENTION_KINDS}")  # fmt: skip
        self.kind, self.num_heads, self.head_dim = kind, num_heads, head_dim
        self.rope_dim, self.o_groups, self.rope = rope_dim, o_groups, rope
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        self.norm_eps, self.indexer_loss_weight = norm_eps, indexer_loss_weight
        self.sparse_attention = sparse_attention
        self._auxiliary: dict[str, torch.Tensor] = {}
        self.q_a_proj = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, norm_eps)
        # Grouped output projection: each of o_groups head groups to o_lora_rank, then mixed.
        group_width = num_heads * head_dim // o_groups
        self.o_a_proj = nn.Linear(group_width, o_groups * o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.shared_keys = nn.Identity()
        """Where the one key = value head meets the query heads (tensor parallelism sums its
        gradient over the ranks, each of which attends with its own heads)."""
        self.head_sum = HeadSum()  # the indexer loss's target: every head's, also under tp
        self.window_mask = AttentionMask(window=window, sink=True)
        self.compressor: GatedCompressor | None = None
        self.indexer: GroupIndexer | None = None
        self.group_mask: AttentionMask | None = None
        if kind != SLIDING:
            self.compressor = GatedCompressor(dim, head_dim, compress, kind == CSA, norm_eps, init_std)  # fmt: skip
            sparse = index_topk if kind == CSA else None
            self.group_mask = AttentionMask(compress=compress, topk=sparse, document=False, sink=True)  # fmt: skip
        if kind == CSA:
            self.indexer = GroupIndexer(dim, q_lora_rank, index_heads, index_head_dim, compress,
                                            index_topk, norm_eps, init_std)  # fmt: skip

    def forward(
        self, x_BTD: torch.Tensor, positions_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None = None,
        cache: BoundCompressedState | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Without ``cache`` the keys are this call's tokens (key index = place in the row,
        packed documents by ``doc_ids_BT``); with one (generation) they are the slot's last
        ``window`` tokens before this call and this call's, and the slot's completed groups
        (key index = position; the state is updated by this call)."""
        B, T, _ = x_BTD.shape
        d = self.head_dim  # the heads: num_heads, or this rank's share under tensor parallelism
        cos_BTF, sin_BTF = rope_tables(self.rope, self.rope_dim, positions_BT)
        q_latent_BTQ = self.q_a_norm(self.q_a_proj(x_BTD))
        q_BHTd = self.q_b_proj(q_latent_BTQ).view(B, T, -1, d).transpose(1, 2)
        q_BHTd = rotate_tail(unweighted_rms_norm(q_BHTd, self.norm_eps), cos_BTF, sin_BTF)
        kv_B1Td = self.kv_norm(self.kv_proj(x_BTD)).view(B, T, 1, d).transpose(1, 2)
        keys_BTd = rotate_tail(kv_B1Td, cos_BTF, sin_BTF)[:, 0]
        # The indexer reads detached inputs: its top-k passes no gradient to the main model
        # anyway, and its own loss (indexer_kl) must train it alone.
        projected = [] if self.compressor is None else [self.compressor.project(x_BTD)]
        if self.indexer is not None:
            projected.append(self.indexer.project(x_BTD.detach()))
        key_index_L = torch.arange(T, device=x_BTD.device)
        if cache is None:
            query_index_BT = key_index_L.expand(B, T)
        else:  # keys: [the slot's window ring | this call's], indexed by position
            query_index_BT, doc_ids_BT = cache.binding.positions_BT, None
            keys_BTd, key_index_L = cache.window_keys(keys_BTd)
        keys_B1Ld = keys_BTd[:, None]
        index_scores_BTS = seen_BTS = None
        if self.compressor is not None:
            groups_B1Sd, seen_BTS, index_scores_BTS = self._groups(
                projected, x_BTD, q_latent_BTQ, positions_BT, query_index_BT, doc_ids_BT, cache
            )
            keys_B1Ld = torch.cat([keys_B1Ld, groups_B1Sd], dim=2)
        indexer_loss = (index_scores_BTS is not None and self.indexer_loss_weight > 0
                        and self.training and torch.is_grad_enabled())  # fmt: skip
        impl = self._sparse_impl(x_BTD) if cache is None and not indexer_loss else None
        keys_B1Ld = self.shared_keys(keys_B1Ld)
        if impl is not None:
            out_BHTd = self._attend_sparse(q_BHTd, keys_B1Ld[:, 0], seen_BTS, doc_ids_BT, impl)
        else:
            docs = () if doc_ids_BT is None else (doc_ids_BT[:, :, None], doc_ids_BT[:, None, :])
            visible_BTL = self.window_mask.visible(query_index_BT[..., None], key_index_L, *docs)
            if seen_BTS is not None:
                visible_BTL = torch.cat([visible_BTL, seen_BTS], dim=-1)
            out_BHTd, probs_BHTL = self._attend(q_BHTd, keys_B1Ld, visible_BTL)
        if indexer_loss and _first_pass():
            S = index_scores_BTS.shape[-1]
            loss = indexer_kl(self.head_sum(probs_BHTL[..., -S:]), index_scores_BTS, seen_BTS)
            self._auxiliary = {"indexer": self.indexer_loss_weight * loss}
        out_BHTd = rotate_tail(out_BHTd, cos_BTF, -sin_BTF)
        weight_Xi = local_shard(self.o_a_proj.weight)  # [G * R, i], G: this rank's groups
        grouped_BTGi = out_BHTd.transpose(1, 2).reshape(B, T, -1, weight_Xi.shape[-1])
        weight_GRi = weight_Xi.view(grouped_BTGi.shape[2], -1, weight_Xi.shape[-1])
        mixed_BTGR = torch.einsum("btgi,gri->btgr", grouped_BTGi, weight_GRi)
        return self.o_b_proj(mixed_BTGR.flatten(2))

    def _groups(
        self, projected: list[torch.Tensor], x_BTD: torch.Tensor, q_latent_BTQ: torch.Tensor,
        positions_BT: torch.Tensor, query_index_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None,
        cache: BoundCompressedState | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The compressed keys [B, 1, S, d] pooled from this call's ``projected`` tokens or
        (``cache``) the slot's completed groups (rotated at their groups' first positions),
        which of them each query sees [B, T, S] (completed
        groups (``group_mask``), whole in its document, and (CSA) its indexer's picks), and
        (CSA) the index scores [B, T, S]."""
        assert self.compressor is not None and self.group_mask is not None
        B, T, _ = x_BTD.shape
        device = x_BTD.device
        modules = [self.compressor] if self.indexer is None else [self.compressor, self.indexer]
        if cache is None:
            pooled = [m.keys(p, self.rope, self.rope_dim) for m, p in zip(modules, projected)]
        else:
            pooled = [cache.pooled_keys(i, m, p, self.rope, self.rope_dim)
                      for i, (m, p) in enumerate(zip(modules, projected))]  # fmt: skip
        groups_B1Sd = pooled[0][:, None]
        S = groups_B1Sd.shape[2]
        key_pos_S = self.group_mask.key_positions(S, device)
        seen_BTS = self.group_mask.visible(query_index_BT[..., None], key_pos_S)
        if doc_ids_BT is not None:
            first_S, last_S = self.compressor.group_span(S, device)
            doc_BT1 = doc_ids_BT[:, :, None]
            seen_BTS = seen_BTS & (doc_ids_BT[:, None, first_S] == doc_BT1)
            seen_BTS = seen_BTS & (doc_ids_BT[:, None, last_S] == doc_BT1)
        index_scores_BTS = None
        if self.indexer is not None and S:
            picks_BTk, index_scores_BTS = self.indexer.pick(
                pooled[1], x_BTD.detach(), q_latent_BTQ.detach(), self.rope, self.rope_dim,
                positions_BT, seen_BTS,
            )  # fmt: skip
            picked_BTS = torch.zeros(B, T, S + 1, dtype=torch.bool, device=device)
            picked_BTS.scatter_(-1, torch.where(picks_BTk < 0, S, picks_BTk), True)
            seen_BTS = seen_BTS & picked_BTS[..., :S]
        return groups_B1Sd, seen_BTS, index_scores_BTS

    def pop_auxiliary_losses(self) -> dict[str, torch.Tensor]:
        """The indexer loss of the last training forward (with indexer_loss_weight), once."""
        terms, self._auxiliary = self._auxiliary, {}
        return terms

    def _attend(
        self, q_BHTd: torch.Tensor, keys_B1Ld: torch.Tensor, visible_BTL: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, probabilities [B, H, T, L]): softmax over [visible keys | this head's
        sink] (the sink attends to nothing), keys doubling as values."""
        B, H, T, _ = q_BHTd.shape
        logits_BHTL = torch.matmul(q_BHTd, keys_B1Ld.transpose(-1, -2)) * self.head_dim**-0.5
        logits_BHTL = logits_BHTL.masked_fill(~visible_BTL[:, None], float("-inf"))
        sinks_BHT1 = local_shard(self.sinks).to(logits_BHTL).view(1, H, 1, 1).expand(B, H, T, 1)
        logits_BHTL = torch.cat([logits_BHTL, sinks_BHT1], dim=-1)
        logits_BHTL = logits_BHTL - logits_BHTL.max(dim=-1, keepdim=True).values
        probs_BHTL = logits_BHTL.softmax(dim=-1)[..., :-1].to(keys_B1Ld.dtype)
        return torch.matmul(probs_BHTL, keys_B1Ld), probs_BHTL

    def _sparse_impl(self, x_BTD: torch.Tensor) -> str | None:
        """The kernels/sparse_attention impl a forward without cache runs ("gather" or
        "triton"), or None for the dense reference (``_attend``)."""
        impl = self.sparse_attention
        if impl == "auto":
            impl = "triton" if use_triton(x_BTD) else "dense"
        return None if impl == "dense" else impl

    def _attend_sparse(
        self, q_BHTd: torch.Tensor, keys_BLd: torch.Tensor, seen_BTS: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None, impl: str,
    ) -> torch.Tensor:  # fmt: skip
        """``_attend``'s output from each query's own key list (kernels/sparse_attention.py):
        its window (t - window + 1 .. t, >= 0, same document) then T + the groups it sees, -1
        padded: CSA's at most topk picks, or for HCA every group's slot (S = T / ratio keys
        per query, those not yet completed padding: a cost of window + T / ratio keys a query
        instead of its completed groups only)."""
        B, _, T, _ = q_BHTd.shape
        device = q_BHTd.device
        window = self.window_mask.window
        assert window is not None
        t_T1 = torch.arange(T, device=device)[:, None]
        window_TW = t_T1 - window + 1 + torch.arange(window, device=device)
        window_BTW = window_TW.expand(B, T, window)
        if doc_ids_BT is None:
            seen_BTW = window_BTW >= 0
        else:  # packed documents are contiguous: a key is in t's document from its first token
            starts_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
            starts_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
            first_BT = torch.where(starts_BT, t_T1[:, 0], 0).cummax(dim=1).values
            seen_BTW = window_BTW >= first_BT[..., None]
        index_BTK = torch.where(seen_BTW, window_BTW, -1)
        if seen_BTS is not None and seen_BTS.shape[-1]:
            S = seen_BTS.shape[-1]
            if self.indexer is not None:  # at most topk seen groups: take them all
                seen_BTk, group_BTk = seen_BTS.to(torch.int8).topk(min(self.indexer.topk, S))
                group_BTk = torch.where(seen_BTk > 0, T + group_BTk, -1)
            else:
                group_BTk = torch.where(seen_BTS, T + torch.arange(S, device=device), -1)
            index_BTK = torch.cat([index_BTK, group_BTk], dim=-1)
        return sparse_attention(q_BHTd, keys_BLd, index_BTK.to(torch.int32), local_shard(self.sinks),
                                self.head_dim**-0.5, impl)  # fmt: skip

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> CompressedState:
        """Per slot: the window's rotated keys and (compressed kinds) the compressor's and the
        indexer's completed groups and latest projections (``CompressedState``)."""
        pooled = [m for m in (self.compressor, self.indexer) if m is not None]
        window = self.window_mask.window
        assert window is not None
        return CompressedState(slots, max_len, window, self.head_dim, pooled, device, dtype)

    def init_weights(self, init: ParamInit) -> None:
        """Projections truncated normal(0, init_std), o_b_proj at out_std, norms one, sinks zero."""
        for linear in (self.q_a_proj, self.q_b_proj, self.kv_proj, self.o_a_proj):
            init.trunc_normal_(linear.weight, self.init_std)
        init.trunc_normal_(self.o_b_proj.weight, self.out_std)
        self.q_a_norm.init_weights(init)
        self.kv_norm.init_weights(init)
        init.zeros_(self.sinks)
        for module in (self.compressor, self.indexer):
            if module is not None:
                module.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, averaged over a causal sequence of ``seq_len``: 6 per weight
        it uses, 12 per head channel and key it sees (scores and weighted sum, forward and
        backward: the window, the completed groups or, for CSA, the picked ones) and the
        indexer's scores against every completed group (forward only: its top-k passes no
        gradient)."""
        weights = sum(p.numel() for n, p in self.named_parameters() if n.endswith("weight"))
        half = seq_len / 2  # a causal query sees half the sequence on average
        keys = min(self.window_mask.window or seq_len, half)
        indexer = 0.0
        if self.compressor is not None:
            groups = half / self.compressor.ratio
            keys += groups if self.indexer is None else min(groups, self.indexer.topk)
            if self.indexer is not None:
                indexer = 2 * self.indexer.num_heads * self.indexer.head_dim * groups
        return int(6 * weights + 12 * self.num_heads * self.head_dim * keys + indexer)

    def check_tp(self, tp: int) -> None:
        """ConfigError unless each tp rank can take whole heads in whole output groups."""
        if self.num_heads % tp or self.o_groups % tp:
            raise ConfigError(
                f"--parallel.tp {tp} must divide the model's num_heads ({self.num_heads}) and "
                f"o_groups ({self.o_groups}): every tensor-parallel rank holds whole head groups "
                "of the grouped output projection. Choose a tp that divides both."
            )

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """Heads split: q_b_proj column-wise, the sinks by head, o_a_proj by head group (rows of
        whole groups) and o_b_proj row-wise. Everything that makes the one key = value head
        (kv_proj, kv_norm, the compressor) and the low-rank query are replicated: every rank
        computes them whole, the shared keys' gradient summed over the ranks
        (``shared_keys``), the query latent's by q_b_proj. The indexer is replicated too, so
        every rank scores and picks the same groups; the indexer loss's target adds up the
        ranks' heads (``head_sum``). With ``sequence_parallel`` the input is
        gathered first and o_b_proj's output scattered back along the sequence."""
        heads, replicated = Shard(0), ReplicatedModule()
        split = {"sinks": heads, "o_a_proj.weight": heads}
        plan: dict[str, ParallelStyle] = {
            "q_b_proj": ColwiseParallel(),
            "shared_keys": SumInputGradient(),
            "head_sum": SumOverRanks(),
            "o_b_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel
            else RowwiseParallel(),
        }  # fmt: skip
        for name in ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm"):
            plan[name] = replicated
        for prefix, module in (("compressor", self.compressor), ("indexer", self.indexer)):
            if module is None:
                continue
            split[f"{prefix}.position_bias"] = Replicate()  # read whole with local_shard
            for name, child in module.named_children():
                if isinstance(child, nn.Linear | RMSNorm):
                    plan[f"{prefix}.{name}"] = replicated
        plan[""] = HeadParallel(split, gather_input=sequence_parallel, inputs=3)
        return plan
