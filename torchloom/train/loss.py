"""Losses. Token losses are summed and divided by the label-token count of the whole global
batch, so gradient accumulation and data parallelism give the same loss as one big batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchloom.data.packing import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "cross_entropy_sum"]


def cross_entropy_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropies in fp32, skipping labels equal to IGNORE_INDEX."""
    return F.cross_entropy(
        logits_BTV.flatten(0, 1).float(),
        labels_BT.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
