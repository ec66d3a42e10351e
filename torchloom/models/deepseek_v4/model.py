"""DeepSeek-V4: the shared decoder's embedding, final norm and head around blocks whose residual
stream is ``hc_streams`` copies wide (hyper-connections).

A block (``DeepSeekV4Block``) reads like the paper: the attention's hyper-connection collapses
the streams into the attention's input, whose output it spreads back while mixing the streams;
the same again around the MoE, which in the first ``hash_layers`` layers routes by token id.
The streams start as copies of the token embedding and ``hc_head`` collapses them before the
final norm.

Generation runs the same blocks with a ``ModelCache`` whose layer states are
``CompressedState`` (models/components/compressed_attention.py). Not built: multi-token
prediction (the published checkpoints' ``mtp.*`` tensors are skipped on load, as transformers
does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchloom.models.components.cache import ModelCache
from torchloom.models.components.compressed_attention import (
    BoundCompressedState,
    CompressedSparseAttention,
)
from torchloom.models.components.decoder import Decoder, LayerInputs, _residual_std
from torchloom.models.components.hyper_connections import HyperConnection, HyperHead
from torchloom.models.components.moe import MoE
from torchloom.models.components.param_init import ParamInit

if TYPE_CHECKING:
    from torchloom.models.deepseek_v4.config import DeepSeekV4Config


class DeepSeekV4Block(nn.Module):
    """streams -> attention branch (mHC) -> MoE branch (mHC) -> streams, [B, T, N, D]."""

    def __init__(self, cfg: DeepSeekV4Config, index: int) -> None:
        super().__init__()
        kind = cfg.kinds()[index]
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


class DeepSeekV4(Decoder):
    """Embedding -> N streams -> blocks -> hc_head -> final norm -> head."""

    supports_pipeline = False
    """Pipeline stages hand over one [B, T, D] hidden state; these blocks pass the [B, T, N, D]
    streams (train/builders.check_layout refuses --parallel.pp)."""

    def __init__(self, cfg: DeepSeekV4Config) -> None:
        super().__init__(cfg)  # rope stays None: each attention layer computes its own
        self.hc_head = HyperHead(cfg.dim, cfg.hc_streams, cfg.hc_eps, cfg.norm_eps, cfg.init_std)

    def build_layers(self, cfg: DeepSeekV4Config) -> nn.ModuleDict:  # type: ignore[override]
        return nn.ModuleDict({str(i): DeepSeekV4Block(cfg, i) for i in range(cfg.num_layers)})

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
        B, T = tokens_BT.shape[:2]
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        h_BTD = self.embed(tokens_BT) if embeds_BTD is None else embeds_BTD
        streams_BTND = h_BTD[:, :, None].expand(-1, -1, self.config.hc_streams, -1).contiguous()
        for name, block in self.layers.items():
            layer_cache = None if cache is None else cache.layer(int(name))
            streams_BTND = block(streams_BTND, tokens_BT, positions_BT, doc_ids_BT, layer_cache)
        h_BTD = self.hc_head(streams_BTND)
        return self.norm(h_BTD) if self.norm is not None else h_BTD

    def layer_inputs(self, *args: object, **kwargs: object) -> LayerInputs:
        raise NotImplementedError("deepseek_v4 blocks take token ids and positions directly")

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """The decoder's init (embedding, blocks, norm, head) and the hc_head's."""
        if isinstance(init, int):
            init = ParamInit(self, init)
        self.hc_head.init_weights(init)
        super().init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """The decoder's count plus the hyper-connections' linears."""
        hc = sum(6 * p.numel() for n, p in self.named_parameters() if n.endswith(("fn", "hc_fn")))
        return super().flops_per_token(seq_len) + hc
