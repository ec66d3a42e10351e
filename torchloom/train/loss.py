"""Objectives: loss components the model's forward hands its final hidden states to.

An objective is called inside the model's forward (``model(tokens, ..., objective=o,
targets=batch.fields(o.fields))``), so the output head's weights are wherever data parallelism
gathered them and one path serves one process, FSDP, tensor parallelism (loss parallel) and the
last pipeline stage. It returns a ``LossOutput``: a loss *sum* over this micro-batch, and
metrics. The trainer divides the sum by the global batch's ``normalizer`` (the label-token count
for cross-entropy), so gradient accumulation and data parallelism give the loss of one big
batch. RL objectives (per-token log-probs, clipped ratios, KL) follow the same contract.

Auxiliary losses that layers report during the forward (an MoE layer's load-balance term;
``Decoder.auxiliary_losses``) join every objective's sum through ``with_auxiliary``, weighted
by the micro-batch's share of the normalizer, so after the step's division each is the
token-weighted mean over the global batch; they are logged as ``aux_<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from torchloom.config.errors import ConfigError
from torchloom.data.packing import IGNORE_INDEX
from torchloom.kernels.linear_cross_entropy import (
    LOSS_IMPLS,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)

__all__ = [
    "IGNORE_INDEX",
    "CrossEntropy",
    "LossOutput",
    "Objective",
    "TokenLogProbs",
    "cross_entropy_sum",
    "label_logprobs",
    "with_auxiliary",
    "without_auxiliary",
]


@dataclass
class LossOutput:
    """What an objective computed for one micro-batch."""

    loss: torch.Tensor
    """The sum to differentiate, before division by the global normalizer (fp32, 0-dim)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached sums to log: summed over micro-batches and data ranks, then divided by the
    global normalizer, as the loss is."""
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    """[B, T] values an objective hands back whole (e.g. the labels' log-probabilities)."""
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-dim values to log as their maximum over micro-batches and data ranks (e.g.
    the largest trainer/generator log-probability difference)."""


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
            if getattr(model, "softcap", None) is not None:
                raise ConfigError(
                    "the chunked cross-entropy fuses a plain head and cannot soft-cap this "
                    "model's logits; set the loss impl to 'full'."
                )
            head_VD = model.head_weight()
            loss = linear_cross_entropy_sum(h_BTD.flatten(0, 1), head_VD, labels_BT.flatten())
        else:
            loss = cross_entropy_sum(model.logits(h_BTD), labels_BT)
        return with_auxiliary(LossOutput(loss), model, _label_count(labels_BT))

    def normalizer(self, batch: Any) -> int:
        return batch.num_label_tokens


class TokenLogProbs:
    """The log-probability of every label under the model, and the entropy of the model's
    distribution at each position: what RL reads from the trainer's forward (``per_token``
    ``logprobs`` and ``entropy``, [B, T], 0 where the label is IGNORE_INDEX). Its loss is the
    cross-entropy sum, so it also trains. fp32 log-softmax of the logits, as the generator
    scores tokens, so in batch-invariant mode the two agree bit for bit."""

    fields = ("labels",)

    def __init__(self, entropy: bool = True) -> None:
        self.entropy = entropy

    def __call__(
        self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]
    ) -> LossOutput:
        labels_BT = targets["labels"]
        valid_BT = labels_BT != IGNORE_INDEX
        logprobs_BTV = torch.log_softmax(model.logits(h_BTD).float(), dim=-1)
        picked_BT = picked_logprobs(logprobs_BTV, labels_BT)
        per_token = {"logprobs": picked_BT}
        if self.entropy:
            entropy_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
            per_token["entropy"] = entropy_BT.masked_fill(~valid_BT, 0.0)
        out = LossOutput(-picked_BT.sum(), per_token=per_token)
        return with_auxiliary(out, model, _label_count(labels_BT))

    def normalizer(self, batch: Any) -> int:
        return batch.num_label_tokens


def label_logprobs(h_BTD: torch.Tensor, model: Any, labels_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probability of each label under the model (fp32 log-softmax of the logits,
    as the generator scores tokens; 0 where the label is IGNORE_INDEX).

    Vocabulary-sharded logits (tensor parallelism's loss_parallel, whose context must wrap the
    forward and the backward) go through the cross-entropy, which DTensor computes shard by
    shard; the result is the same log-softmax entry, negated."""
    logits_BTV = model.logits(h_BTD)
    if isinstance(logits_BTV, DTensor):
        nll_N = torch.nn.functional.cross_entropy(
            logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=IGNORE_INDEX,
            reduction="none",
        )  # fmt: skip
        nll_N = nll_N.full_tensor() if isinstance(nll_N, DTensor) else nll_N
        return -nll_N.view(labels_BT.shape)
    return picked_logprobs(torch.log_softmax(logits_BTV.float(), dim=-1), labels_BT)


def picked_logprobs(logprobs_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """The labels' entries of [B, T, V] log-probabilities, 0 where the label is ignored."""
    picked_BT = logprobs_BTV.gather(-1, labels_BT.clamp(min=0)[..., None])[..., 0]
    return picked_BT.masked_fill(labels_BT == IGNORE_INDEX, 0.0)


def with_auxiliary(
    out: LossOutput, model: Any, weight: torch.Tensor, skip: tuple[str, ...] = ()
) -> LossOutput:
    """``out`` with the auxiliary losses the model's layers reported in this forward added to
    its sum, each times ``weight`` (this micro-batch's share of the normalizer), and logged as
    ``aux_<name>``; the terms named in ``skip`` are left out (an objective they do not fit)."""
    collect = getattr(model, "auxiliary_losses", None)
    terms = collect() if collect is not None else {}
    for name, value in terms.items():
        if name in skip:
            continue
        weighted = value * weight
        if isinstance(out.loss, DTensor):  # tensor parallelism's loss-parallel sum
            # The layers' terms are the same on every tp rank (parallel/expert_parallel.py):
            # replicated, counted once.
            weighted = DTensor.from_local(weighted, out.loss.device_mesh, out.loss.placements)
        out.loss = out.loss + weighted
        out.metrics[f"aux_{name}"] = weighted.detach()
    return out


def without_auxiliary(out: LossOutput) -> torch.Tensor:
    """The objective's own sum, the auxiliary terms taken back out (what validation reports)."""
    aux = [value for name, value in out.metrics.items() if name.startswith("aux_")]
    return out.loss.detach() - sum(aux) if aux else out.loss.detach()


def _label_count(labels_BT: torch.Tensor) -> torch.Tensor:
    return (labels_BT != IGNORE_INDEX).sum()
