"""The decoder every family builds on: token embedding, one block per layer index (its token
mixer and feed-forward chosen by the config's layer specs), final norm and output head.

A family's config subclasses ``DecoderConfig`` with its own fields and ``layer_specs``; the
kinds a spec names are built by ``MIXERS`` / ``FFNS`` from that config and the layer index. The
model returns logits, or its final hidden states handed to an ``objective`` (a loss component,
train/loss.py) inside the forward, so the head's weights are where data parallelism gathered
them and one loss path serves every layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.kernels import batch_invariant
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask
from torchloom.kernels.float8 import FLOAT8_RECIPES
from torchloom.models.components.attention import (
    ATTENTION_BACKENDS,
    Attention,
    LayerCache,
    shared_attention_input,
)
from torchloom.models.components.cache import ModelCache
from torchloom.models.components.kda import KimiDeltaAttention
from torchloom.models.components.linear_attention import GatedDeltaNet
from torchloom.models.components.mla import MultiHeadLatentAttention, mla_softmax_scale
from torchloom.models.components.mlp import MLP_IMPLS, SwiGLU
from torchloom.models.components.moe import MoE
from torchloom.models.components.norms import NORM_IMPLS
from torchloom.models.components.param_init import ParamInit
from torchloom.models.components.rope import ROPE_IMPLS, RotaryEmbedding


@dataclass(frozen=True)
class LayerSpec:
    """What one layer is made of."""

    mixer: str
    """Token mixer, a key of MIXERS ('attention': grouped-query attention with RoPE; 'mla':
    multi-head latent attention; 'gated_attention': Qwen3-Next's gated attention;
    'gated_deltanet': Gated DeltaNet linear attention; 'kda': Kimi Delta Attention)."""
    ffn: str
    """Feed-forward, a key of FFNS ('swiglu')."""


@dataclass(frozen=True)
class DecoderConfig:
    """The fields every decoder family has; a family's config subclasses it with its own.

    The protocol the rest of torchloom relies on: ``validate``, ``num_params``,
    ``flops_per_token`` (on active parameters), ``layer_specs`` and ``build``. Sizes describe
    the architecture; the component slots (attn_backend ... float8) say how a run computes it.
    """

    vocab_size: int = 4096
    """Number of token ids (rows of the embedding, columns of the output head)."""
    dim: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of blocks."""
    norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm."""
    max_seq_len: int = 2048
    """Longest sequence the flavor is meant for."""
    tie_embeddings: bool = False
    """Use the embedding matrix as the output head (no separate `output` weight)."""
    init_std: float = 0.02
    """Standard deviation of the initial weights (each module's init_weights says how)."""
    attn_backend: str = "sdpa"
    """Attention kernel, a key of ATTENTION_BACKENDS ('sdpa', 'flex', 'fa4')."""
    norm_impl: str = "torch"
    """RMSNorm implementation, a key of NORM_IMPLS: 'torch' (PyTorch reference) or 'triton'
    (fused kernels on CUDA, the reference elsewhere)."""
    rope_impl: str = "torch"
    """How RoPE rotates q and k, a key of ROPE_IMPLS: 'torch' or 'triton' (as norm_impl)."""
    mlp_impl: str = "torch"
    """The SwiGLU gate silu(gate) * up, a key of MLP_IMPLS: 'torch' or 'triton' (as norm_impl)."""
    batch_invariant: bool = False
    """Fixed-order (batch-invariant) linears, attention, norms and gate: a token's numbers do
    not depend on its batch or on prefill vs decode (torchloom/kernels/batch_invariant.py)."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 training of the blocks' linears with torchao (torchloom/kernels/float8.py):
    'tensorwise' or 'rowwise' scaling; 'none' keeps them in the compute dtype."""

    def layer_specs(self) -> list[LayerSpec]:
        """One spec per layer index."""
        raise NotImplementedError(f"{type(self).__name__} must define layer_specs()")

    def layer_kinds(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The mixer and feed-forward kinds this family's blocks can build (default: the shared
        ``MIXERS`` and ``FFNS``; a family with blocks of its own names its kinds)."""
        return MIXERS, FFNS

    def rotary(self) -> RotaryEmbedding | None:
        """The RoPE tables the model computes once per forward for its layers (None: none)."""
        return None

    def make_norm(self, dim: int) -> nn.Module:
        """An RMSNorm over ``dim`` channels as this architecture defines it (the blocks' and
        the final norm), computed by the ``norm_impl`` kernel."""
        return NORM_IMPLS[self.norm_impl](dim, self.norm_eps)

    def make_final_norm(self) -> nn.Module:
        """The norm after the last block (default: ``make_norm(dim)``, as the blocks')."""
        return self.make_norm(self.dim)

    def make_post_norm(self, dim: int, slot: Literal["attention", "mlp"]) -> nn.Module | None:
        """The norm on the ``slot`` branch's output before it joins the residual stream
        (sandwich norms: Gemma 2, Muse); None (the default): the branch joins unnormed."""
        return None

    def make_residual(self, dim: int, slot: Literal["attention", "mlp"]) -> nn.Module | None:
        """How the ``slot`` branch joins the residual stream: a module ``(residual, branch) ->
        stream`` (Muse Spark's learned gate); None (the default): residual + branch."""
        return None

    def attention_mask(self, layer: int) -> AttentionMask:
        """Which keys layer ``layer``'s queries see (kernels/attention_mask.py); the default:
        causal, same-document. Interleaved sliding/global layers (Gemma, Qwen3's layer_types,
        Muse) return a window per layer."""
        return CAUSAL

    def make_embedding_norm(self) -> nn.Module | None:
        """A norm on the token embeddings before the first block (Muse); None: none."""
        return None

    def logit_softcap(self) -> tuple[float, float] | None:
        """(scale, cap): the head's logits become cap * tanh(logits * scale / cap) (Gemma 2's
        soft-cap with Muse's scale); None (the default): the head's logits as they are."""
        return None

    def build(self) -> nn.Module:
        """The family's model for this config, on the current default device (built on meta
        and materialized by the caller for anything large)."""
        return Decoder(self)

    def validate(self) -> None:
        """Raise ConfigError naming the first impossible setting and how to fix it."""
        _check_finite(self)
        for name in ("vocab_size", "dim", "num_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}.")
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
        specs = self.layer_specs()
        if len(specs) != self.num_layers:
            raise ConfigError(
                f"layer_specs() gives {len(specs)} layers for num_layers {self.num_layers}."
            )
        mixers, ffns = self.layer_kinds()
        for index, spec in enumerate(specs):
            for kind, registry, what in ((spec.mixer, mixers, "mixer"), (spec.ffn, ffns, "ffn")):
                if kind not in registry:
                    raise ConfigError(
                        f"layer {index}: unknown {what} kind {kind!r}.{did_you_mean(kind, registry)}"
                        f" Available: {', '.join(sorted(registry))}."
                    )

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the built model (tied embeddings counted once).

        ``include_embedding=False`` leaves out the vocabulary matrices (the embedding and, when
        untied, the output head): the "non-embedding" count of scaling-law papers.
        """
        model = _meta_model(self)
        total = sum(p.numel() for p in model.parameters())
        if not include_embedding:
            total -= self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) for sequences of ``seq_len`` tokens,
        on the parameters a token actually uses: each layer's modules count their own
        (``flops_per_token`` of Attention, SwiGLU, ...), plus 6 * dim * vocab for the head
        (counted even when tied; the embedding lookup is not a matmul). MFU uses this."""
        return _meta_model(self).flops_per_token(seq_len)


def check_token_ids(tokens_BT: Any, vocab_size: int) -> None:
    """TypeError / ValueError, naming what a model call takes, for ids that are not a
    [batch, seq] integer tensor, that are empty, or (on the CPU, where looking costs no device
    sync) that lie outside [0, vocab_size): the embedding's own errors name none of it, and on a
    GPU an id out of range is a device-side assert."""
    if not isinstance(tokens_BT, torch.Tensor):
        raise TypeError(
            f"the model takes token ids as a [batch, seq] integer tensor, got a "
            f"{type(tokens_BT).__name__}; e.g. torch.tensor([ids])."
        )
    if tokens_BT.dim() != 2 or tokens_BT.is_floating_point() or tokens_BT.is_complex():
        raise ValueError(
            f"the model takes token ids as a [batch, seq] integer tensor, got shape "
            f"{list(tokens_BT.shape)} of {tokens_BT.dtype}"
            + ("; add the batch dim: ids[None]." if tokens_BT.dim() == 1 else ".")
        )
    if tokens_BT.numel() == 0:
        raise ValueError(f"the model got no tokens (ids of shape {list(tokens_BT.shape)}).")
    if tokens_BT.device.type == "cpu" and not is_fake(tokens_BT):  # a dry run's probe: no data
        low, high = tokens_BT.min().item(), tokens_BT.max().item()
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"token id {low if low < 0 else high} is outside the model's vocabulary "
                f"[0, {vocab_size}); check the tokenizer matches the model."
            )


def _check_finite(config: Any, prefix: str = "") -> None:
    """ConfigError for a NaN or infinite number anywhere in ``config`` (a field, a nested
    config's, an element of a tuple): a NaN epsilon or RoPE base passes every '> 0' check and
    the model then computes NaN or quietly wrong logits."""
    for f in dataclasses.fields(config):
        value, name = getattr(config, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_finite(value, name + ".")
            continue
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"model {name} must be a finite number, got {value}.")


@functools.cache
def _meta_model(config: DecoderConfig) -> nn.Module:
    """The model of ``config`` on the meta device: counts read from what is actually built."""
    with torch.device("meta"):
        return config.build()


# -- layer kinds ----------------------------------------------------------------------------


def _attention(cfg: Any, layer: int) -> nn.Module:
    return Attention(
        cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, qk_norm=cfg.qk_norm,
        norm_eps=cfg.norm_eps, backend=cfg.attn_backend, norm_impl=cfg.norm_impl,
        rope_impl=cfg.rope_impl, init_std=cfg.init_std, out_std=_residual_std(cfg),
        mask=cfg.attention_mask(layer),
    )  # fmt: skip


def _mla(cfg: Any, layer: int) -> nn.Module:
    return MultiHeadLatentAttention(
        cfg.dim, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim, cfg.v_head_dim, mla_softmax_scale(cfg.qk_head_dim, cfg.rope),
        rope_interleave=cfg.rope_interleave, norm_eps=cfg.latent_norm_eps,
        backend=cfg.attn_backend, norm_impl=cfg.norm_impl, rope_impl=cfg.rope_impl,
        init_std=cfg.init_std, out_std=_residual_std(cfg), mask=cfg.attention_mask(layer),
    )  # fmt: skip


def _kda(cfg: Any, layer: int) -> nn.Module:
    return KimiDeltaAttention(
        cfg.dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size, norm_eps=cfg.norm_eps,
        init_std=cfg.init_std, out_std=_residual_std(cfg), invariant=cfg.batch_invariant,
    )  # fmt: skip


def _gated_attention(cfg: Any, layer: int) -> nn.Module:
    """Qwen3-Next's full attention: output gate, partial RoPE, q/k norms of the config's kind."""
    return Attention(
        cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qk_norm=True,
        norm_eps=cfg.norm_eps, backend=cfg.attn_backend, norm_impl=cfg.norm_impl,
        rope_impl=cfg.rope_impl, init_std=cfg.init_std, out_std=_residual_std(cfg),
        output_gate=True, rotary_dim=cfg.rotary_dim, make_norm=cfg.make_norm,
        mask=cfg.attention_mask(layer),
    )  # fmt: skip


def _gated_deltanet(cfg: Any, layer: int) -> nn.Module:
    return GatedDeltaNet(
        cfg.dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
        cfg.linear_value_head_dim, cfg.linear_conv_kernel, cfg.norm_eps,
        fused_projections=cfg.linear_fused_projections, init_std=cfg.init_std,
        out_std=_residual_std(cfg), invariant=cfg.batch_invariant,
    )  # fmt: skip


def _swiglu(cfg: Any, layer: int) -> nn.Module:
    return SwiGLU(
        cfg.dim, cfg.ffn_dim, impl=cfg.mlp_impl, init_std=cfg.init_std, out_std=_residual_std(cfg)
    )


def _moe(cfg: Any, layer: int) -> nn.Module:
    return MoE(
        cfg.dim, cfg.moe, impl=cfg.mlp_impl, invariant=cfg.batch_invariant,
        init_std=cfg.init_std, out_std=_residual_std(cfg),
    )  # fmt: skip


def _residual_std(cfg: DecoderConfig) -> float:
    """The std of a residual branch's output projection: init_std / sqrt(2 * num_layers), so
    the residual stream's variance does not grow with depth (GPT-2)."""
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


MIXERS: dict[str, Callable[[Any, int], nn.Module]] = {
    "attention": _attention, "mla": _mla, "kda": _kda, "gated_attention": _gated_attention,
    "gated_deltanet": _gated_deltanet,
}  # fmt: skip
"""Token-mixer kinds: ``build(config, layer_index) -> module`` taking
``(x_BTD, cos_BTd, sin_BTd, documents, cache=None)``, with ``init_weights(ParamInit)``,
``flops_per_token(seq_len)`` and ``new_state(slots, max_len, device, dtype)`` (its generation
state: models/components/cache.py)."""
FFNS: dict[str, Callable[[Any, int], nn.Module]] = {"swiglu": _swiglu, "moe": _moe}
"""Feed-forward kinds: ``build(config, layer_index) -> module`` taking ``x_BTD``, with
``init_weights(ParamInit)`` and ``flops_per_token(seq_len)`` (on the weights a token uses).
'moe' reads the config's ``moe`` field (models/components/moe.py)."""
MOE_FFNS: set[str] = {"moe"}
"""The FFNS kinds that are routed mixtures of experts with learned routing (``MoE`` layers): a
family adding one adds its name here too. The trainer's expert balancing (choice-bias updates,
load metrics), expert parallelism's checks and the pipeline's MoE meshes find the layers of a
model, on every pipeline stage alike, from its config's layer specs by these names."""


class Objective(Protocol):
    """A loss component (train/loss.py): what the model's forward returns when given one."""

    def __call__(
        self, h_BTD: torch.Tensor, model: Decoder, targets: dict[str, torch.Tensor]
    ) -> Any: ...


class LayerInputs(NamedTuple):
    """What a block takes besides the hidden state (``Decoder.layer_inputs``)."""

    cos_BTd: torch.Tensor | None
    sin_BTd: torch.Tensor | None
    documents: Any
    """doc_ids_BT, or what the attention kernel builds from them once (flex's BlockMasks,
    one per distinct layer mask)."""


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then h + ffn(norm(h)). The slots keep the
    names ``attention`` and ``mlp`` whatever their kind, so checkpoints and plans read alike.

    A config may add, per branch, a post-norm on the branch's output (``attention_post_norm``,
    ``mlp_post_norm``: sandwich norms) and a module joining it to the residual stream in place
    of the sum (``attention_residual``, ``mlp_residual``); absent by default, so the blocks of
    other families hold exactly the four slots above."""

    def __init__(self, cfg: DecoderConfig, index: int, spec: LayerSpec) -> None:
        super().__init__()
        self.attention_norm = cfg.make_norm(cfg.dim)
        self.attention = MIXERS[spec.mixer](cfg, index)
        self.mlp_norm = cfg.make_norm(cfg.dim)
        self.mlp = FFNS[spec.ffn](cfg, index)
        for slot in ("attention", "mlp"):
            post_norm = cfg.make_post_norm(cfg.dim, slot)  # type: ignore[arg-type]
            residual = cfg.make_residual(cfg.dim, slot)  # type: ignore[arg-type]
            if post_norm is not None:
                setattr(self, f"{slot}_post_norm", post_norm)
            if residual is not None:
                setattr(self, f"{slot}_residual", residual)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTd: torch.Tensor | None,
        sin_BTd: torch.Tensor | None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        # cache by keyword: tensor-parallel plans describe the four positional inputs.
        branch_BTD = self.attention(
            self.attention_norm(x_BTD), cos_BTd, sin_BTd, doc_ids_BT, cache=cache
        )
        h_BTD = self._join("attention", x_BTD, branch_BTD)
        return self._join("mlp", h_BTD, self.mlp(self.mlp_norm(h_BTD)))

    def _join(self, slot: str, x_BTD: torch.Tensor, branch_BTD: torch.Tensor) -> torch.Tensor:
        """The residual stream after the ``slot`` branch: x + branch, unless the config gave the
        branch a post-norm or a residual module of its own."""
        post_norm = getattr(self, f"{slot}_post_norm", None)
        if post_norm is not None:
            branch_BTD = post_norm(branch_BTD)
        residual = getattr(self, f"{slot}_residual", None)
        return x_BTD + branch_BTD if residual is None else residual(x_BTD, branch_BTD)

    def init_weights(self, init: ParamInit) -> None:
        for module in self.children():
            module.init_weights(init)


class Decoder(nn.Module):
    """Token embedding, ``num_layers`` blocks, final RMSNorm and the output head.

    ``layers`` is a ModuleDict keyed "0", "1", ... so a pipeline stage can delete blocks and keep
    the names of the rest. A stage may also set ``embed_tokens`` (its input is then the hidden
    state), ``norm`` or ``output`` to None. With ``tie_embeddings`` there is no ``output``
    module: the head is ``embed_tokens.weight`` (one parameter, so it survives ``to_empty``;
    data parallelism must shard it in the group that also holds the head's caller, the root).
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.embed_norm = cfg.make_embedding_norm()  # None unless the config has one
        self.softcap = cfg.logit_softcap()
        self.rope = cfg.rotary()
        self.layers = self.build_layers(cfg)
        self.norm: nn.Module | None = cfg.make_final_norm()
        self.output: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._aux_modules: list[nn.Module] | None = None  # found at the first call
        # Tensor parallelism without loss_parallel on a tied head (decoder_plan): the head's
        # matmul gives vocabulary-sharded logits, which logits() gathers into whole rows (a
        # hook on the model's output would miss the logits an objective computes inside it).
        self.gather_tied_logits = False

    def build_layers(self, cfg: DecoderConfig) -> nn.ModuleDict:
        """The blocks, keyed "0", "1", ...: one ``Block`` per layer spec. A family whose blocks
        are its own (deepseek_v4's hyper-connected ones) overrides this."""
        specs = cfg.layer_specs()
        return nn.ModuleDict({str(i): Block(cfg, i, specs[i]) for i in range(len(specs))})

    def forward_hidden(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
        *,
        embeds_BTD: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states h_BTD (after the final norm), before the output head.

        positions_BT defaults to 0..T-1 in every row; pass positions that restart at each
        document together with doc_ids_BT for packed rows. ``cache`` (generation) gives each
        block its layer's generation state; positions are then the tokens' places in their
        sequence. ``embeds_BTD``: the first block's input when the caller made it (a
        multimodal model's embeddings with the image tokens at their placeholders).
        """
        h_BTD = self.embed(tokens_BT) if embeds_BTD is None else embeds_BTD  # checks the ids
        inputs = self.layer_inputs(tokens_BT, positions_BT, doc_ids_BT, cache)
        h_BTD = self.run_blocks(h_BTD, inputs, cache)
        return self.norm(h_BTD) if self.norm is not None else h_BTD

    def embed(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The first block's input: the token embeddings (normed, if the config says), or the
        hidden state itself on a pipeline stage without ``embed_tokens``."""
        if self.embed_tokens is None:
            return tokens_BT
        if not torch.compiler.is_compiling():
            check_token_ids(tokens_BT, self.embed_tokens.num_embeddings)
        h_BTD = self.embed_tokens(tokens_BT)
        return h_BTD if self.embed_norm is None else self.embed_norm(h_BTD)

    def layer_inputs(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        cache: ModelCache | None = None,
    ) -> LayerInputs:
        """What every block takes besides the hidden state, computed once per forward: the
        RoPE tables of the positions and the documents input of the layers' attention kernel."""
        B, T = tokens_BT.shape[:2]
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        cos_BTd = sin_BTd = None
        if self.rope is not None:
            cos_BTd, sin_BTd = self.rope(positions_BT)
        documents = doc_ids_BT  # what the layers' attention takes: ids, or masks built from them
        if cache is None:  # the layers' kernels (context parallelism may have replaced them)
            mixers = [block.attention for block in self.layers.values()]
            documents = shared_attention_input(mixers, doc_ids_BT, T, tokens_BT.device)
        return LayerInputs(cos_BTd, sin_BTd, documents)

    def run_blocks(
        self, h_BTD: torch.Tensor, inputs: LayerInputs, cache: ModelCache | None = None
    ) -> torch.Tensor:
        """The blocks this model (or pipeline stage) holds, in order: the last one's output,
        before the final norm."""
        for name, block in self.layers.items():
            layer_cache = None if cache is None else cache.layer(int(name))
            h_BTD = block(h_BTD, *inputs, cache=layer_cache)
        return h_BTD

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
        """Logits [B, T, vocab] (the hidden state on a pipeline stage without the head). With
        ``objective``, what it computes from the final hidden states, this model and the
        batch fields ``targets`` (a loss; train/loss.py). ``cache``, ``embeds_BTD``: see
        forward_hidden."""
        h_BTD = self.forward_hidden(
            tokens_BT, positions_BT, doc_ids_BT, cache, embeds_BTD=embeds_BTD
        )
        if not self.has_head:
            return h_BTD
        if objective is not None:
            return objective(h_BTD, self, targets or {})
        return self.logits(h_BTD)

    def auxiliary_losses(self) -> dict[str, torch.Tensor]:
        """The auxiliary losses this forward's layers reported (an MoE layer's load-balance
        term), summed by name over layers. A module reports through
        ``pop_auxiliary_losses() -> {name: scalar tensor}``, which hands each term over once."""
        if self._aux_modules is None:
            self._aux_modules = [m for m in self.modules() if hasattr(m, "pop_auxiliary_losses")]
        terms: dict[str, torch.Tensor] = {}
        for module in self._aux_modules:
            for name, value in module.pop_auxiliary_losses().items():
                terms[name] = terms[name] + value if name in terms else value
        return terms

    @property
    def has_head(self) -> bool:
        """Whether this model (or pipeline stage) holds the output head."""
        return self.output is not None or (
            self.config.tie_embeddings and self.embed_tokens is not None and self.norm is not None
        )

    def head_weight(self) -> torch.Tensor:
        """The output head's [vocab, dim] weight (the embedding's when tied)."""
        if self.output is not None:
            return self.output.weight
        if self.config.tie_embeddings and self.embed_tokens is not None:
            return self.embed_tokens.weight
        raise ValueError("this model (a pipeline stage) has no output head")

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The output head applied to final hidden states (then the soft-cap, if any)."""
        if self.output is not None:
            logits_BTV = self.output(h_BTD)
        elif self.config.batch_invariant:
            # The embedding doubles as the head: no nn.Linear for batch-invariant mode to route.
            logits_BTV = batch_invariant.linear(h_BTD, self.head_weight())
        else:
            logits_BTV = F.linear(h_BTD, self.head_weight())
            if self.gather_tied_logits and isinstance(logits_BTV, DTensor):
                logits_BTV = logits_BTV.full_tensor()  # tp without loss_parallel: whole rows
        if self.softcap is None:
            return logits_BTV
        scale, cap = self.softcap
        return torch.tanh(logits_BTV * (scale / cap)) * cap

    def new_cache(
        self, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> ModelCache:
        """Generation state for ``slots`` sequences of up to ``max_len`` tokens: each block's
        token mixer allocates its own kind (KV, latent, recurrent) from its own shapes."""
        states = {
            int(name): block.attention.new_state(slots, max_len, device, dtype)
            for name, block in self.layers.items()
        }
        return ModelCache(states, slots, max_len, device)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the whole model (see DecoderConfig.flops_per_token)."""
        blocks = sum(
            block.attention.flops_per_token(seq_len) + block.mlp.flops_per_token(seq_len)
            for block in self.layers.values()
        )
        return blocks + 6 * self.config.vocab_size * self.config.dim

    @torch.no_grad()
    def init_weights(self, init: ParamInit | int = 0) -> None:
        """Every parameter this model (or pipeline stage) holds, each module its own, from a
        seed (or a ParamInit); the same seed gives the same weights on every layout.

        Embedding: normal(0, init_std) (small, because a tied embedding is also the head).
        Untied head: normal(0, init_std) truncated at 3 std. Blocks: see Block.init_weights.
        """
        if isinstance(init, int):
            init = ParamInit(self, init)
        std = self.config.init_std
        if self.embed_tokens is not None:
            init.normal_(self.embed_tokens.weight, std)
        for block in self.layers.values():
            block.init_weights(init)
        if self.norm is not None:
            self.norm.init_weights(init)
        if self.output is not None:
            init.trunc_normal_(self.output.weight, std)
        init.check_complete(self)
