"""DeepSeek-V3's model: the generic decoder (MLA layers, dense then MoE feed-forwards) plus
multi-token prediction (MTP, DeepSeek-V3 section 2.2; the loss, the shifts and when it runs:
models/components/multi_token_prediction.py).

MTP depth k (1..D) predicts the token k + 1 places ahead of each position i. Its input at i is
the previous depth's hidden state at i (for k = 1 the main model's last block output, before
the final norm) and the embedding of token i + k, each RMS-normed (hnorm, enorm), concatenated
and projected back to dim (eh_proj); one decoder block of the last layer's kinds follows, then
its own final norm and the model's output head. The embedding and the head are the main
model's (shared).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchloom.models.components.decoder import Block, LayerInputs
from torchloom.models.components.multi_token_prediction import (
    MTPDecoder,
    MultiTokenPrediction,
    RunDepth,
)
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


class DeepSeekV3(MTPDecoder):
    """The decoder, plus ``mtp`` (None without multi-token prediction): its depths keyed by the
    layer index each takes in a Hugging Face checkpoint (num_layers + depth - 1)."""

    def __init__(self, cfg: DeepSeekV3Config) -> None:
        super().__init__(cfg)
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_layers:
            first = cfg.num_layers
            depths = {str(first + k): MTPBlock(cfg, first + k) for k in range(cfg.mtp_layers)}
            self.mtp = MultiTokenPrediction(depths, cfg.mtp_loss_weight)

    def mtp_trunk(
        self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None, embeds_BTD: torch.Tensor | None,
    ) -> tuple[torch.Tensor, RunDepth]:  # fmt: skip
        """The last block's output, before the final norm; each depth reads the layers'
        inputs (positions, documents) the trunk read."""
        inputs = self.layer_inputs(tokens_BT, positions_BT, doc_ids_BT)
        h_BTD = self.embed(tokens_BT) if embeds_BTD is None else embeds_BTD

        def run_depth(
            depth: nn.Module, h_BTD: torch.Tensor, ahead_BT: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return depth(h_BTD, self.embed_tokens(ahead_BT), inputs)

        return self.run_blocks(h_BTD, inputs), run_depth

    def mtp_final(self, h_BTD: torch.Tensor) -> torch.Tensor:
        return self.norm(h_BTD)
