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
from torchloom.models.components.decoder import DecoderConfig


class KVCache:
    """Keys and values of every layer for ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(
        self,
        config: DecoderConfig,
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
        self._binding: _Binding | None = None

    def bind(self, slot_ids_B: torch.Tensor, positions_BT: torch.Tensor) -> KVCache:
        """Set which slots the next forward's rows are and where their tokens go; returns self
        (pass it as ``model(tokens, positions, cache=...)``)."""
        length = int(positions_BT.max()) + 1  # keys past the furthest query are never visible
        self._binding = _Binding(self, slot_ids_B, positions_BT, length, leading=False)
        return self

    def bind_leading(self, positions_BT: torch.Tensor) -> KVCache:
        """Rows are slots 0..B-1 (B = positions_BT.shape[0]); shapes depend only on B."""
        slot_ids_B = torch.arange(positions_BT.shape[0], device=positions_BT.device)
        self._binding = _Binding(self, slot_ids_B, positions_BT, self.max_len, leading=True)
        return self

    def layer(self, index: int) -> _LayerView:
        assert self._binding is not None, "bind() first"
        return _LayerView(self, index, self._binding)


class _Binding:
    """What every layer of one forward shares: the rows' slots and positions, how many key
    indices to read, and (normal mode) which of them each query may not see, computed once."""

    def __init__(
        self,
        cache: KVCache,
        slot_ids_B: torch.Tensor,
        positions_BT: torch.Tensor,
        length: int,
        leading: bool,
    ) -> None:
        self.slot_ids_B, self.positions_BT = slot_ids_B, positions_BT
        self.length, self.leading = length, leading
        self.hidden_B11TL: torch.Tensor | None = None
        if not cache.batch_invariant:
            index_L = torch.arange(length, device=positions_BT.device)
            hidden_BTL = index_L[None, None, :] > positions_BT[:, :, None]
            self.hidden_B11TL = hidden_BTL[:, None, None]


class _LayerView:
    def __init__(self, cache: KVCache, index: int, binding: _Binding) -> None:
        self.cache, self.index, self.binding = cache, index, binding

    def attend(
        self, q_BHTd: torch.Tensor, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor
    ) -> torch.Tensor:
        bound = self.binding
        k_cache, v_cache = self.cache.k[self.index], self.cache.v[self.index]
        rows_B1, pos_BT = bound.slot_ids_B[:, None], bound.positions_BT
        # Advanced indexing [slots, :, positions] puts the indexed dims first: [B, T, K, d].
        k_cache[rows_B1, :, pos_BT] = k_BKTd.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows_B1, :, pos_BT] = v_BKTd.transpose(1, 2).to(v_cache.dtype)
        if bound.leading:  # a view of slots 0..B-1: no copy
            rows = pos_BT.shape[0]
            keys_BKLd, values_BKLd = k_cache[:rows], v_cache[:rows]
        else:
            keys_BKLd = k_cache[bound.slot_ids_B, :, : bound.length]
            values_BKLd = v_cache[bound.slot_ids_B, :, : bound.length]
        if bound.hidden_B11TL is None:  # batch-invariant mode
            return batch_invariant.attention(q_BHTd, keys_BKLd, values_BKLd, pos_BT)
        return grouped_attention(q_BHTd, keys_BKLd, values_BKLd, bound.hidden_B11TL)


def grouped_attention(
    q_BHTd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, hidden_B11TL: torch.Tensor
) -> torch.Tensor:
    """Query (b, t) attends to the key indices of row b that ``hidden_B11TL[b, 0, 0, t]`` does
    not hide; GQA without repeating the kv heads (query head h = k * group + g reads kv head
    k), fp32 softmax."""
    B, H, T, d = q_BHTd.shape
    K, L = k_BKLd.shape[1], k_BKLd.shape[2]
    group = H // K
    q_BKGd = q_BHTd.reshape(B, K, group * T, d)  # [B, K, (group, T), d]
    scores_BKGL = (q_BKGd @ k_BKLd.to(q_BHTd.dtype).transpose(-1, -2)).float() * d**-0.5
    scores_BKgTL = scores_BKGL.view(B, K, group, T, L).masked_fill(hidden_B11TL, float("-inf"))
    probs_BKGL = scores_BKgTL.softmax(-1).view(B, K, group * T, L)
    out_BKGd = probs_BKGL.to(q_BHTd.dtype) @ v_BKLd.to(q_BHTd.dtype)
    return out_BKGd.reshape(B, H, T, d)
