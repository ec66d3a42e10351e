"""Generation state, owned by the layers: each layer kind allocates its own (``new_state``) from
its own shapes, and the generator only binds a forward's rows to it.

``ModelCache`` holds one state per layer for a fixed pool of ``slots`` sequences of up to
``max_len`` tokens. A request owns one slot from its prefill until it ends, so requests join and
leave between decode steps without moving anyone else's state. A forward is bound to the cache
in one of two ways:

- ``bind(slot_ids, positions, lengths)``: rows are any slots; attention reads keys up to the
  furthest query (a host read of the positions). Used for prefill, and for decode steps
  without CUDA graphs.
- ``bind_leading(positions, live)``: rows are slots 0..rows-1 and every key index up to
  ``max_len`` is read through a mask, with no host synchronisation and no copy, so the step can
  be captured in a CUDA graph (torchloom/generate/graphs.py). Rows not ``live`` are dummies
  (slots not decoding): they sit at the last index, ``max_len - 1``, where no real token ever
  goes, and a state not indexed by position leaves their slots as they were.

A row whose first position is 0 starts a new sequence in its slot; a row starting further on
continues the sequence its slot holds (a prefill of a conversation's next turn: the state of
its earlier tokens is kept). In a prefill the tokens past ``lengths_B`` of a row are
right-padding: a state that is not indexed by position (a recurrent or convolution state)
resets on the first and stops before the second; a KV state needs neither (it is indexed by
position, and padding keys sit where later tokens overwrite them).

Every state kind also implements ``copy_slot(src_slot, dst_slots_S, length)``: make the slots
``dst_slots_S`` hold what ``src_slot`` holds after a sequence's first ``length`` tokens. The
generator prefills a prompt that several requests share (an RL group) once and copies its
slot to the others' (``ModelCache.copy_slot``); a state indexed by position copies indices
0..length-1, one that is not (recurrent, convolution; DeepSeek-V4's window ring and partial
groups) its whole slot.

Two kinds live here, both indexed by position (a token at position p of its sequence sits at
index p of its slot):

- ``KVState``, grouped-query attention's keys and values per layer as
  [slots, kv_heads, max_len, head_dim];
- ``LatentState``, multi-head latent attention's (MLA, models/components/mla.py) normed latent
  and rotated shared key per layer as [slots, max_len, kv_lora_rank + rope_dim]: the heads'
  keys and values are never stored. It attends in latent space with kv_b_proj absorbed
  (DeepSeek-V2's decoding form): each query's no-position part is mapped into the latent
  space by its head's key up-projection, the scores are taken against the cached latents and
  shared keys, and the probability-weighted latent is mapped out by the head's value
  up-projection. That reads L x (kv_lora_rank + rope_dim) numbers per step instead of
  up-projecting every cached position.

One kind is not indexed by position:

- ``RecurrentState``, a linear-attention layer's (Gated DeltaNet, KDA) recurrent state
  [slots, heads, key_dim, value_dim] in fp32 and the last ``kernel - 1`` inputs of its short
  causal convolution [slots, channels, kernel - 1]. A row whose first position is 0 starts
  from zeros; a prefill row's state stops at its last real token (``lengths_B``): its padding
  tokens neither decay nor update the state, and the convolution keeps the inputs before
  ``lengths_B``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from torchloom.kernels import batch_invariant
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.kernels.batch_invariant import MASK_FIX
from torchloom.kernels.decode_attention import decode_attention, kernel_takes
from torchloom.kernels.delta_rule import delta_rule, delta_rule_step


class Binding:
    """What every layer of one forward shares: the rows' slots and positions, how many key
    indices to read, each row's real tokens (``lengths_B``; None: all T), the one-token
    attention kernel (``ModelCache.decode_attention``), and values computed once for all
    layers (``memo``)."""

    def __init__(
        self,
        slot_ids_B: torch.Tensor,
        positions_BT: torch.Tensor,
        length: int,
        leading: bool,
        lengths_B: torch.Tensor | None = None,
        live_B: torch.Tensor | None = None,
        decode_attention: str = "torch",
    ) -> None:
        self.slot_ids_B, self.positions_BT = slot_ids_B, positions_BT
        self.length, self.leading, self.lengths_B = length, leading, lengths_B
        self.live_B, self.decode_attention = live_B, decode_attention
        self._memo: dict[str, Any] = {}

    def memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed by the first layer that asks and shared with the rest."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


class LayerState(Protocol):
    """One layer's generation state: ``bound(binding)`` is what the layer's forward receives
    as its ``cache``; ``copy_slot`` gives other slots one slot's state (module docstring)."""

    def bound(self, binding: Binding) -> Any: ...

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None: ...


