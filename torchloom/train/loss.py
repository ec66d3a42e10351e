"""Objectives: loss components the model's forward hands its final hidden states to.

An objective is called inside the model's forward (``model(tokens, ..., objective=o,
targets=batch.fields(o.fields))``), so the output head's weights are wherever data parallelism
gathered them and one path serves one process, FSDP, tensor parallelism (loss parallel) and the
last pipeline stage. It returns a ``LossOutput``: a loss *sum* over this micro-batch, and
metrics. The trainer divides the sum by the global batch's ``normalizer`` (the label-token count
for cross-entropy), so gradient accumulation and data parallelism give the loss of one big
batch. RL objectives (per-token log-probs, clipped ratios, KL) follow the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchloom.kernels.linear_cross_entropy import (
    IGNORE_INDEX,
    LOSS_IMPLS,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)

__all__ = ["IGNORE_INDEX", "CrossEntropy", "LossOutput", "Objective", "cross_entropy_sum"]


@dataclass
class LossOutput:
    """What an objective computed for one micro-batch."""

    loss: torch.Tensor
    """The sum to differentiate, before division by the global normalizer (fp32, 0-dim)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached values to log (summed over micro-batches and ranks, then divided likewise)."""


class Objective(Protocol):
    """A loss component."""

    fields: tuple[str, ...]
    """The batch fields it reads (``labels`` or any of the batch's extras)."""

    def __call__(
        self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]
    ) -> LossOutput:
        """The loss sum of one micro-batch from the model's final hidden states; ``model``
        gives the head (``logits(h)``, ``head_weight()``)."""
        ...

    def normalizer(self, batch: Any) -> int:
        """This micro-batch's share of what the loss sum is divided by."""
        ...


class CrossEntropy:
    """Next-token cross-entropy, summed over the tokens whose label is not IGNORE_INDEX.

    ``impl``: 'full' forms the logits (vocabulary-sharded under loss-parallel tensor
    parallelism) then the loss; 'chunked' fuses the head's matmul and the loss over token chunks
    and never forms [batch, seq, vocab] logits (not with tensor or pipeline parallelism).
    """

    fields = ("labels",)

    def __init__(self, impl: str = "full") -> None:
        if impl not in LOSS_IMPLS:
            raise ValueError(f"unknown cross-entropy impl {impl!r}; one of {LOSS_IMPLS}")
        self.impl = impl

    def __call__(
        self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]
    ) -> LossOutput:
        labels_BT = targets["labels"]
        if self.impl == "chunked":
            head_VD = model.head_weight()
            return LossOutput(
                linear_cross_entropy_sum(h_BTD.flatten(0, 1), head_VD, labels_BT.flatten())
            )
        return LossOutput(cross_entropy_sum(model.logits(h_BTD), labels_BT))

    def normalizer(self, batch: Any) -> int:
        return batch.num_label_tokens
