"""DeepSeek sparse attention (DSA; DeepSeek-V3.2): a lightning indexer picks, for every query,
the ``index_topk`` keys it scores highest, and multi-head latent attention attends to those
keys only.

The indexer (module names are those of transformers' DeepseekV32Indexer, so its weights load
under the same names), per query token t and key token s:

- queries from MLA's normed query latent: ``wq_b(q_latent)``, ``index_num_heads`` heads of
  ``index_head_dim`` channels; one key per token: ``k_norm(wk(x))`` (a LayerNorm with bias);
- the first ``qk_rope_head_dim`` channels of both are rotated by RoPE in the "rotate half"
  layout (the main attention's rotated parts are interleaved pairs; the indexer's are not);
- I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(index_head_dim)), with per-head
  weights w = weights_proj(x) / sqrt(index_num_heads); the top-k of I over the keys t sees
  (causal, same document) are its picks.

DeepSeek's own kernels rotate q and k by a Hadamard transform and score in fp8; the rotation
is orthonormal, so q . k is unchanged, and it only serves the fp8 quantization. Like
transformers we score without either: in fp32 (q and k cast up), so the picks follow the
unrotated scores exactly. Exact ties at the top-k boundary go to the earlier key (a stable
sort), so a query's picks do not depend on what else shares its row (packed documents);
transformers' ``torch.topk`` breaks them in an unspecified order. Trained indexers rarely tie;
fresh ones often do, at 0 (every head's ReLU closed).

Generation keeps each layer's MLA latents and the indexer's keys per slot
(``SparseLatentState``); a decoding query scores the cached keys up to its position, picks,
and attends to the picked cached latents up-projected as in the full forward.

The attention here is the CPU reference form: SDPA over every key with the boolean mask
``AttentionMask(topk=...).dense(...)`` (causal, same document, picked). With fewer visible
keys than ``index_topk`` a query picks all of them, so short sequences attend densely.

Training the indexer (``indexer_train``, DeepSeek-V3.2's two stages): its loss is the KL
divergence from the main attention's distribution (summed over heads, L1-normalized over keys;
a target, no gradient) to softmax(I) over the same keys, averaged over the queries and
reported as the auxiliary loss ``indexer_kl`` (logged ``aux_indexer_kl``). The indexer reads
detached inputs, so this loss trains the indexer only, and nothing else trains it (its picks
are discrete). 'warmup': the main attention stays dense and the KL runs over every visible key
(the model freezes everything but the indexers, models/deepseek_v32/model.py); 'sparse': the
main attention uses the picks and the KL runs over the picked keys; 'off': no KL, the indexer
runs without gradients (inference, or fine-tuning with the indexer fixed).

Tensor parallelism (``tp_plan``) splits MLA's heads, replicates the indexer, and sums the KL
target's heads over the ranks (``HeadSum``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torchloom.config.errors import ConfigError
from torchloom.kernels.attention_mask import AttentionMask
from torchloom.models.components.cache import Binding, LatentState
from torchloom.models.components.head_parallel import ReplicatedModule, SumOverRanks
from torchloom.models.components.mla import MultiHeadLatentAttention
from torchloom.models.components.param_init import ParamInit
from torchloom.models.components.rope import ROPE_IMPLS

IndexerTrain = Literal["off", "warmup", "sparse"]


def indexer_kl(
    target_BTS: torch.Tensor, index_BTS: torch.Tensor, visible_BTS: torch.Tensor
) -> torch.Tensor:
    """The lightning indexer's loss (DeepSeek-V3.2's; V4's indexer takes it too): the mean, over
    the queries that see any key, of KL(p || q) over the keys each sees, where p is ``target``
    (the main attention's probabilities summed over heads: a detached target) normalised to one
    and q the softmax of the index scores."""
    p_BTS = target_BTS.detach().float() * visible_BTS
    p_BTS = p_BTS / p_BTS.sum(-1, keepdim=True).clamp(min=1e-20)
    log_q_BTS = index_BTS.masked_fill(~visible_BTS, float("-inf")).log_softmax(-1)
    log_q_BTS = log_q_BTS.masked_fill(~visible_BTS, 0.0)
    kl_BT = (torch.xlogy(p_BTS, p_BTS) - p_BTS * log_q_BTS).sum(-1)
    queries_BT = visible_BTS.any(-1)
    return (kl_BT * queries_BT).sum() / queries_BT.sum().clamp(min=1)


class LightningIndexer(nn.Module):
    """DSA's lightning indexer: ``forward(x_BTD, q_latent_BTq, cos, sin, doc_ids_BT)`` gives the
    index scores [B, T, T] (fp32, -inf at the keys a query does not see); ``picks`` their top-k."""

    def __init__(
        self,
        dim: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        rope_impl: str = "torch",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim = num_heads, head_dim, rope_dim
        self.mask = AttentionMask(topk=topk)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dim, num_heads, bias=False)
        self.rotate = ROPE_IMPLS[rope_impl]
        self.init_std = init_std

    def forward(
        self,
        x_BTD: torch.Tensor,
        q_latent_BTq: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T = x_BTD.shape[1]
        visible_BTS = self.mask.dense(T, x_BTD.device, doc_ids_BT)[:, 0]
        k_BSd = self.keys(x_BTD, cos_BTd, sin_BTd)
        return self.scores(x_BTD, q_latent_BTq, cos_BTd, sin_BTd, k_BSd, visible_BTS)

    def keys(self, x_BTD: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor):
        """[B, T, index_head_dim]: each token's one indexer key, normed and rotated (what
        generation caches)."""
        return self._rotated(self.k_norm(self.wk(x_BTD))[:, :, None], cos_BTd, sin_BTd)[:, :, 0]

    def scores(
        self,
        x_BTD: torch.Tensor,
        q_latent_BTq: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        k_BSd: torch.Tensor,
        visible_BTS: torch.Tensor,
    ) -> torch.Tensor:
        """[B, T, S] index scores of the queries of ``x_BTD`` over the keys ``k_BSd`` (fp32),
        -inf where not ``visible_BTS``."""
        B, T, _ = x_BTD.shape
        q_BTHd = self.wq_b(q_latent_BTq).view(B, T, self.num_heads, self.head_dim)
        q_BTHd = self._rotated(q_BTHd, cos_BTd, sin_BTd)
        scale = self.head_dim**-0.5
        scores_BTHS = torch.einsum("bthd,bsd->bths", q_BTHd.float(), k_BSd.float()) * scale
        weights_BTH = self.weights_proj(x_BTD).float() * self.num_heads**-0.5
        index_BTS = torch.einsum("bth,bths->bts", weights_BTH, F.relu(scores_BTHS))
        return index_BTS.masked_fill(~visible_BTS, float("-inf"))

    def _rotated(self, x_BTHd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor):
        rot_BTHr, rest_BTHx = x_BTHd.split([self.rope_dim, self.head_dim - self.rope_dim], -1)
        return torch.cat([self.rotate(rot_BTHr, cos_BTd, sin_BTd), rest_BTHx], dim=-1)

    def picks(self, index_BTS: torch.Tensor) -> torch.Tensor:
        """[B, T, min(topk, S)] key indices of each query's highest scores; -1 for a pick that
        is not a visible key (a query that sees fewer keys than topk)."""
        k = min(self.mask.topk, index_BTS.shape[-1])
        top = index_BTS.sort(dim=-1, descending=True, stable=True)
        values_BTk, picks_BTk = top.values[..., :k], top.indices[..., :k]
        return torch.where(values_BTk == float("-inf"), -1, picks_BTk)

    def init_weights(self, init: ParamInit) -> None:
        for proj in (self.wq_b, self.wk, self.weights_proj):
            init.trunc_normal_(proj.weight, self.init_std)
        init.ones_(self.k_norm.weight)
        init.zeros_(self.k_norm.bias)

    def flops_per_token(self, seq_len: int) -> int:
        """6 per projection weight, and the scores (q . k per indexer head, causal half, times
        3 when trained)."""
        weights = sum(p.weight.numel() for p in (self.wq_b, self.wk, self.weights_proj))
        return 6 * weights + 3 * self.num_heads * self.head_dim * seq_len


class HeadSum(nn.Module):
    """Sum over the heads (dim 1). A module of its own so a tensor-parallel plan can add the
    other ranks' heads (``SumOverRanks``)."""

    def forward(self, x_BH__: torch.Tensor) -> torch.Tensor:
        return x_BH__.sum(1)


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA whose queries attend to the keys a ``LightningIndexer`` picks (DeepSeek-V3.2). Takes
    MLA's arguments, plus the indexer's sizes, ``index_topk`` and ``indexer_train``."""

    def __init__(
        self,
        *args: Any,
        index_num_heads: int,
        index_head_dim: int,
        index_topk: int,
        indexer_train: IndexerTrain = "off",
        indexer_loss_coef: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.q_a_proj is None:
            raise ConfigError("DeepSeek sparse attention reads the query latent: set q_lora_rank.")
        self.indexer = LightningIndexer(
            self.kv_a_proj_with_mqa.weight.shape[1], self.q_a_proj.weight.shape[0],
            index_num_heads, index_head_dim, self.rope_dim, index_topk,
            rope_impl=kwargs.get("rope_impl", "torch"), init_std=self.init_std,
        )  # fmt: skip
        self.indexer_train, self.indexer_loss_coef = indexer_train, indexer_loss_coef
        self.head_sum = HeadSum()
        self._loss: torch.Tensor | None = None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor | None,
        sin_BTd: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_latent_BTq, q_nope_BTHn, q_rope_BTHr, latent_BTc, k_rope_BT1r = self.project(
            x_BTD, cos_BTd, sin_BTd
        )
        if cache is not None:
            return self._decode(x_BTD, cos_BTd, sin_BTd, cache, q_latent_BTq, q_nope_BTHn,
                                q_rope_BTHr, latent_BTc, k_rope_BT1r)  # fmt: skip
        learn = self.indexer_train != "off" and self.training and torch.is_grad_enabled()
        with torch.set_grad_enabled(learn):  # the picks are discrete: no gradient without KL
            index_BTS = self.indexer(
                x_BTD.detach(), q_latent_BTq.detach(), cos_BTd, sin_BTd, doc_ids_BT
            )
        if self.indexer_train == "warmup":
            mask = AttentionMask()
            visible_B1TS = mask.dense(T, x_BTD.device, doc_ids_BT)
        else:
            mask = self.indexer.mask
            picks_BTk = self.indexer.picks(index_BTS.detach())
            visible_B1TS = mask.dense(T, x_BTD.device, doc_ids_BT, picks_BTk=picks_BTk)
        q_BHTe, k_BHSe, v_BHSv = self._heads(q_nope_BTHn, q_rope_BTHr, latent_BTc, k_rope_BT1r)
        out_BHTv = F.scaled_dot_product_attention(
            q_BHTe, k_BHSe, v_BHSv, attn_mask=visible_B1TS, scale=self.softmax_scale
        )
        out_BTD = self.o_proj(out_BHTv.transpose(1, 2).reshape(B, T, -1))
        if not learn:
            return out_BTD
        self._loss = self.indexer_loss_coef * self._kl(
            q_BHTe.detach(), k_BHSe.detach(), visible_B1TS, index_BTS
        )
        if not out_BTD.requires_grad:
            # The warm-up: nothing but the KL needs this layer's backward. FSDP gathers a
            # block's weights for its backward when the block's output gets a gradient; a
            # zero term tying the output to the KL makes it get one (the values are unchanged).
            out_BTD = out_BTD + 0.0 * self._loss
        return out_BTD

    @torch.no_grad()
    def _decode(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        cache: BoundSparseLatent,
        q_latent_BTq: torch.Tensor,
        q_nope_BTHn: torch.Tensor,
        q_rope_BTHr: torch.Tensor,
        latent_BTc: torch.Tensor,
        k_rope_BT1r: torch.Tensor,
    ) -> torch.Tensor:
        """Generation: this call's latents and indexer keys are stored in ``cache``; each query
        picks among the cached keys up to its position and attends to those, the cached
        latents up-projected as the full forward does (key index = position)."""
        B, T, _ = x_BTD.shape
        positions_BT = cache.binding.positions_BT
        k_BLd = cache.stored_index_keys(self.indexer.keys(x_BTD, cos_BTd, sin_BTd))
        L = k_BLd.shape[1]
        visible_BTL = torch.arange(L, device=x_BTD.device) <= positions_BT[:, :, None]
        index_BTL = self.indexer.scores(x_BTD, q_latent_BTq, cos_BTd, sin_BTd, k_BLd, visible_BTL)
        picks_BTk = self.indexer.picks(index_BTL)
        picked_BTL = torch.zeros(B, T, L + 1, dtype=torch.bool, device=x_BTD.device)
        picked_BTL = picked_BTL.scatter_(-1, torch.where(picks_BTk < 0, L, picks_BTk), True)
        cached_BLx = cache.latent.stored(latent_BTc, k_rope_BT1r[:, :, 0]).to(latent_BTc.dtype)
        latent_BLc, k_rope_BLr = cached_BLx.split([self.kv_lora_rank, self.rope_dim], -1)
        q_BHTe, k_BHLe, v_BHLv = self._heads(
            q_nope_BTHn, q_rope_BTHr, latent_BLc, k_rope_BLr[:, :, None]
        )
        out_BHTv = F.scaled_dot_product_attention(
            q_BHTe, k_BHLe, v_BHLv, attn_mask=(visible_BTL & picked_BTL[..., :L])[:, None],
            scale=self.softmax_scale,
        )  # fmt: skip
        return self.o_proj(out_BHTv.transpose(1, 2).reshape(B, T, -1))

    def _heads(
        self,
        q_nope_BTHn: torch.Tensor,
        q_rope_BTHr: torch.Tensor,
        latent_BSc: torch.Tensor,
        k_rope_BS1r: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head's queries, keys and values [B, H, T, .] (keys and values up-projected
        from the latents)."""
        B, S, H = *latent_BSc.shape[:2], q_nope_BTHn.shape[2]
        kv_BSHx = self.kv_b_proj(latent_BSc).view(B, S, H, self.nope_dim + self.v_dim)
        k_nope_BSHn, v_BSHv = kv_BSHx.split([self.nope_dim, self.v_dim], dim=-1)
        k_BSHe = torch.cat([k_nope_BSHn, self.rope_key_heads(k_rope_BS1r, H)], dim=-1)
        q_BTHe = torch.cat([q_nope_BTHn, q_rope_BTHr], dim=-1)
        return q_BTHe.transpose(1, 2), k_BSHe.transpose(1, 2), v_BSHv.transpose(1, 2)

    def _kl(
        self,
        q_BHTe: torch.Tensor,
        k_BHSe: torch.Tensor,
        visible_B1TS: torch.Tensor,
        index_BTS: torch.Tensor,
    ) -> torch.Tensor:
        """Mean over queries of KL(main attention summed over heads, L1-normed || softmax of
        the index scores), both over the keys the main attention saw."""
        with torch.no_grad():
            logits_BHTS = (q_BHTe.float() @ k_BHSe.float().transpose(-1, -2)) * self.softmax_scale
            probs_BHTS = logits_BHTS.masked_fill(~visible_B1TS, float("-inf")).softmax(-1)
            target_BTS = self.head_sum(probs_BHTS)  # every head's, also under tp
        return indexer_kl(target_BTS, index_BTS, visible_B1TS[:, 0])

    def pop_auxiliary_losses(self) -> dict[str, torch.Tensor]:
        """The indexer's KL loss of the last training forward, handed over once."""
        loss, self._loss = self._loss, None
        return {} if loss is None else {"indexer_kl": loss}

    def new_state(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> SparseLatentState:
        """MLA's latent state, and the indexer's key of every position."""
        latent = super().new_state(slots, max_len, device, dtype)
        return SparseLatentState(latent, slots, max_len, self.indexer.head_dim, device, dtype)

    def init_weights(self, init: ParamInit) -> None:
        super().init_weights(init)
        self.indexer.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """MLA's, with the attention over the keys each query actually sees (at most topk),
        plus the indexer's."""
        topk = self.indexer.mask.topk
        heads = self.o_proj.weight.shape[1] // self.v_dim
        # The mean over positions t of min(t + 1, topk) keys.
        k = min(topk, seq_len)
        mean_keys = (k * (k + 1) / 2 + (seq_len - k) * k) / seq_len
        per_key = 6 * heads * (self.qk_head_dim + self.v_dim)
        projections = super().flops_per_token(seq_len) - per_key * seq_len // 2
        return projections + int(per_key * mean_keys) + self.indexer.flops_per_token(seq_len)

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """MLA's (heads split), with the indexer replicated (every rank scores and picks alike
        from the whole query latent and input; the KL reaches its weights whole on every
        rank) and the KL target's sum over heads added up over the ranks."""
        replicated = ReplicatedModule()
        plan = super().tp_plan(sequence_parallel)
        for part in ("wq_b", "wk", "k_norm", "weights_proj"):
            plan[f"indexer.{part}"] = replicated
        return plan | {"head_sum": SumOverRanks()}


class SparseLatentState:
    """One DSA layer's generation state: MLA's ``LatentState`` and the indexer's keys
    [slots, max_len, index_head_dim], both indexed by position."""

    def __init__(
        self,
        latent: LatentState,
        slots: int,
        max_len: int,
        index_head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.latent = latent
        self.index_keys = torch.zeros(slots, max_len, index_head_dim, device=device, dtype=dtype)

    def bound(self, binding: Binding) -> BoundSparseLatent:
        return BoundSparseLatent(self, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        self.latent.copy_slot(src_slot, dst_slots_S, length)
        self.index_keys[dst_slots_S, :length] = self.index_keys[src_slot, :length].clone()


class BoundSparseLatent:
    """A DSA layer's state bound to one forward (what its forward receives as ``cache``)."""

    def __init__(self, state: SparseLatentState, binding: Binding) -> None:
        self.state, self.binding = state, binding
        self.latent = state.latent.bound(binding)

    def stored_index_keys(self, k_BTd: torch.Tensor) -> torch.Tensor:
        """Store this step's indexer keys; return every cached one of the batch's rows
        [B, L, index_head_dim] (key index = position)."""
        bound, keys = self.binding, self.state.index_keys
        keys[bound.slot_ids_B[:, None], bound.positions_BT] = k_BTd.to(keys.dtype)
        if bound.leading:
            return keys[: bound.positions_BT.shape[0]]
        return keys[bound.slot_ids_B, : bound.length]
