"""DeepSeek-V3's model: the generic decoder (MLA layers, dense then MoE feed-forwards) plus
multi-token prediction (MTP, DeepSeek-V3 section 2.2).

MTP depth k (1..D) predicts the token k + 1 places ahead of each position i. Its input at i is
the previous depth's hidden state at i (for k = 1 the main model's last block output, before
the final norm) and the embedding of token i + k, each RMS-normed (hnorm, enorm), concatenated
and projected back to dim (eh_proj); one decoder block of the last layer's kinds follows, then
its own final norm and the model's output head. The embedding and the head are the main
model's (shared). The loss is lambda / D * sum_k (mean cross-entropy of depth k over its valid
targets), where a target is valid when its label is not IGNORE_INDEX and, with packed
documents, token i + k is still in position i's document. It is reported to the objective as
the auxiliary term ``mtp`` (logged as ``aux_mtp``), and is computed only in training forwards
given an objective and labels: evaluation, generation and plain logits never run the MTP blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.data.packing import IGNORE_INDEX
from torchloom.kernels.linear_cross_entropy import cross_entropy_sum
from torchloom.models.components.cache import ModelCache
from torchloom.models.components.decoder import Block, Decoder, LayerInputs, Objective
from torchloom.models.components.norms import NORM_IMPLS
from torchloom.models.components.param_init import ParamInit

if TYPE_CHECKING:  # the config builds this model: the model needs its type only
    from torchloom.models.deepseek_v3.config import DeepSeekV3Config


class MTPBlock(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj, a decoder block (attention_norm, attention,
    mlp_norm, mlp under the same names as a layer's) and its final norm."""

    def __init__(self, cfg: DeepSeekV3Config, index: int) -> None:
        super().__init__()
        norm_cls = NORM_IMPLS[cfg.norm_impl]
        self.enorm = norm_cls(cfg.dim, cfg.norm_eps)
        self.hnorm = norm_cls(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        # Its MoE layer (if any) keeps its choice bias as loaded: expert balancing covers the
        # decoder's layers (train/expert_balance.py), and this index is past them.
        self.block = Block(cfg, index, cfg.layer_specs()[-1])
        self.norm = norm_cls(cfg.dim, cfg.norm_eps)
        self.init_std = cfg.init_std

    def forward(
        self, h_BTD: torch.Tensor, embedded_BTD: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden state, the same after its final norm) from the previous depth's
        hidden state and the embeddings of the tokens k ahead."""
        x_BTD = self.eh_proj(torch.cat([self.enorm(embedded_BTD), self.hnorm(h_BTD)], dim=-1))
        h_BTD = self.block(x_BTD, *inputs)
        return h_BTD, self.norm(h_BTD)

    def init_weights(self, init: ParamInit) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.init_weights(init)
        init.trunc_normal_(self.eh_proj.weight, self.init_std)
        self.block.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        block = self.block
        mixer, ffn = block.attention.flops_per_token(seq_len), block.mlp.flops_per_token(seq_len)
        return mixer + ffn + 6 * self.eh_proj.weight.numel()


class MultiTokenPrediction(nn.Module):
    """The MTP depths, keyed by the layer index each takes in a Hugging Face checkpoint
    (num_layers + depth - 1), and the loss of the last training forward."""

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__()
        first = cfg.num_layers
        self.layers = nn.ModuleDict(
            {str(first + k): MTPBlock(cfg, first + k) for k in range(cfg.mtp_layers)}
        )
        self.weight = cfg.mtp_loss_weight
        self._loss: torch.Tensor | None = None

    def forward(
        self,
        model: DeepSeekV3,
        h_BTD: torch.Tensor,
        tokens_BT: torch.Tensor,
        labels_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor | None,
        inputs: LayerInputs,
    ) -> torch.Tensor:
        """lambda / D * sum over depths of the mean cross-entropy of each depth's predictions
        (kept for ``pop_auxiliary_losses``, and returned)."""
        total = h_BTD.new_zeros((), dtype=torch.float32)
        for depth, mtp in enumerate(self.layers.values(), start=1):
            ahead_BT = shifted(tokens_BT, depth, 0, doc_ids_BT)
            h_BTD, normed_BTD = mtp(h_BTD, model.embed_tokens(ahead_BT), inputs)
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

    def flops_per_token(self, seq_len: int, vocab_size: int) -> int:
        """Each depth's block and eh_proj, and its pass through the output head."""
        dim = next(iter(self.layers.values())).eh_proj.weight.shape[0]
        return sum(m.flops_per_token(seq_len) + 6 * vocab_size * dim for m in self.layers.values())


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


class DeepSeekV3(Decoder):
    """The decoder, plus ``mtp`` (None without multi-token prediction)."""

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__(cfg)
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_layers else None

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
        labels_BT = (targets or {}).get("labels")
        if (self.mtp is None or objective is None or labels_BT is None or not self.training
                or cache is not None or not self.has_head):  # fmt: skip
            return super().forward(
                tokens_BT, positions_BT, doc_ids_BT, cache=cache, objective=objective,
                targets=targets, embeds_BTD=embeds_BTD,
            )  # fmt: skip
        inputs = self.layer_inputs(tokens_BT, positions_BT, doc_ids_BT)
        h_BTD = self.embed(tokens_BT) if embeds_BTD is None else embeds_BTD
        h_BTD = self.run_blocks(h_BTD, inputs)
        self.mtp(self, h_BTD, tokens_BT, labels_BT, doc_ids_BT, inputs)
        return objective(self.norm(h_BTD), self, targets or {})

    def flops_per_token(self, seq_len: int) -> int:
        """The decoder's, plus the MTP depths' (a training step runs them)."""
        main = super().flops_per_token(seq_len)
        if self.mtp is None:
            return main
        return main + self.mtp.flops_per_token(seq_len, self.config.vocab_size)

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """The decoder's init (Decoder.init_weights), with the MTP depths' parameters too."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        if self.mtp is not None:
            for mtp in self.mtp.layers.values():
                mtp.init_weights(init)
        super().init_weights(init)
