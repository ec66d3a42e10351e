"""The KV cache the generator passes through the model's own forward.

A fixed pool of ``slots`` sequences, each up to ``max_len`` tokens: keys and values per layer as
[slots, kv_heads, max_len, head_dim]. A request owns one slot from its prefill until it ends, so
requests join and leave between decode steps without moving anyone else's cache. A token at
position p of its sequence lives at index p of its slot, so a query at position p attends to
indices 0..p of its own slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    ) -> None:
        self.batch_invariant = config.batch_invariant
        shape = (slots, config.num_kv_heads, max_len, config.resolved_head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.slots, self.max_len = slots, max_len
        self._slot_ids_B: torch.Tensor | None = None
        self._positions_BT: torch.Tensor | None = None

    def bind(self, slot_ids_B: torch.Tensor, positions_BT: torch.Tensor) -> KVCache:
        """Set which slots the next forward's rows are and where their tokens go; returns self
        (pass it as ``model(tokens, positions, cache=...)``)."""
        self._slot_ids_B, self._positions_BT = slot_ids_B, positions_BT
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
        k_cache, v_cache = self.cache.k[self.index], self.cache.v[self.index]
        rows_B1, pos_BT = self.slot_ids_B[:, None], self.positions_BT
        # Advanced indexing [slots, :, positions] puts the indexed dims first: [B, T, K, d].
        k_cache[rows_B1, :, pos_BT] = k_BKTd.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows_B1, :, pos_BT] = v_BKTd.transpose(1, 2).to(v_cache.dtype)
        length = int(pos_BT.max()) + 1  # keys past the furthest query are never visible
        keys_BKLd = k_cache[self.slot_ids_B, :, :length]
        values_BKLd = v_cache[self.slot_ids_B, :, :length]
        if self.cache.batch_invariant:
            return batch_invariant.attention(q_BHTd, keys_BKLd, values_BKLd, pos_BT)
        group = q_BHTd.shape[1] // keys_BKLd.shape[1]
        keys_BHLd = keys_BKLd.repeat_interleave(group, dim=1)
        values_BHLd = values_BKLd.repeat_interleave(group, dim=1)
        index_L = torch.arange(length, device=pos_BT.device)
        visible_B1TL = (index_L[None, None, :] <= pos_BT[:, :, None]).unsqueeze(1)
        return F.scaled_dot_product_attention(
            q_BHTd, keys_BHLd.to(q_BHTd.dtype), values_BHLd.to(q_BHTd.dtype), attn_mask=visible_B1TL
        )
