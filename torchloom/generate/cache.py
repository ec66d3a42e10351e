"""The KV cache the generator passes through the model's own forward.

A fixed pool of ``slots`` sequences, each up to ``max_len`` tokens: keys and values per layer as
[slots, kv_heads, max_len, head_dim]. A request owns one slot from its prefill until it ends, so
requests join and leave between decode steps without moving anyone else's cache. A token at
position p of its sequence lives at index p of its slot, so a query at position p attends to
indices 0..p of its own slot.

Two ways to bind a forward to the cache:
- ``bind(slot_ids, positions)``: rows are any slots; keys are gathered up to the furthest
  query (a host read of the positions). Used for prefill.
- ``bind_leading(rows, positions)``: rows are slots 0..rows-1 and every key index up to
  ``max_len`` is read through a mask, with no host synchronisation and no copy, so the step
  can be captured in a CUDA graph (torchloom/generate/graphs.py).
"""

from __future__ import annotations

import torch

from torchloom.kernels import batch_invariant
from torchloom.models.components.transformer import TransformerConfig


class KVCache:
    """Keys and values of every layer for ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self,
        config: TransformerConfig,
        slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_heads: int | None = None,
    ) -> None:
        """``kv_heads``: the heads this rank holds (tensor parallelism); default all."""
        self.batch_invariant = config.batch_invariant
        shape = (slots, kv_heads or config.num_kv_heads, max_len, config.resolved_head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.slots, self.max_len = slots, max_len
        self._slot_ids_B: torch.Tensor | None = None
        self._positions_BT: torch.Tensor | None = None
        self._leading = False

    def bind(self, slot_ids_B: torch.Tensor, positions_BT: torch.Tensor) -> KVCache:
        """Set which slots the next forward's rows are and where their tokens go; returns self
        (pass it as ``model(tokens, positions, cache=...)``)."""
        self._slot_ids_B, self._positions_BT, self._leading = slot_ids_B, positions_BT, False
        return self

    def bind_leading(self, positions_BT: torch.Tensor) -> KVCache:
        """Rows are slots 0..B-1 (B = positions_BT.shape[0]); shapes depend only on B."""
        rows = positions_BT.shape[0]
        slot_ids_B = torch.arange(rows, device=positions_BT.device)
        self._slot_ids_B, self._positions_BT, self._leading = slot_ids_B, positions_BT, True
        return self

    def layer(self, index: int) -> _LayerView:
        assert self._slot_ids_B is not None and self._positions_BT is not None, "bind() first"
        return _LayerView(self, index, self._slot_ids_B, self._positions_BT)


class _LayerView:
    def __init__(
        self, cache: KVCache, index: int, slot_ids_B: torch.Tensor, positions_BT: torch.Tensor
    ) -> None:
        self.cache, self.index = cache, index
        self.slot_ids_B, self.positions_BT = slot_ids_B, positions_BT

    def attend(
        self, q_BHTd: torch.Tensor, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor
    ) -> torch.Tensor:
        cache = self.cache
        k_cache, v_cache = cache.k[self.index], cache.v[self.index]
        rows_B1, pos_BT = self.slot_ids_B[:, None], self.positions_BT
        # Advanced indexing [slots, :, positions] puts the indexed dims first: [B, T, K, d].
        k_cache[rows_B1, :, pos_BT] = k_BKTd.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows_B1, :, pos_BT] = v_BKTd.transpose(1, 2).to(v_cache.dtype)
        if cache._leading:
            rows = pos_BT.shape[0]
            keys_BKLd, values_BKLd = k_cache[:rows], v_cache[:rows]
        else:
            length = int(pos_BT.max()) + 1  # keys past the furthest query are never visible
            keys_BKLd = k_cache[self.slot_ids_B, :, :length]
            values_BKLd = v_cache[self.slot_ids_B, :, :length]
        if cache.batch_invariant:
            return batch_invariant.attention(q_BHTd, keys_BKLd, values_BKLd, pos_BT)
        return grouped_attention(q_BHTd, keys_BKLd, values_BKLd, pos_BT)


def grouped_attention(
    q_BHTd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, positions_BT: torch.Tensor
) -> torch.Tensor:
    """Query (b, t) attends to key indices 0..positions[b, t] of row b; GQA without repeating
    the kv heads (query head h = k * group + g reads kv head k), fp32 softmax."""
    B, H, T, d = q_BHTd.shape
    K, L = k_BKLd.shape[1], k_BKLd.shape[2]
    group = H // K
    q_BKGd = q_BHTd.reshape(B, K, group * T, d)  # [B, K, (group, T), d]
    scores_BKGL = (q_BKGd @ k_BKLd.to(q_BHTd.dtype).transpose(-1, -2)).float() * d**-0.5
    index_L = torch.arange(L, device=q_BHTd.device)
    visible_BTL = index_L[None, None, :] <= positions_BT[:, :, None]
    visible_B1GL = visible_BTL[:, None, None].expand(B, 1, group, T, L).reshape(B, 1, -1, L)
    probs_BKGL = scores_BKGL.masked_fill(~visible_B1GL, float("-inf")).softmax(-1)
    out_BKGd = probs_BKGL.to(q_BHTd.dtype) @ v_BKLd.to(q_BHTd.dtype)
    return out_BKGd.reshape(B, H, T, d)
