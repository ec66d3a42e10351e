"""Losses. Token losses are summed and divided by the label-token count of the whole global
batch, so gradient accumulation and data parallelism give the same loss as one big batch. The
implementations live in torchloom/kernels/linear_cross_entropy.py (the model's head uses them)."""

from __future__ import annotations

from torchloom.kernels.linear_cross_entropy import IGNORE_INDEX, cross_entropy_sum

__all__ = ["IGNORE_INDEX", "cross_entropy_sum"]
