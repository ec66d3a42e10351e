"""Attention masks described once (``AttentionMask``: causal, document, sliding window, chunked,
compressed groups, top-k picks, sinks) and read by every mask site; and the causal,
document-aware rule in plain PyTorch shared by the batch-invariant references (batch_invariant)
and their Triton kernels (batch_invariant_triton): which keys each query sees, and SDPA under
that explicit mask (what both backward passes recompute)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchloom.config.errors import ConfigError


def causal_positions_and_starts(
    B: int, T: int, doc_ids_BT: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions 0..T-1 of every row and, with ``doc_ids_BT``, the index of the first token of
    each token's document (None without documents: every query sees from key 0)."""
    positions_BT = torch.arange(T, device=device).expand(B, T)
    if doc_ids_BT is None:
        return positions_BT, None
    new_doc_BT = F.pad(doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1], (1, 0), value=True)
    return positions_BT, torch.where(new_doc_BT, positions_BT, 0).cummax(dim=1).values


def masked_attention(
    q_BHTd: torch.Tensor,
    k_BKLd: torch.Tensor,
    v_BKLd: torch.Tensor,
    positions_BT: torch.Tensor,
    starts_BT: torch.Tensor | None,
) -> torch.Tensor:
    """The same function in differentiable PyTorch: SDPA with an explicit [B, 1, T, L] mask
    (what the backward passes recompute)."""
    group = q_BHTd.shape[1] // k_BKLd.shape[1]
    index_L = torch.arange(k_BKLd.shape[2], device=q_BHTd.device)
    visible_BTL = index_L <= positions_BT[:, :, None]
    if starts_BT is not None:
        visible_BTL &= index_L >= starts_BT[:, :, None]
    return F.scaled_dot_product_attention(
        q_BHTd,
        k_BKLd.repeat_interleave(group, dim=1),
        v_BKLd.repeat_interleave(group, dim=1),
        attn_mask=visible_BTL[:, None],
    )


@dataclass(frozen=True)
class AttentionMask:
    """Which keys a query sees: the one description of an attention layer's mask that every
    mask site reads (attention backends, generation caches, batch-invariant kernels, context
    parallelism). A site that cannot honour a description refuses it in one line
    (``require_plain``); none drops a part silently.

    Keys are either tokens or groups: with ``compress`` each key pools ``compress`` consecutive
    tokens, and its position is that of its group's last token, (j + 1) * compress - 1, so
    "causal" means a query sees only completed groups. Everything below is a rule on the query
    position t and a key position s (and the documents of both):

    - ``causal``: s <= t.
    - ``document``: both in the same document (when the batch has document ids).
    - ``window``: t - s < window (sliding-window attention: the query and window - 1 before it).
    - ``chunk``: t // chunk == s // chunk (chunked attention: fixed blocks, no crossing).
    - ``topk``: the query sees at most ``topk`` keys an indexer picks per query at run time
      (DeepSeek sparse attention; the picks come as indices, beside this description).
    - ``sink``: a learned logit per head joins each query's softmax and attends to nothing
      (an attention sink: the probabilities may sum to less than one).
    """

    causal: bool = True
    document: bool = True
    window: int | None = None
    chunk: int | None = None
    compress: int | None = None
    topk: int | None = None
    sink: bool = False

    def __post_init__(self) -> None:
        for name in ("window", "chunk", "compress", "topk"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f"AttentionMask.{name} must be a positive int or None; got {value!r}"
                )

    @property
    def plain(self) -> bool:
        """Causal (and same-document) over tokens: what every kernel computes."""
        extras = (self.window, self.chunk, self.compress, self.topk)
        return self.causal and not self.sink and all(value is None for value in extras)

    def describe(self) -> str:
        parts = ["causal" if self.causal else "bidirectional"]
        parts += ["document"] if self.document else []
        for name in ("window", "chunk", "compress", "topk"):
            if (value := getattr(self, name)) is not None:
                parts.append(f"{name} {value}")
        parts += ["sink"] if self.sink else []
        return " + ".join(parts)

    def require_plain(self, site: str, fix: str) -> None:
        """ConfigError (a ValueError) naming ``site`` unless this is plain causal(+document)
        attention: a model and a kernel that cannot go together, which the user chose."""
        if not self.plain:
            raise ConfigError(
                f"{site} computes causal, same-document attention only, not this layer's mask "
                f"({self.describe()}); {fix}"
            )

    def key_positions(self, S: int, device: torch.device) -> torch.Tensor:
        """[S]: the position each key stands at (a group's: its last token's)."""
        index_S = torch.arange(S, device=device)
        return index_S if self.compress is None else (index_S + 1) * self.compress - 1

    def visible(
        self,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Whether a query at ``q_pos`` sees a key at ``k_pos`` (broadcasting tensors of
        positions, and of document ids when both are given), topk picks aside."""
        rules = []
        if self.causal:
            rules.append(k_pos <= q_pos)
        if self.window is not None:
            rules.append(q_pos - k_pos < self.window)
        if self.chunk is not None:
            rules.append(q_pos // self.chunk == k_pos // self.chunk)
        if self.document and q_doc is not None and k_doc is not None:
            rules.append(q_doc == k_doc)
        if not rules:  # bidirectional over one document: every key
            shape = torch.broadcast_shapes(q_pos.shape, k_pos.shape)
            return torch.ones(shape, dtype=torch.bool, device=q_pos.device)
        seen = rules[0]
        for rule in rules[1:]:
            seen = seen & rule
        return seen

    def dense(
        self,
        T: int,
        device: torch.device,
        doc_ids_BT: torch.Tensor | None = None,
        S: int | None = None,
        picks_BTk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Boolean [B or 1, 1, T, S] for queries at 0..T-1 over S keys (default T; groups with
        ``compress``): this mask as SDPA's ``attn_mask``. ``picks_BTk`` (with ``topk``): the
        key indices each query's indexer chose (-1: none), the only keys it may see."""
        S = T if S is None else S
        q_pos_T1 = torch.arange(T, device=device)[:, None]
        k_pos_S = self.key_positions(S, device)
        seen_BTS = self.visible(q_pos_T1, k_pos_S[None, :])[None]
        if self.document and doc_ids_BT is not None:
            if self.compress is not None:
                raise ValueError("compressed keys pool tokens of any document: pass no doc_ids")
            seen_BTS = seen_BTS & (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :S])
        if picks_BTk is not None:
            if self.topk is None:
                raise ValueError("picks given for a mask without topk")
            picked_BTS = torch.zeros(*picks_BTk.shape[:2], S + 1, dtype=torch.bool, device=device)
            picked_BTS.scatter_(-1, torch.where(picks_BTk < 0, S, picks_BTk), True)
            seen_BTS = seen_BTS & picked_BTS[..., :S]
        return seen_BTS[:, None]

    def mask_mod(self, doc_ids_BT: torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
        """This mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over token keys."""
        if self.compress is not None or self.topk is not None:
            raise ValueError(
                f"no FlexAttention mask_mod for {self.describe()} (keys are not tokens)"
            )
        use_docs = self.document and doc_ids_BT is not None

        def mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
            if use_docs:
                return self.visible(q_idx, kv_idx, doc_ids_BT[b, q_idx], doc_ids_BT[b, kv_idx])
            return self.visible(q_idx, kv_idx)

        return mod


CAUSAL = AttentionMask()
"""Causal, same-document attention: the default of every attention layer."""
