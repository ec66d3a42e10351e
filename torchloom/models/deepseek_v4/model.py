"""DeepSeek-V4: the shared decoder's embedding, final norm and head around blocks whose residual
stream is ``hc_streams`` copies wide (hyper-connections).

A block (``DeepSeekV4Block``) reads like the paper: the attention's hyper-connection collapses
the streams into the attention's input, whose output it spreads back while mixing the streams;
the same again around the MoE, which in the first ``hash_layers`` layers routes by token id.
The streams start as copies of the token embedding and ``hc_head`` collapses them before the
final norm.

Generation runs the same blocks with a ``ModelCache`` whose layer states are
``CompressedState`` (models/components/compressed_attention.py).

Multi-token prediction (``mtp_layers``; the loss, the shifts and when it runs: models/
components/multi_token_prediction.py) follows DeepSeek's published inference code (its
``MTPBlock``) and tensor names: depth k reads the previous depth's streams (for k = 1 the main
model's, before ``hc_head``) and the embedding of the tokens k ahead. The embedding is RMS-
normed and projected (``enorm``, ``e_proj``) once and added to every stream, each stream
RMS-normed and projected on its own (``hnorm``, ``h_proj``); one block of the sliding-window
kind (the checkpoints' MTP layer has compress ratio 0: no compressor, no indexer) with its own
hyper-connections follows, then the depth's own ``hc_head`` and ``norm`` and the shared head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchloom.models.components.cache import ModelCache
from torchloom.models.components.compressed_attention import (
    SLIDING,
    BoundCompressedState,
    CompressedSparseAttention,
)
from torchloom.models.components.decoder import LayerInputs, _residual_std
from torchloom.models.components.hyper_connections import HyperConnection, HyperHead
from torchloom.models.components.moe import MoE
from torchloom.models.components.multi_token_prediction import (
    MTPDecoder,
    MultiTokenPrediction,
    RunDepth,
)
from torchloom.models.components.param_init import ParamInit

if TYPE_CHECKING:
    from torchloom.models.deepseek_v4.config import DeepSeekV4Config


class DeepSeekV4Block(nn.Module):
    """streams -> attention branch (mHC) -> MoE branch (mHC) -> streams, [B, T, N, D].
    ``kind``: the attention kind, when it is not layer ``index``'s (an MTP depth's block)."""

    def __init__(self, cfg: DeepSeekV4Config, index: int, kind: str | None = None) -> None:
        super().__init__()
        kind = kind or cfg.kinds()[index]
        ratio = cfg.csa_ratio if kind == "compressed_sparse_attention" else cfg.hca_ratio
        hc = dict(streams=cfg.hc_streams, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                  norm_eps=cfg.norm_eps, init_std=cfg.init_std)  # fmt: skip
        self.attention_hc = HyperConnection(cfg.dim, **hc)  # type: ignore[arg-type]
        self.attention_norm = cfg.make_norm(cfg.dim)
        self.attention = CompressedSparseAttention(
            kind, cfg.dim, cfg.num_heads, cfg.head_dim, cfg.rope_dim, cfg.q_lora_rank,
            cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window, ratio, cfg.rope_of(kind),
            cfg.index_heads, cfg.index_head_dim, cfg.index_topk, cfg.norm_eps, cfg.init_std,
            _residual_std(cfg), cfg.indexer_loss_weight, cfg.sparse_attention,
        )  # fmt: skip
        self.mlp_hc = HyperConnection(cfg.dim, **hc)  # type: ignore[arg-type]
        self.mlp_norm = cfg.make_norm(cfg.dim)
        self.mlp = MoE(
            cfg.dim, cfg.moe_of(index), impl=cfg.mlp_impl, invariant=cfg.batch_invariant,
            init_std=cfg.init_std, out_std=_residual_std(cfg), vocab_size=cfg.vocab_size,
        )  # fmt: skip

    def forward(
        self, streams_BTND: torch.Tensor, tokens_BT: torch.Tensor, positions_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor | None, cache: BoundCompressedState | None = None,
    ) -> torch.Tensor:  # fmt: skip
        post, comb, x_BTD = self.attention_hc(streams_BTND)
        x_BTD = self.attention_norm(x_BTD)
        branch_BTD = self.attention(x_BTD, positions_BT, doc_ids_BT, cache=cache)
        streams_BTND = HyperConnection.join(streams_BTND, branch_BTD, post, comb)
        post, comb, x_BTD = self.mlp_hc(streams_BTND)
        branch_BTD = self.mlp(self.mlp_norm(x_BTD), tokens_BT)
        return HyperConnection.join(streams_BTND, branch_BTD, post, comb)

    def init_weights(self, init: ParamInit) -> None:
        for module in self.children():
            module.init_weights(init)


class MTPDepth(nn.Module):
    """One MTP depth, under DeepSeek's names: enorm and e_proj on the embedding of the tokens k
    ahead, hnorm and h_proj on each of the previous depth's streams, a sliding-window block
    (``block``: a layer's modules under a layer's names), then its own hc_head and norm."""

    def __init__(self, cfg: DeepSeekV4Config, index: int) -> None:
        super().__init__()
        self.enorm = cfg.make_norm(cfg.dim)
        self.e_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.hnorm = cfg.make_norm(cfg.dim)
        self.h_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        # index >= num_layers >= hash_layers: a top-k routed MoE, whose choice bias stays as
        # loaded (expert balancing covers the decoder's layers: train/expert_balance.py).
        self.block = DeepSeekV4Block(cfg, index, kind=SLIDING)
        self.hc_head = HyperHead(cfg.dim, cfg.hc_streams, cfg.hc_eps, cfg.norm_eps, cfg.init_std)
        self.norm = cfg.make_norm(cfg.dim)
        self.init_std, self.streams = cfg.init_std, cfg.hc_streams

    def forward(
        self, streams_BTND: torch.Tensor, embedded_BTD: torch.Tensor, ahead_BT: torch.Tensor,
        positions_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(this depth's streams, its final-normed hidden state for the head) from the previous
        depth's streams and the embeddings of the tokens k ahead (``ahead_BT``: their ids)."""
        e_BTD = self.e_proj(self.enorm(embedded_BTD))
        x_BTND = self.h_proj(self.hnorm(streams_BTND)) + e_BTD[:, :, None]
        streams_BTND = self.block(x_BTND, ahead_BT, positions_BT, doc_ids_BT)
        return streams_BTND, self.norm(self.hc_head(streams_BTND))

    def init_weights(self, init: ParamInit) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.init_weights(init)
        init.trunc_normal_(self.e_proj.weight, self.init_std)
        init.trunc_normal_(self.h_proj.weight, self.init_std)
        self.block.init_weights(init)
        self.hc_head.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """The block's attention and MoE, its and hc_head's mixings, e_proj once and h_proj
        once per stream."""
        block = self.block
        branches = block.attention.flops_per_token(seq_len) + block.mlp.flops_per_token(seq_len)
        mixings = sum(6 * p.numel() for n, p in self.named_parameters() if n.endswith("fn"))
        projections = 6 * (1 + self.streams) * self.e_proj.weight.numel()
        return branches + mixings + projections