class ModelCache:
    """Every layer's generation state for ``slots`` sequences of up to ``max_len`` tokens, by
    layer index (``Decoder.new_cache`` asks each layer for its own)."""

    def __init__(
        self, states: dict[int, LayerState], slots: int, max_len: int, device: torch.device
    ) -> None:
        self.states, self.slots, self.max_len, self.device = states, slots, max_len, device
        # How KV layers attend one-token steps (kernels/decode_attention.py's impl): "torch" the
        # masked matmul softmax, "auto" the Triton kernel where it can run (CUDA), "triton" it.
        self.decode_attention = "torch"
        self._binding: Binding | None = None

    def bind(
        self,
        slot_ids_B: torch.Tensor,
        positions_BT: torch.Tensor,
        lengths_B: torch.Tensor | None = None,
    ) -> ModelCache:
        """Set which slots the next forward's rows are and where their tokens go (row b's
        tokens past ``lengths_B[b]`` are right-padding); returns self (pass it as
        ``model(tokens, positions, cache=...)``)."""
        length = int(positions_BT.max()) + 1  # keys past the furthest query are never visible
        self._binding = Binding(
            slot_ids_B, positions_BT, length, leading=False, lengths_B=lengths_B,
            decode_attention=self.decode_attention,
        )  # fmt: skip
        return self

    def bind_leading(
        self, positions_BT: torch.Tensor, live_B: torch.Tensor | None = None
    ) -> ModelCache:
        """Rows are slots 0..B-1 (B = positions_BT.shape[0]); shapes depend only on B. Rows
        not ``live_B`` (dummies at position max_len - 1) change no state lasting."""
        slot_ids_B = torch.arange(positions_BT.shape[0], device=positions_BT.device)
        self._binding = Binding(
            slot_ids_B, positions_BT, self.max_len, leading=True, live_B=live_B,
            decode_attention=self.decode_attention,
        )  # fmt: skip
        return self

    @property
    def binding(self) -> Binding:
        """The rows of the forward bound last (``bind`` / ``bind_leading``)."""
        assert self._binding is not None, "bind() first"
        return self._binding

    def copy_slot(self, src_slot: int, dst_slots: list[int], length: int) -> None:
        """Every layer's state of ``src_slot`` after ``length`` tokens, copied to ``dst_slots``
        (which then continue that sequence on their own)."""
        dst_slots_S = torch.tensor(dst_slots, device=self.device)
        for state in self.states.values():
            state.copy_slot(src_slot, dst_slots_S, length)

    def layer(self, index: int) -> Any:
        assert self._binding is not None, "bind() first"
        return self.states[index].bound(self._binding)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (each layer's state, whatever its kind): a
        cache built on the meta device tells what one would allocate."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds, once each (each layer's state, whatever its kind)."""
        found, seen, stack = [], set(), list(vars(self).values())
        while stack:
            value = stack.pop()
            if id(value) in seen or isinstance(value, torch.nn.Module):
                continue  # a state may point at its layer, whose weights are not the cache's
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, list | tuple):
                stack.extend(value)
            elif isinstance(value, dict):
                stack.extend(value.values())
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                stack.extend(vars(value).values())
        return found


