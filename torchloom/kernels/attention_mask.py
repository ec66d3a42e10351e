"""The visibility rule of causal, document-aware attention in plain PyTorch, shared by the
batch-invariant references (batch_invariant) and their Triton kernels (batch_invariant_triton):
which keys each query sees, and SDPA under that explicit mask (what both backward passes
recompute)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
