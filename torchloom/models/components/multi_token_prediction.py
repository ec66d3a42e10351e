"""Multi-token prediction (MTP, DeepSeek-V3 section 2.2): what every family's MTP shares, whatever
its depths are made of.

Depth k (1..D) predicts the token k + 1 places ahead of each position i from the previous
depth's hidden state at i and the embedding of token i + k. A family builds its depths (one
module each: deepseek_v3's MTPBlock, deepseek_v4's MTPDepth) and says how one runs
(``RunDepth``); this module shifts the tokens and the labels by k, sends each depth's output
through the model's own head, and reduces the depths' cross-entropies to one loss:
lambda / D * sum_k (mean cross-entropy of depth k over its valid targets), where a target is
valid when its label is not IGNORE_INDEX and, with packed documents, token i + k is still in
position i's document. The loss is handed to the objective once, as the auxiliary term ``mtp``
(logged as ``aux_mtp``), and only training forwards given an objective and labels compute it
(``mtp_labels``): evaluation, generation and plain logits never run the depths.

``MTPDecoder`` is the decoder with an ``mtp`` attribute: its forward, FLOPs and init cover the
depths, and a family supplies only how its trunk runs (``mtp_trunk``) and what turns the
trunk's output into the head's input (``mtp_final``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.data.packing import IGNORE_INDEX
from torchloom.kernels.linear_cross_entropy import cross_entropy_sum
from torchloom.models.components.cache import ModelCache
from torchloom.models.components.decoder import Decoder, Objective
from torchloom.models.components.param_init import ParamInit

RunDepth = Callable[[nn.Module, Any, torch.Tensor], tuple[Any, torch.Tensor]]
"""``(depth, previous hidden state, ahead_BT) -> (this depth's hidden state, its final-normed
[B, T, D] output for the head)``: how a family runs one depth on the tokens k ahead. The hidden
state is whatever the family's depths pass on ([B, T, D], or deepseek_v4's [B, T, N, D])."""


class MultiTokenPrediction(nn.Module):
    """The MTP depths (``layers``, keyed as the family's checkpoints number them) and the loss
    of the last training forward."""

    def __init__(self, depths: dict[str, nn.Module], weight: float) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(depths)
        self.weight = weight
        self._loss: torch.Tensor | None = None

    def forward(
        self,
        model: Any,
        h: Any,
        tokens_BT: torch.Tensor,
        labels_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor | None,
        run_depth: RunDepth,
    ) -> torch.Tensor:
        """lambda / D * sum over depths of the mean cross-entropy of each depth's predictions
        through ``model``'s head (kept for ``pop_auxiliary_losses``, and returned). ``h``: the
        main model's hidden state after its last block, before anything collapses or norms it."""
        total = tokens_BT.new_zeros((), dtype=torch.float32)
        for depth, module in enumerate(self.layers.values(), start=1):
            ahead_BT = shifted(tokens_BT, depth, 0, doc_ids_BT)
            h, normed_BTD = run_depth(module, h, ahead_BT)
            targets_BT = shifted(labels_BT, depth, IGNORE_INDEX, doc_ids_BT)
            count = (targets_BT != IGNORE_INDEX).sum().clamp(min=1)
            loss = cross_entropy_sum(model.logits(normed_BTD), targets_BT)
            if isinstance(loss, DTensor):  # tensor parallelism's loss-parallel sum
                loss = loss.to_local()  # replicated: every tp rank holds the same value
            total = total + loss / count
        self._loss = total * (self.weight / len(self.layers))
        return self._loss

    def pop_auxiliary_losses(self) -> dict[str, torch.Tensor]:
        """The MTP loss of the last training forward, handed over once."""
        loss, self._loss = self._loss, None
        return {} if loss is None else {"mtp": loss}

    def flops_per_token(self, seq_len: int, vocab_size: int, dim: int) -> int:
        """Each depth's own (``flops_per_token`` of the depth module) and its pass through the
        output head."""
        return sum(m.flops_per_token(seq_len) + 6 * vocab_size * dim for m in self.layers.values())


class MTPDecoder(Decoder):
    """A decoder plus ``mtp`` (None without multi-token prediction), set by the family's
    constructor. Subclasses define ``mtp_trunk`` and ``mtp_final``."""

    mtp: MultiTokenPrediction | None

    def mtp_trunk(
        self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None, embeds_BTD: torch.Tensor | None,
    ) -> tuple[Any, RunDepth]:  # fmt: skip
        """(the hidden state after the last block, before anything collapses or norms it; how
        a depth runs on it) for a training forward."""
        raise NotImplementedError

    def mtp_final(self, h: Any) -> torch.Tensor:
        """The head's input [B, T, D] from the trunk's hidden state (the final norm, ...)."""
        raise NotImplementedError

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        *,
        cache: ModelCache | None = None,
        objective: Objective | None = None,
        targets: dict[str, torch.Tensor] | None = None,
        embeds_BTD: torch.Tensor | None = None,
    ) -> Any:
        """As ``Decoder.forward``; a training forward with an objective and labels also
        computes the MTP loss, which the objective collects with the layers' other terms."""
        labels_BT = mtp_labels(self, cache, objective, targets)
        if labels_BT is None:
            return super().forward(
                tokens_BT, positions_BT, doc_ids_BT, cache=cache, objective=objective,
                targets=targets, embeds_BTD=embeds_BTD,
            )  # fmt: skip
        assert self.mtp is not None and objective is not None  # what mtp_labels checked
        h, run_depth = self.mtp_trunk(tokens_BT, positions_BT, doc_ids_BT, embeds_BTD)
        self.mtp(self, h, tokens_BT, labels_BT, doc_ids_BT, run_depth)
        return objective(self.mtp_final(h), self, targets or {})

    def flops_per_token(self, seq_len: int) -> int:
        """The decoder's, plus the MTP depths' (a training step runs them)."""
        main = super().flops_per_token(seq_len)
        if self.mtp is None:
            return main
        return main + self.mtp.flops_per_token(seq_len, self.config.vocab_size, self.config.dim)

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """The decoder's init (Decoder.init_weights), with the MTP depths' parameters too."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        if self.mtp is not None:
            for depth in self.mtp.layers.values():
                depth.init_weights(init)
        super().init_weights(init)


def mtp_labels(
    model: Any, cache: Any, objective: Any, targets: dict[str, torch.Tensor] | None
) -> torch.Tensor | None:
    """The labels a forward of ``model`` trains its MTP depths on, or None when it does not run
    them: without depths, outside training, without an objective or labels, with a generation
    cache, or on a pipeline stage without the head."""
    labels_BT = (targets or {}).get("labels")
    if (model.mtp is None or objective is None or labels_BT is None or not model.training
            or cache is not None or not model.has_head):  # fmt: skip
        return None
    return labels_BT


def shifted(x_BT: torch.Tensor, k: int, fill: int, doc_ids_BT: torch.Tensor | None) -> torch.Tensor:
    """x[:, i + k] at position i; ``fill`` where i + k is past the row or (with doc_ids) in
    another document than i."""
    out_BT = torch.full_like(x_BT, fill)
    T = x_BT.shape[1]
    if k >= T:
        return out_BT
    ahead_BT = x_BT[:, k:]
    if doc_ids_BT is not None:
        same_doc_BT = doc_ids_BT[:, k:] == doc_ids_BT[:, : T - k]
        ahead_BT = torch.where(same_doc_BT, ahead_BT, fill)
    out_BT[:, : T - k] = ahead_BT
    return out_BT