class DeepSeekV4(MTPDecoder):
    """Embedding -> N streams -> blocks -> hc_head -> final norm -> head; plus ``mtp`` (None
    without multi-token prediction): its depths keyed 0, 1, ... as the checkpoints' mtp.{k}."""

    supports_pipeline = False
    """Pipeline stages hand over one [B, T, D] hidden state; these blocks pass the [B, T, N, D]
    streams (train/builders.check_layout refuses --parallel.pp)."""

    def __init__(self, cfg: DeepSeekV4Config) -> None:
        super().__init__(cfg)  # rope stays None: each attention layer computes its own
        self.hc_head = HyperHead(cfg.dim, cfg.hc_streams, cfg.hc_eps, cfg.norm_eps, cfg.init_std)
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_layers:
            depths = {str(k): MTPDepth(cfg, cfg.num_layers + k) for k in range(cfg.mtp_layers)}
            self.mtp = MultiTokenPrediction(depths, cfg.mtp_loss_weight)

    def build_layers(self, cfg: DeepSeekV4Config) -> nn.ModuleDict:  # type: ignore[override]
        return nn.ModuleDict({str(i): DeepSeekV4Block(cfg, i) for i in range(cfg.num_layers)})

    def mtp_trunk(
        self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None, embeds_BTD: torch.Tensor | None,
    ) -> tuple[torch.Tensor, RunDepth]:  # fmt: skip
        """The streams after the last block, before hc_head; each depth reads the positions
        and documents the trunk read."""
        positions_BT = self._positions(tokens_BT, positions_BT)

        def run_depth(
            depth: nn.Module, streams_BTND: torch.Tensor, ahead_BT: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return depth(streams_BTND, self.embed(ahead_BT), ahead_BT, positions_BT, doc_ids_BT)

        streams_BTND = self.run_streams(tokens_BT, positions_BT, doc_ids_BT, embeds_BTD=embeds_BTD)
        return streams_BTND, run_depth

    def mtp_final(self, streams_BTND: torch.Tensor) -> torch.Tensor:
        return self.collapse(streams_BTND)

    def forward_hidden(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
        *,
        embeds_BTD: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, D] (after hc_head and the final norm). With ``cache``
        (generation) positions are the tokens' places in their sequences, as the cache's
        binding says."""
        positions_BT = self._positions(tokens_BT, positions_BT)
        streams_BTND = self.run_streams(
            tokens_BT, positions_BT, doc_ids_BT, cache, embeds_BTD=embeds_BTD
        )
        return self.collapse(streams_BTND)

    def run_streams(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
        *,
        embeds_BTD: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The streams [B, T, N, D] after the last block: copies of the embedding, through every
        block."""
        h_BTD = self.embed(tokens_BT) if embeds_BTD is None else embeds_BTD
        streams_BTND = h_BTD[:, :, None].expand(-1, -1, self.config.hc_streams, -1).contiguous()
        for name, block in self.layers.items():
            layer_cache = None if cache is None else cache.layer(int(name))
            streams_BTND = block(streams_BTND, tokens_BT, positions_BT, doc_ids_BT, layer_cache)
        return streams_BTND

    def collapse(self, streams_BTND: torch.Tensor) -> torch.Tensor:
        """The final hidden state [B, T, D]: hc_head, then the final norm."""
        h_BTD = self.hc_head(streams_BTND)
        return self.norm(h_BTD) if self.norm is not None else h_BTD

    @staticmethod
    def _positions(tokens_BT: torch.Tensor, positions_BT: torch.Tensor | None) -> torch.Tensor:
        B, T = tokens_BT.shape[:2]
        if positions_BT is None:
            return torch.arange(T, device=tokens_BT.device).expand(B, T)
        return positions_BT

    def layer_inputs(self, *args: object, **kwargs: object) -> LayerInputs:
        raise NotImplementedError("deepseek_v4 blocks take token ids and positions directly")

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """MTPDecoder's init (embedding, blocks, norm, head, MTP depths) and the hc_head's."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        self.hc_head.init_weights(init)
        super().init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """MTPDecoder's count (the decoder's and the MTP depths') plus the main model's
        hyper-connection linears (a depth counts its own)."""
        hc = sum(6 * p.numel() for n, p in self.named_parameters()
                 if n.endswith(("fn", "hc_fn")) and not n.startswith("mtp."))  # fmt: skip
        return super().flops_per_token(seq_len) + hc
