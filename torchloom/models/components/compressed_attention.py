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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.kernels.attention_mask import AttentionMask
from torchloom.kernels.sparse_attention import sparse_attention
from torchloom.kernels.triton_support import use_triton
from torchloom.models.components.cache import Binding
from torchloom.models.components.dsa import indexer_kl
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
        gate_BSrw = gate_BTw.reshape(B, S, r, kv_BTw.shape[-1]) + self.position_bias
        if self.overlap:
            kv = kv_BSrw.new_zeros(B, S, 2 * r, d)
            gate = gate_BSrw.new_full((B, S, 2 * r, d), float("-inf"))
            kv[:, :, r:], gate[:, :, r:] = kv_BSrw[..., d:], gate_BSrw[..., d:]
            kv[:, 1:, :r], gate[:, 1:, :r] = kv_BSrw[:, :-1, :, :d], gate_BSrw[:, :-1, :, :d]
            kv_BSrw, gate_BSrw = kv, gate
        weights = gate_BSrw.softmax(dim=2, dtype=torch.float32).to(kv_BSrw.dtype)
        return self.kv_norm((kv_BSrw * weights).sum(dim=2))

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
        self, projected_BLx: torch.Tensor, x_BTD: torch.Tensor, q_latent_BTQ: torch.Tensor,
        rope: RopeConfig, rope_dim: int, positions_BT: torch.Tensor, visible_BTS: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(picks_BTk, scores_BTS): the groups each query attends to and every group's index
        score, against index keys pooled from ``projected_BLx`` (``project`` of tokens
        0..L-1); ``visible_BTS`` says which it may pick (the others score -inf)."""
        B, T, _ = x_BTD.shape
        keys_BSd = self.pool(projected_BLx)
        S = keys_BSd.shape[1]
        key_pos_BS = (torch.arange(S, device=x_BTD.device) * self.ratio).expand(B, S)
        keys_BSd = rotate_tail(keys_BSd[:, None], *rope_tables(rope, rope_dim, key_pos_BS))[:, 0]
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


class CompressedState:
    """One DeepSeek-V4 layer's generation state: per slot and position, the rotated key and
    the compressor's / indexer's projections of that token ([slots, max_len, width] each).
    Indexed by position like a KV cache, so a decode step sees exactly the keys and groups the
    full forward would: a group is pooled once its last token is stored (the compressor's
    partial group and the indexer's overlap are the positions stored so far)."""

    def __init__(self, slots: int, max_len: int, widths: list[int], device: torch.device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.tensors = [torch.zeros(slots, max_len, w, device=device, dtype=dtype) for w in widths]

    def bound(self, binding: Binding) -> BoundCompressedState:
        return BoundCompressedState(self, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        for tensor in self.tensors:  # the source cloned: it may overlap the target
            tensor[dst_slots_S, :length] = tensor[src_slot, :length].clone()


class BoundCompressedState:
    """A CompressedState bound to one forward's rows (``binding``)."""

    def __init__(self, state: CompressedState, binding: Binding) -> None:
        self.state, self.binding = state, binding

    def stored(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Store this call's [B, T, width] values at their rows' slots and positions; return
        each row's values at positions 0..L-1 (L: past the furthest query)."""
        bound = self.binding
        rows_B1, pos_BT = bound.slot_ids_B[:, None], bound.positions_BT
        out = []
        for tensor, value_BTx in zip(self.state.tensors, values, strict=True):
            tensor[rows_B1, pos_BT] = value_BTx.to(tensor.dtype)
            if bound.leading:  # slots 0..B-1, every index
                read = tensor[: pos_BT.shape[0]]
            else:
                read = tensor[bound.slot_ids_B, : bound.length]
            out.append(read.to(value_BTx.dtype))
        return out


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
        packed documents by ``doc_ids_BT``); with one (generation) they are the slot's tokens
        0..L-1 (key index = position), this call's stored first."""
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        cos_BTF, sin_BTF = rope_tables(self.rope, self.rope_dim, positions_BT)
        q_latent_BTQ = self.q_a_norm(self.q_a_proj(x_BTD))
        q_BHTd = self.q_b_proj(q_latent_BTQ).view(B, T, H, d).transpose(1, 2)
        q_BHTd = rotate_tail(unweighted_rms_norm(q_BHTd, self.norm_eps), cos_BTF, sin_BTF)
        kv_B1Td = self.kv_norm(self.kv_proj(x_BTD)).view(B, T, 1, d).transpose(1, 2)
        keys_BTd = rotate_tail(kv_B1Td, cos_BTF, sin_BTF)[:, 0]
        # The indexer reads detached inputs: its top-k passes no gradient to the main model
        # anyway, and its own loss (indexer_kl) must train it alone.
        projected = [] if self.compressor is None else [self.compressor.project(x_BTD)]
        if self.indexer is not None:
            projected.append(self.indexer.project(x_BTD.detach()))
        if cache is None:
            query_index_BT = torch.arange(T, device=x_BTD.device).expand(B, T)
        else:  # the slot's keys and projections so far, this call's included
            query_index_BT, doc_ids_BT = cache.binding.positions_BT, None
            keys_BTd, *projected = cache.stored([keys_BTd, *projected])
        keys_B1Ld = keys_BTd[:, None]
        index_scores_BTS = seen_BTS = None
        if self.compressor is not None:
            groups_B1Sd, seen_BTS, index_scores_BTS = self._groups(
                projected, x_BTD, q_latent_BTQ, positions_BT, query_index_BT, doc_ids_BT
            )
            keys_B1Ld = torch.cat([keys_B1Ld, groups_B1Sd], dim=2)
        indexer_loss = (index_scores_BTS is not None and self.indexer_loss_weight > 0
                        and self.training and torch.is_grad_enabled())  # fmt: skip
        impl = self._sparse_impl(x_BTD) if cache is None and not indexer_loss else None
        if impl is not None:
            out_BHTd = self._attend_sparse(q_BHTd, keys_B1Ld[:, 0], seen_BTS, doc_ids_BT, impl)
        else:
            key_index_L = torch.arange(keys_BTd.shape[1], device=x_BTD.device)
            docs = () if doc_ids_BT is None else (doc_ids_BT[:, :, None], doc_ids_BT[:, None, :])
            visible_BTL = self.window_mask.visible(query_index_BT[..., None], key_index_L, *docs)
            if seen_BTS is not None:
                visible_BTL = torch.cat([visible_BTL, seen_BTS], dim=-1)
            out_BHTd, probs_BHTL = self._attend(q_BHTd, keys_B1Ld, visible_BTL)
        if indexer_loss and _first_pass():
            S = index_scores_BTS.shape[-1]
            loss = indexer_kl(probs_BHTL[..., -S:].sum(1), index_scores_BTS, seen_BTS)
            self._auxiliary = {"indexer": self.indexer_loss_weight * loss}
        out_BHTd = rotate_tail(out_BHTd, cos_BTF, -sin_BTF)
        grouped_BTGi = out_BHTd.transpose(1, 2).reshape(B, T, self.o_groups, -1)
        weight_GRi = self.o_a_proj.weight.view(self.o_groups, -1, grouped_BTGi.shape[-1])
        mixed_BTGR = torch.einsum("btgi,gri->btgr", grouped_BTGi, weight_GRi)
        return self.o_b_proj(mixed_BTGR.flatten(2))

    def _groups(
        self, projected: list[torch.Tensor], x_BTD: torch.Tensor, q_latent_BTQ: torch.Tensor,
        positions_BT: torch.Tensor, query_index_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The compressed keys [B, 1, S, d] pooled from the keys' ``projected`` tokens (rotated
        at their groups' first positions), which of them each query sees [B, T, S] (completed
        groups (``group_mask``), whole in its document, and (CSA) its indexer's picks), and
        (CSA) the index scores [B, T, S]."""
        assert self.compressor is not None and self.group_mask is not None
        B, T, _ = x_BTD.shape
        device = x_BTD.device
        groups_BSd = self.compressor.pool(projected[0])
        S = groups_BSd.shape[1]
        group_pos_BS = (torch.arange(S, device=device) * self.compressor.ratio).expand(B, S)
        groups_B1Sd = rotate_tail(groups_BSd[:, None], *rope_tables(self.rope, self.rope_dim, group_pos_BS))  # fmt: skip
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
                projected[1], x_BTD.detach(), q_latent_BTQ.detach(), self.rope, self.rope_dim,
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
        sinks_BHT1 = self.sinks.to(logits_BHTL.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
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
        seen_BTW = window_BTW >= 0
        if doc_ids_BT is not None:
            window_docs_BTW = doc_ids_BT.gather(1, window_BTW.clamp(min=0).flatten(1)).view_as(window_BTW)  # fmt: skip
            seen_BTW = seen_BTW & (window_docs_BTW == doc_ids_BT[..., None])
        index_BTK = torch.where(seen_BTW, window_BTW, -1)
        if seen_BTS is not None and seen_BTS.shape[-1]:
            S = seen_BTS.shape[-1]
            if self.indexer is not None:  # at most topk seen groups: take them all
                seen_BTk, group_BTk = seen_BTS.to(torch.int8).topk(min(self.indexer.topk, S))
                group_BTk = torch.where(seen_BTk > 0, T + group_BTk, -1)
            else:
                group_BTk = torch.where(seen_BTS, T + torch.arange(S, device=device), -1)
            index_BTK = torch.cat([index_BTK, group_BTk], dim=-1)
        return sparse_attention(q_BHTd, keys_BLd, index_BTK.to(torch.int32), self.sinks,
                                self.head_dim**-0.5, impl)  # fmt: skip

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> CompressedState:
        """Per slot and position: the rotated key and (compressed kinds) the compressor's and
        the indexer's projections; the completed groups are pooled from them at each step."""
        widths = [self.head_dim]
        widths += [2 * m.kv_proj.weight.shape[0] for m in (self.compressor, self.indexer) if m]
        return CompressedState(slots, max_len, widths, device, dtype)

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
