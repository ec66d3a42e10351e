"""Generic decoder-only transformer LM: pre-norm blocks of GQA attention and SwiGLU."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.kernels import batch_invariant
from torchloom.kernels.float8 import FLOAT8_RECIPES
from torchloom.kernels.linear_cross_entropy import (
    LOSS_IMPLS,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)
from torchloom.models.components.attention import (
    ATTENTION_BACKENDS,
    Attention,
    LayerCache,
    shared_attention_input,
)
from torchloom.models.components.mlp import MLP_IMPLS, SwiGLU
from torchloom.models.components.norms import NORM_IMPLS
from torchloom.models.components.rope import ROPE_IMPLS, RopeConfig, RotaryEmbedding


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a decoder-only transformer (one flavor of a family)."""

    vocab_size: int = 4096
    """Number of token ids (rows of the embedding, columns of the output head)."""
    dim: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Query heads per attention layer."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int | None = None
    """Channels per head; None means dim // num_heads (Qwen3 sets it independently of dim)."""
    ffn_dim: int = 192
    """Hidden width of the SwiGLU feed-forward."""
    norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary position embedding frequencies (override fields as 'rope.theta', ...)."""
    max_seq_len: int = 2048
    """Longest sequence the flavor is meant for (RoPE itself has no table, so this is advisory)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on every query and key head before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """Use the embedding matrix as the output head (no separate `output` weight)."""
    attn_backend: str = "sdpa"
    """Attention kernel, a key of ATTENTION_BACKENDS ('sdpa', 'flex')."""
    norm_impl: str = "torch"
    """RMSNorm implementation, a key of NORM_IMPLS: 'torch' (PyTorch reference) or 'triton'
    (fused kernels on CUDA, the reference elsewhere)."""
    rope_impl: str = "torch"
    """How RoPE rotates q and k, a key of ROPE_IMPLS: 'torch' or 'triton' (as norm_impl)."""
    mlp_impl: str = "torch"
    """The SwiGLU gate silu(gate) * up, a key of MLP_IMPLS: 'torch' or 'triton' (as norm_impl)."""
    batch_invariant: bool = False
    """Fixed-order (batch-invariant) linears and attention: a token's numbers do not depend on
    its batch or on prefill vs decode (see torchloom/kernels/batch_invariant.py)."""
    loss_impl: str = "full"
    """How forward(..., labels_BT) computes the loss: 'full' (logits, then cross-entropy) or
    'chunked' (head matmul and cross-entropy fused over token chunks; no [B, T, V] logits)."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 training of the blocks' linears with torchao (torchloom/kernels/float8.py):
    'tensorwise' or 'rowwise' scaling; 'none' keeps them in the compute dtype."""
    init_std: float = 0.02
    """Standard deviation of the initial weights (see Transformer.init_weights)."""

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or dim // num_heads when it is not set."""
        return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        sizes = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each kv head serves a whole group of query heads."
            )
        if self.head_dim is None and self.dim % self.num_heads:
            raise ConfigError(
                f"dim ({self.dim}) is not divisible by num_heads ({self.num_heads}); "
                "change one of them or set head_dim explicitly."
            )
        if self.resolved_head_dim <= 0 or self.resolved_head_dim % 2:
            raise ConfigError(
                f"head_dim must be positive and even for RoPE, got {self.resolved_head_dim}."
            )
        for value, name in ((self.norm_eps, "norm_eps"), (self.init_std, "init_std")):
            if value <= 0:
                raise ConfigError(f"model {name} must be positive, got {value}.")
        if self.max_seq_len <= 0:
            raise ConfigError(f"model max_seq_len must be positive, got {self.max_seq_len}.")
        for slot, name, registry in (
            ("attn_backend", self.attn_backend, ATTENTION_BACKENDS),
            ("norm_impl", self.norm_impl, NORM_IMPLS),
            ("rope_impl", self.rope_impl, ROPE_IMPLS),
            ("mlp_impl", self.mlp_impl, MLP_IMPLS),
            ("loss_impl", self.loss_impl, LOSS_IMPLS),
        ):
            if name not in registry:
                raise ConfigError(
                    f"Unknown {slot} '{name}'.{did_you_mean(name, registry)} "
                    f"Available: {', '.join(sorted(registry))}."
                )
        if self.float8 not in ("none", *FLOAT8_RECIPES):
            raise ConfigError(
                f"Unknown float8 recipe '{self.float8}'.{did_you_mean(self.float8, FLOAT8_RECIPES)}"
                f" Available: none, {', '.join(FLOAT8_RECIPES)}."
            )
        if self.float8 != "none" and self.batch_invariant:
            raise ConfigError(
                "float8 and batch_invariant both replace the linears; choose one of them."
            )
        self.rope.validate()

    def _layer_matmul_params(self) -> int:
        d, hd = self.dim, self.resolved_head_dim
        attention = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o and k, v
        return attention + 3 * d * self.ffn_dim  # gate, up, down

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the built model (tied embeddings counted once).

        ``include_embedding=False`` leaves out the vocabulary matrices (the embedding and, when
        untied, the output head): the "non-embedding" count of scaling-law papers.
        """
        qk_norm = 2 * self.resolved_head_dim if self.qk_norm else 0
        per_layer = self._layer_matmul_params() + 2 * self.dim + qk_norm
        total = self.num_layers * per_layer + self.dim  # + final norm
        if include_embedding:
            total += self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) for sequences of ``seq_len`` tokens.

        6 * N_matmul + 6 * num_layers * num_heads * head_dim * seq_len, where N_matmul counts
        every weight used in a matmul: attention q/k/v/o, the MLP and the output head (counted
        even when tied; the embedding lookup is not a matmul). A matmul costs 2 FLOPs per weight
        per token forward and 4 backward, hence 6 N. The second term is attention itself: QK^T
        and AV each cost 2 * head_dim * seq_len per head per token, halved because causal
        attention skips the upper triangle, times 3 for forward + backward. MFU uses this formula.
        """
        n_matmul = self.num_layers * self._layer_matmul_params() + self.vocab_size * self.dim
        attention = self.num_layers * self.num_heads * self.resolved_head_dim * seq_len
        return 6 * n_matmul + 6 * attention