class KVState:
    """Keys and values of one attention layer: [slots, kv_heads, max_len, head_dim] each. A
    query sees the cached positions its layer's ``mask`` shows it (sliding window, chunk; every
    position is still stored: slots stay indexed by position)."""

    def __init__(
        self,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        batch_invariant: bool = False,
        mask: AttentionMask = CAUSAL,
    ) -> None:
        if batch_invariant:
            mask.require_plain("the batch-invariant decode kernel", MASK_FIX)
        if not mask.causal:
            raise ValueError(
                f"a KV cache decodes causal attention only, not this layer's mask "
                f"({mask.describe()}); generate with a causal model."
            )
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch_invariant, self.mask = batch_invariant, mask

    def bound(self, binding: Binding) -> _BoundKV:
        return _BoundKV(self, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        # The source is cloned: indexed assignment refuses one that overlaps its target tensor.
        self.k[dst_slots_S, :, :length] = self.k[src_slot, :, :length].clone()
        self.v[dst_slots_S, :, :length] = self.v[src_slot, :, :length].clone()


class _BoundKV:
    """A KV state bound to one forward: stores this step's keys and values, attends to them."""

    def __init__(self, state: KVState, binding: Binding) -> None:
        self.state, self.binding = state, binding

    def attend(
        self, q_BHTd: torch.Tensor, k_BKTd: torch.Tensor, v_BKTd: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's rotated keys/values; attend the queries to the cached ones."""
        bound, state = self.binding, self.state
        rows_B1, pos_BT = bound.slot_ids_B[:, None], bound.positions_BT
        # Advanced indexing [slots, :, positions] puts the indexed dims first: [B, T, K, d].
        state.k[rows_B1, :, pos_BT] = k_BKTd.transpose(1, 2).to(state.k.dtype)
        state.v[rows_B1, :, pos_BT] = v_BKTd.transpose(1, 2).to(state.v.dtype)
        if self._one_token_kernel(q_BHTd):
            out_BHd = decode_attention(
                q_BHTd[:, :, 0], state.k, state.v, bound.slot_ids_B, pos_BT[:, 0],
                bound.live_B, state.mask.window, state.mask.chunk, impl="triton",
            )  # fmt: skip
            return out_BHd[:, :, None]
        if bound.leading:  # a view of slots 0..B-1: no copy
            rows = pos_BT.shape[0]
            keys_BKLd, values_BKLd = state.k[:rows], state.v[:rows]
        else:
            keys_BKLd = state.k[bound.slot_ids_B, :, : bound.length]
            values_BKLd = state.v[bound.slot_ids_B, :, : bound.length]
        if state.batch_invariant:
            return batch_invariant.attention(q_BHTd, keys_BKLd, values_BKLd, pos_BT)
        mask = state.mask
        hidden_B11TL = bound.memo(("hidden_keys", mask), lambda: _hidden_keys(bound, mask))
        return grouped_attention(q_BHTd, keys_BKLd, values_BKLd, hidden_B11TL)

    def _one_token_kernel(self, q_BHTd: torch.Tensor) -> bool:
        """Whether this step attends by kernels/decode_attention.py's kernel: one token a
        row, not batch-invariant, and the binding's impl asks for it ("auto": where it runs)."""
        impl, state = self.binding.decode_attention, self.state
        if q_BHTd.shape[2] != 1 or state.batch_invariant or impl == "torch":
            return False
        return impl == "triton" or kernel_takes(q_BHTd, state.k, state.v)


def _hidden_keys(bound: Binding, mask: AttentionMask = CAUSAL) -> torch.Tensor:
    """[B, 1, 1, T, L]: which key indices (= positions) each query may not see under ``mask``
    (those past its position; with a window or chunk, also those outside it)."""
    index_L = torch.arange(bound.length, device=bound.positions_BT.device)
    seen_BTL = mask.visible(bound.positions_BT[:, :, None], index_L[None, None, :])
    return ~seen_BTL[:, None, None]


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


class LatentState:
    """The latent KV of one MLA layer: [slots, max_len, kv_lora_rank + rope_dim], each entry
    the normed latent followed by the rotated key part all heads share."""

    def __init__(
        self,
        slots: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.entries = torch.zeros(slots, max_len, kv_lora_rank + rope_dim, device=device,
                                   dtype=dtype)  # fmt: skip

    def bound(self, binding: Binding) -> _BoundLatent:
        return _BoundLatent(self, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        self.entries[dst_slots_S, :length] = self.entries[src_slot, :length].clone()  # as KV's


class _BoundLatent:
    """A latent state bound to one forward: stores this step's latents, attends to them."""

    def __init__(self, state: LatentState, binding: Binding) -> None:
        self.state, self.binding = state, binding

    def stored(self, latent_BTc: torch.Tensor, k_rope_BTr: torch.Tensor) -> torch.Tensor:
        """Store this step's normed latents and rotated shared keys; return every cached entry
        of the batch's rows, [B, L, kv_lora_rank + rope_dim] (key index = position)."""
        bound, entries = self.binding, self.state.entries
        rows_B1, pos_BT = bound.slot_ids_B[:, None], bound.positions_BT
        entries[rows_B1, pos_BT] = torch.cat([latent_BTc, k_rope_BTr], dim=-1).to(entries.dtype)
        if bound.leading:  # a view of slots 0..B-1: no copy
            return entries[: pos_BT.shape[0]]
        return entries[bound.slot_ids_B, : bound.length]

    def attend(
        self,
        q_nope_BHTn: torch.Tensor,
        q_rope_BHTr: torch.Tensor,
        latent_BTc: torch.Tensor,
        k_rope_BTr: torch.Tensor,
        kv_b_weight: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """Store this step's normed latents and rotated shared keys; attend the queries to the
        cached ones. ``kv_b_weight`` is kv_b_proj's weight [H * (n + v), c] for the heads this
        rank holds; returns the heads' outputs [B, H, T, v], fp32 softmax."""
        bound, state = self.binding, self.state
        cached_BLx = self.stored(latent_BTc, k_rope_BTr)
        dtype, c = q_nope_BHTn.dtype, state.kv_lora_rank
        cached_BLx = cached_BLx.to(dtype)
        B, H, T, n = q_nope_BHTn.shape
        w_HXc = kv_b_weight.to(dtype).view(H, -1, c)
        w_uk_Hnc, w_uv_Hvc = w_HXc[:, :n], w_HXc[:, n:]
        # Absorb the key up-projection into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        q_latent_BHTc = torch.einsum("bhtn,hnc->bhtc", q_nope_BHTn, w_uk_Hnc)
        q_BHTx = torch.cat([q_latent_BHTc, q_rope_BHTr], dim=-1)
        scores_BHTL = (q_BHTx.flatten(1, 2) @ cached_BLx.transpose(1, 2)).float()
        scores_BHTL = scores_BHTL.view(B, H, T, -1) * softmax_scale
        hidden_B1TL = bound.memo(("hidden_keys", CAUSAL), lambda: _hidden_keys(bound))[:, 0]
        probs_BHTL = scores_BHTL.masked_fill(hidden_B1TL, float("-inf")).softmax(-1)
        out_latent_BHTc = (probs_BHTL.to(dtype).flatten(1, 2) @ cached_BLx[..., :c]).view(
            B, H, T, c
        )
        # ... and the value up-projection into the output: W_uv (sum_s p_s c_s).
        return torch.einsum("bhtc,hvc->bhtv", out_latent_BHTc, w_uv_Hvc)


class RecurrentState:
    """A linear-attention layer's generation state: the delta rule's recurrent state
    [slots, heads, key_dim, value_dim] (fp32) and the convolution's last inputs
    [slots, channels, kernel - 1] (module docstring)."""

    def __init__(
        self,
        slots: int,
        channels: int,
        kernel: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.conv = torch.zeros(slots, channels, kernel - 1, device=device, dtype=dtype)
        self.recurrent = torch.zeros(
            slots, heads, key_dim, value_dim, device=device, dtype=torch.float32
        )

    def bound(self, binding: Binding) -> BoundRecurrent:
        return BoundRecurrent(self, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        # The state after `length` tokens is the whole slot (nothing here is indexed by position).
        self.conv[dst_slots_S] = self.conv[src_slot].clone()
        self.recurrent[dst_slots_S] = self.recurrent[src_slot].clone()


class BoundRecurrent:
    """A recurrent state bound to one forward: continues each row's convolution and delta rule
    from its slot (from zeros where the row starts at position 0) and stores where it ends."""

    def __init__(self, state: RecurrentState, binding: Binding) -> None:
        self.state, self.binding = state, binding
        self.fresh_B = binding.positions_BT[:, 0] == 0

    def convolve(
        self, x_BTC: torch.Tensor, weight_C1W: torch.Tensor, fixed_order: bool = False
    ) -> torch.Tensor:
        """The causal depthwise convolution of ``x_BTC`` (weight [channels, 1, width]) after
        each row's previous inputs; keeps each row's last width - 1 real inputs. With
        ``fixed_order``, tap after tap as ``causal_conv1d`` computes it in batch-invariant
        mode (models/components/linear_attention.py), so a decode step equals the full
        forward bit for bit."""
        B, T, C = x_BTC.shape
        keep = weight_C1W.shape[-1] - 1
        slots = self.binding.slot_ids_B
        previous_BCk = self.state.conv[slots].to(x_BTC.dtype)
        previous_BCk = previous_BCk.masked_fill(self.fresh_B[:, None, None], 0.0)
        inputs_BCL = torch.cat([previous_BCk, x_BTC.transpose(1, 2)], dim=-1)  # L = keep + T
        weight_C1W = weight_C1W.to(x_BTC.dtype)
        if fixed_order:
            inputs_BLC = inputs_BCL.transpose(1, 2)
            out_BTC = torch.zeros_like(x_BTC)
            for tap in range(keep + 1):  # tap j reads input t - (width - 1 - j)
                out_BTC = out_BTC + weight_C1W[:, 0, tap] * inputs_BLC[:, tap : tap + T]
            out_BCT = out_BTC.transpose(1, 2)
        else:
            out_BCT = F.conv1d(inputs_BCL, weight_C1W, groups=C)
        if keep:
            lengths_B = self._lengths(B, T, x_BTC.device)
            # Token t sits at index keep + t: the last `keep` real inputs end at keep + length.
            index_Bk = lengths_B[:, None] + torch.arange(keep, device=x_BTC.device)
            kept_BCk = inputs_BCL.gather(2, index_Bk[:, None, :].expand(B, C, keep))
            self._store(self.state.conv, kept_BCk)
        return out_BCT.transpose(1, 2)

    def delta_rule(
        self,
        q_BTHK: torch.Tensor,
        k_BTHK: torch.Tensor,
        v_BTHV: torch.Tensor,
        g: torch.Tensor,
        beta_BTH: torch.Tensor,
        normalize_qk: bool = False,
        fixed_order: bool = False,
    ) -> torch.Tensor:
        """The gated delta rule (torchloom/kernels/delta_rule.py) from each row's state; stores
        the state after each row's last real token. ``g``: [B, T, H] or [B, T, H, K]; q and k
        as ``delta_rule`` takes them (grouped, normalised there with ``normalize_qk``). With
        ``fixed_order``, batch-invariant mode's token-by-token rule (delta_rule_reference, fixed_order)
        for prefill and decode alike."""
        T = q_BTHK.shape[1]
        slots = self.binding.slot_ids_B
        state_BHKV = self.state.recurrent[slots].masked_fill(self.fresh_B[:, None, None, None], 0)
        if self.binding.lengths_B is not None:  # padding: no decay (g = 0), no update (beta = 0)
            real_BT = torch.arange(T, device=q_BTHK.device) < self.binding.lengths_B[:, None]
            beta_BTH = beta_BTH * real_BT[..., None]
            g = g * (real_BT[..., None, None] if g.dim() == 4 else real_BT[..., None])
        if fixed_order:
            o_BTHV, state_BHKV = delta_rule(
                q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, state_BHKV, impl="fixed_order",
                normalize_qk=normalize_qk,
            )  # fmt: skip
        elif T == 1:
            o_BHV, state_BHKV = delta_rule_step(
                q_BTHK[:, 0], k_BTHK[:, 0], v_BTHV[:, 0], g[:, 0], beta_BTH[:, 0], state_BHKV,
                normalize_qk=normalize_qk,
            )  # fmt: skip
            o_BTHV = o_BHV[:, None]
        else:
            o_BTHV, state_BHKV = delta_rule(
                q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, state_BHKV, normalize_qk=normalize_qk
            )
        self._store(self.state.recurrent, state_BHKV)
        return o_BTHV

    def _store(self, target: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the rows' new state into their slots of ``target``; dummy rows (not live)
        write back what their slots held."""
        slots, live_B = self.binding.slot_ids_B, self.binding.live_B
        rows = rows.to(target.dtype)
        if live_B is not None:
            rows = torch.where(live_B.view(-1, *[1] * (rows.dim() - 1)), rows, target[slots])
        target[slots] = rows

    def _lengths(self, B: int, T: int, device: torch.device) -> torch.Tensor:
        lengths_B = self.binding.lengths_B
        return torch.full((B,), T, device=device) if lengths_B is None else lengths_B