class ModelCache(Protocol):
    """A generation KV cache as the model sees it (torchloom/generate/cache.py)."""

    def layer(self, index: int) -> LayerCache: ...


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        norm_cls = NORM_IMPLS[cfg.norm_impl]
        self.attention_norm = norm_cls(cfg.dim, cfg.norm_eps)
        self.attention = Attention(
            cfg.dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.resolved_head_dim,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
            backend=cfg.attn_backend,
            norm_impl=cfg.norm_impl,
            rope_impl=cfg.rope_impl,
        )
        self.mlp_norm = norm_cls(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim, impl=cfg.mlp_impl)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor,
        sin_BTd: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        # cache by keyword: tensor-parallel plans describe the four positional inputs.
        h_BTD = x_BTD + self.attention(
            self.attention_norm(x_BTD), cos_BTd, sin_BTd, doc_ids_BT, cache=cache
        )
        return h_BTD + self.mlp(self.mlp_norm(h_BTD))


class Transformer(nn.Module):
    """Token embedding, ``num_layers`` blocks, final RMSNorm and the output head.

    ``layers`` is a ModuleDict keyed "0", "1", ... so a pipeline stage can delete blocks and keep
    the names of the rest. A stage may also set ``embed_tokens`` (its input is then the hidden
    state), ``norm`` or ``output`` to None. With ``tie_embeddings`` there is no ``output``
    module: the head is ``embed_tokens.weight`` (one parameter, so it survives ``to_empty``;
    data parallelism must shard it in the group that also holds the head's caller, the root).
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.rope, cfg.resolved_head_dim, cfg.batch_invariant)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.num_layers)})
        self.norm: nn.Module | None = NORM_IMPLS[cfg.norm_impl](cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward_hidden(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states h_BTD (after the final norm), before the output head.

        positions_BT defaults to 0..T-1 in every row; pass positions that restart at each
        document together with doc_ids_BT for packed rows. ``cache`` (generation) gives each
        block its layer of a KV cache; positions are then the tokens' places in their sequence.
        """
        B, T = tokens_BT.shape[:2]
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        cos_BTd, sin_BTd = self.rope(positions_BT)
        h_BTD = self.embed_tokens(tokens_BT) if self.embed_tokens is not None else tokens_BT
        documents = doc_ids_BT  # what the layers' attention takes: ids, or a mask built from them
        if cache is None:  # the layers' kernel (context parallelism may have replaced it)
            first = next(iter(self.layers.values()), None)  # wrappers forward attribute reads
            attend = getattr(getattr(first, "attention", None), "attend", None)
            documents = shared_attention_input(attend, doc_ids_BT, T, tokens_BT.device)
        for name, block in self.layers.items():
            layer_cache = None if cache is None else cache.layer(int(name))
            h_BTD = block(h_BTD, cos_BTd, sin_BTd, documents, cache=layer_cache)
        return self.norm(h_BTD) if self.norm is not None else h_BTD

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        labels_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or the hidden state on a pipeline stage without the head); with
        ``labels_BT``, the fp32 sum of the token cross-entropies instead (labels equal to
        IGNORE_INDEX skipped), computed as ``config.loss_impl`` says. ``cache``: see
        forward_hidden."""
        h_BTD = self.forward_hidden(tokens_BT, positions_BT, doc_ids_BT, cache)
        if labels_BT is not None:
            return self._loss_sum(h_BTD, labels_BT)
        if self.output is not None:
            return self.output(h_BTD)
        if self.config.tie_embeddings and self.embed_tokens is not None:
            return self._tied_head(h_BTD, self.embed_tokens.weight)
        return h_BTD

    def _tied_head(self, h_BTD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
        # The embedding doubles as the head: no nn.Linear for batch-invariant mode to route.
        if self.config.batch_invariant:
            return batch_invariant.linear(h_BTD, weight_VD)
        return F.linear(h_BTD, weight_VD)

    def _loss_sum(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        head = self.output.weight if self.output is not None else None
        if head is None and self.config.tie_embeddings and self.embed_tokens is not None:
            head = self.embed_tokens.weight
        if head is None:
            raise ValueError("labels_BT given to a model (pipeline stage) without the output head")
        if self.config.loss_impl == "chunked":
            return linear_cross_entropy_sum(h_BTD.flatten(0, 1), head, labels_BT.flatten())
        logits_BTV = self.output(h_BTD) if self.output is not None else self._tied_head(h_BTD, head)
        return cross_entropy_sum(logits_BTV, labels_BT)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialize every parameter in a fixed order; the same generator state gives the same
        weights, also for a model built on ``meta`` and materialized with ``to_empty``.

        Embedding: normal(0, init_std) (small, because a tied embedding is also the head).
        Linears: normal(0, init_std) truncated at 3 std. The residual-branch outputs (o_proj,
        down_proj) use init_std / sqrt(2 * num_layers) so the residual stream's variance does
        not grow with depth (GPT-2). Norm weights: one.
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        if self.embed_tokens is not None:
            nn.init.normal_(self.embed_tokens.weight, std=std, generator=generator)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = residual_std if name.endswith(("o_proj", "down_proj")) else std
                nn.init.trunc_normal_(module.weight, std=s, a=-3 * s, b=3 * s, generator=generator)
            elif isinstance(module, tuple(NORM_IMPLS.values())):
                module.reset_parameters()
