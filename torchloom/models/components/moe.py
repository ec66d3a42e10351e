"""Mixture-of-experts feed-forward (the ``moe`` FFN kind): a router picks ``top_k`` of
``num_experts`` SwiGLU experts per token, optional shared experts see every token.

Routing (``Router``), as DeepSeek-V3 and Qwen3-MoE define it:

- scores s = softmax(x W_r^T), sigmoid(x W_r^T) or sqrt(softplus(x W_r^T)) (DeepSeek-V4), in
  fp32;
- hash routing (``hash_routing``, DeepSeek-V4's first layers): the experts are a fixed
  token -> experts table (``tid2eid``, a buffer loaded from the checkpoint), not the scores'
  top-k; the scores still weight them;
- the experts are chosen by s + b, where b is a per-expert bias used for the choice only
  (auxiliary-loss-free balancing; ``expert_bias``), optionally limited to the ``top_groups``
  best of ``num_groups`` expert groups (a group scores the sum of its two best experts);
- the chosen experts' weights are their s, optionally divided by their sum
  (``normalize_top_k``), times ``route_scale``.

Dropless: every (token, expert) pair is computed. The pairs are sorted by expert without a
host synchronisation (argsort, counts by scatter-add), run through the experts as grouped
matrix products (kernels/grouped_mm.py), and put back in token order; each token's output is
the weighted sum over its k experts in a fixed order. Where the sorted pairs go is the
dispatcher's job (``LocalDispatch`` here; expert parallelism swaps in one that sends pairs to the
ranks that hold their experts).

Balancing: the tokens each expert received are counted in ``tokens_per_expert`` during training
forwards; after each optimizer step the trainer sums them over the data ranks, moves the bias
b_i by ``bias_update_rate * sign(mean load - load_i)`` (DeepSeek-V3) and logs the loads. The
optional balance loss (``balance_loss``) is DeepSeek-V3's: coef * sum_i f_i P_i with
f_i = E / (k T) * (tokens sent to i) and P_i the mean over the T tokens of i's score normalised
to sum 1 per token, per sequence ("sequence") or over the micro-batch ("batch"); it is reported
to the objective as the auxiliary term ``balance``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from torchloom.config.errors import ConfigError
from torchloom.kernels import batch_invariant
from torchloom.kernels.grouped_mm import grouped_linear, reads_group_ends_on_host
from torchloom.models.components.mlp import MLP_IMPLS, SwiGLU
from torchloom.models.components.param_init import ParamInit, local_tensor


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's routing and experts (a family config's ``moe`` field)."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Routed experts each token goes to."""
    expert_dim: int = 64
    """Hidden width of each expert's SwiGLU."""
    num_shared_experts: int = 0
    """Experts every token goes through, as one SwiGLU of width ``shared_dim``."""
    shared_expert_dim: int = 0
    """The shared expert's width when it is not a multiple of expert_dim (Qwen3-Next's
    shared_expert_intermediate_size may be any size); needs num_shared_experts 1. 0: the
    shared experts are num_shared_experts * expert_dim wide."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x w_g), a learned per-token gate (Qwen2-MoE,
    Qwen3-Next); needs shared experts."""
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    """How router logits become scores (sqrtsoftplus: sqrt(softplus(logit)), DeepSeek-V4)."""
    hash_routing: bool = False
    """Choose each token's experts by a fixed table from its token id (``Router.tid2eid``
    [vocab, top_k], a buffer a checkpoint provides; DeepSeek-V4's hash-routed first layers);
    the MoE's forward then needs the token ids."""
    swiglu_limit: float = 0.0
    """Clamp the experts' (and shared experts') gate below this and up into [-limit, limit]
    before the SwiGLU (DeepSeek-V4: 10); 0: no clamp."""
    num_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3's n_group; 1: no groups)."""
    top_groups: int = 1
    """Groups a token may choose experts from (topk_group)."""
    normalize_top_k: bool = False
    """Divide the chosen experts' scores by their sum (norm_topk_prob)."""
    route_scale: float = 1.0
    """Multiply the routing weights by this (routed_scaling_factor)."""
    expert_bias: bool = False
    """A per-expert bias added to the scores when choosing experts, not to their weights
    (auxiliary-loss-free balancing; DeepSeek-V3's e_score_correction_bias). A buffer, saved in
    checkpoints."""
    bias_update_rate: float = 0.0
    """After every optimizer step, bias_i += rate * sign(mean load - load_i) (DeepSeek-V3 uses
    0.001); 0 keeps the bias fixed. Needs expert_bias."""
    balance_loss: Literal["none", "sequence", "batch"] = "none"
    """Auxiliary balance loss per sequence (DeepSeek-V3's complementary loss) or over the
    micro-batch; 'none' for none."""
    balance_loss_coef: float = 0.0
    """Weight of the balance loss (DeepSeek-V3: 0.0001)."""

    @property
    def shared_dim(self) -> int:
        """The shared experts' SwiGLU width (0: no shared experts)."""
        if not self.num_shared_experts:
            return 0
        return self.shared_expert_dim or self.num_shared_experts * self.expert_dim

    def validate(self) -> None:
        for name in ("num_experts", "top_k", "expert_dim", "num_groups", "top_groups"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model moe.{name} must be positive, got {getattr(self, name)}.")
        if self.num_shared_experts < 0:
            raise ConfigError(
                f"model moe.num_shared_experts must be >= 0, got {self.num_shared_experts}."
            )
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ConfigError("model moe.shared_expert_gate needs moe.num_shared_experts >= 1.")
        if self.shared_expert_dim < 0 or (self.shared_expert_dim and self.num_shared_experts != 1):
            raise ConfigError(
                f"model moe.shared_expert_dim ({self.shared_expert_dim}) must be >= 0 and sets the "
                "width of one shared expert: set moe.num_shared_experts 1 (it is "
                f"{self.num_shared_experts}), or shared_expert_dim 0."
            )
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"model moe.top_k ({self.top_k}) exceeds moe.num_experts ({self.num_experts})."
            )
        if self.num_experts % self.num_groups:
            raise ConfigError(
                f"model moe.num_groups ({self.num_groups}) must divide moe.num_experts "
                f"({self.num_experts})."
            )
        if self.top_groups > self.num_groups:
            raise ConfigError(
                f"model moe.top_groups ({self.top_groups}) exceeds moe.num_groups "
                f"({self.num_groups})."
            )
        per_group = self.num_experts // self.num_groups
        if self.top_k > self.top_groups * per_group:
            raise ConfigError(
                f"model moe.top_k ({self.top_k}) exceeds the experts of the top_groups "
                f"({self.top_groups} x {per_group}); raise moe.top_groups."
            )
        if self.score_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ConfigError(
                "model moe.score_func must be 'softmax', 'sigmoid' or 'sqrtsoftplus', got "
                f"{self.score_func!r}."
            )
        if self.swiglu_limit < 0:
            raise ConfigError(f"model moe.swiglu_limit must be >= 0, got {self.swiglu_limit}.")
        if not 0 < self.route_scale < math.inf:  # 0 would give the experts no gradient; nan too
            raise ConfigError(
                f"model moe.route_scale must be a finite number > 0 (1.0: the scores as they "
                f"are), got {self.route_scale}."
            )
        if self.bias_update_rate < 0 or (self.bias_update_rate and not self.expert_bias):
            raise ConfigError(
                "model moe.bias_update_rate must be >= 0 and needs moe.expert_bias true, got "
                f"rate {self.bias_update_rate} with expert_bias {self.expert_bias}."
            )
        if self.balance_loss not in ("none", "sequence", "batch"):
            raise ConfigError(
                "model moe.balance_loss must be 'none', 'sequence' or 'batch', got "
                f"{self.balance_loss!r}."
            )
        if self.balance_loss_coef < 0 or (self.balance_loss != "none") != (
            self.balance_loss_coef > 0
        ):
            raise ConfigError(
                "model moe.balance_loss and moe.balance_loss_coef go together: a loss kind "
                "('sequence' or 'batch') with a positive coef, or 'none' with coef 0; got "
                f"{self.balance_loss!r} with coef {self.balance_loss_coef}."
            )


class Router(nn.Module):
    """Top-k routing: ``forward(x_ND, tokens_N=None) -> (weights_NK fp32, experts_NK, scores_NE
    fp32)``. ``logit_scale`` multiplies the router's logits before the scores (Muse Spark's).
    With ``cfg.hash_routing`` the experts come from ``tid2eid[tokens_N]`` (``vocab_size`` rows)."""

    def __init__(
        self, dim: int, cfg: MoEConfig, invariant: bool = False, logit_scale: float = 1.0,
        vocab_size: int = 0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.cfg, self.invariant, self.logit_scale = cfg, invariant, logit_scale
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))
        self.expert_bias: torch.Tensor | None
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        else:
            self.expert_bias = None
        self.tid2eid: torch.Tensor | None
        if cfg.hash_routing:
            if vocab_size <= 0:
                raise ValueError("hash routing needs the vocabulary size for its token table")
            self.register_buffer("tid2eid", torch.zeros(vocab_size, cfg.top_k, dtype=torch.int64))
        else:
            self.tid2eid = None

    def forward(
        self, x_ND: torch.Tensor, tokens_N: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self.invariant:  # every token's scores and choice computed alike, whatever the batch
            logits_NE = batch_invariant.linear(x_ND.float(), self.weight.float())
            logits_NE = logits_NE * self.logit_scale
            scores_NE = _invariant_scores(logits_NE, cfg.score_func)
        else:
            logits_NE = F.linear(x_ND.float(), self.weight.float())
            if self.logit_scale != 1.0:
                logits_NE = logits_NE * self.logit_scale
            scores_NE = _scores(logits_NE, cfg.score_func)
        if self.tid2eid is not None:
            if tokens_N is None:
                raise ValueError("a hash-routed MoE layer needs the token ids: mlp(x, tokens_BT)")
            experts_NK = self.tid2eid[tokens_N]
            weights_NK = scores_NE.gather(-1, experts_NK)
            if cfg.normalize_top_k:
                weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + 1e-20)
            return weights_NK * cfg.route_scale, experts_NK, scores_NE
        choice_NE = scores_NE if self.expert_bias is None else scores_NE + self.expert_bias.float()
        if cfg.num_groups > 1:
            choice_NE = _limit_to_groups(choice_NE, cfg.num_groups, cfg.top_groups)
        experts_NK = choice_NE.topk(cfg.top_k, dim=-1).indices
        weights_NK = scores_NE.gather(-1, experts_NK)
        if cfg.normalize_top_k:
            weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + 1e-20)
        return weights_NK * cfg.route_scale, experts_NK, scores_NE


def _scores(logits_NE: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "softmax":
        return logits_NE.softmax(-1)
    if score_func == "sqrtsoftplus":
        return F.softplus(logits_NE).sqrt()
    return logits_NE.sigmoid()


def _invariant_scores(logits_NE: torch.Tensor, score_func: str) -> torch.Tensor:
    """softmax / sigmoid with the exponentials through ``pointwise`` and fixed-order sums."""
    if score_func == "sigmoid":
        return batch_invariant.pointwise(torch.sigmoid, logits_NE)
    if score_func == "sqrtsoftplus":
        return batch_invariant.pointwise(lambda x: F.softplus(x).sqrt(), logits_NE)
    shifted = logits_NE - logits_NE.max(-1, keepdim=True).values
    exp_NE = batch_invariant.pointwise(torch.exp, shifted)
    return exp_NE / batch_invariant.fixed_order_sum(exp_NE)[:, None]


def _limit_to_groups(choice_NE: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """``choice_NE`` with the experts outside each token's ``keep`` best groups at -inf; a
    group's score is the sum of its two best experts (one, for one-expert groups)."""
    N, E = choice_NE.shape
    grouped_NGe = choice_NE.view(N, groups, E // groups)
    best = min(2, E // groups)
    group_scores_NG = grouped_NGe.topk(best, dim=-1).values.sum(-1)
    kept_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool)
    kept_NG.scatter_(1, group_scores_NG.topk(keep, dim=-1).indices, True)
    return grouped_NGe.masked_fill(~kept_NG[..., None], float("-inf")).view(N, E)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLUs stored as stacked weights: gate_proj and up_proj
    [experts, expert_dim, dim], down_proj [experts, dim, expert_dim] (each expert's slice laid
    out as an nn.Linear weight)."""

    def __init__(
        self, dim: int, cfg: MoEConfig, impl: str = "torch", invariant: bool = False
    ) -> None:
        super().__init__()
        experts, width = cfg.num_experts, cfg.expert_dim
        self.gate_proj = nn.Parameter(torch.empty(experts, width, dim))
        self.up_proj = nn.Parameter(torch.empty(experts, width, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, width))
        self.gated = clamped_gate(MLP_IMPLS[impl], cfg.swiglu_limit)
        self.invariant = invariant

    def forward(self, x_MD: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
        """Rows of ``x_MD`` sorted by expert, expert e's ending at ``ends_E[e]`` (this rank's
        experts: under expert parallelism a shard of the stack)."""
        gate, up, down = (_own_experts(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        gate_MI = grouped_linear(x_MD, gate, ends_E, self.invariant)
        up_MI = grouped_linear(x_MD, up, ends_E, self.invariant)
        return grouped_linear(self.gated(gate_MI, up_MI), down, ends_E, self.invariant)

    def reads_group_ends_on_host(self, dtype: torch.dtype) -> bool:
        """Whether a forward on rows of ``dtype`` reads its group ends on the host (the loop of
        kernels/grouped_mm.py), which no CUDA graph can capture."""
        weight = _own_experts(self.gate_proj)
        return reads_group_ends_on_host(dtype, weight, self.invariant)

    def init_weights(self, init: ParamInit, std: float, out_std: float) -> None:
        init.trunc_normal_(self.gate_proj, std)
        init.trunc_normal_(self.up_proj, std)
        init.trunc_normal_(self.down_proj, out_std)


def clamped_gate(
    gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], limit: float
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``gated`` with gate clamped below ``limit`` and up into [-limit, limit] (DeepSeek-V4's
    swiglu_limit); ``gated`` itself when limit is 0."""
    if not limit:
        return gated

    def limited(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gated(gate.clamp(max=limit), up.clamp(min=-limit, max=limit))

    return limited


def experts_reading_the_host(
    model: nn.Module, dtype: torch.dtype
) -> tuple[str, GroupedExperts] | None:
    """The first experts module of ``model`` (name, module) whose forward in ``dtype`` reads its
    group ends on the host, which no CUDA graph can capture; None if there is none."""
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.reads_group_ends_on_host(dtype):
            return name, module
    return None


def _own_experts(weight_EOD: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds: under expert parallelism the stack is a DTensor split by
    experts (parallel/expert_parallel.py), and the dispatcher hands over rows for these only."""
    return weight_EOD.to_local() if isinstance(weight_EOD, DTensor) else weight_EOD


class LocalDispatch:
    """(token, expert) pairs to the experts of this rank (all of them) and back, in order.

    ``dispatch`` returns the pairs' inputs sorted by expert, where each expert's rows end, and
    what ``combine`` needs to put the outputs back; neither synchronises with the host. Both
    moves are gathers by a permutation whose gradients are gathers too (``_SortRows``,
    ``permute_rows``): no scatter-add with atomics, so the backward is as fast as the forward
    and deterministic."""

    def dispatch(
        self, x_ND: torch.Tensor, experts_NK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(x_MD: M = N * k rows sorted by expert, ends_E int32, (order, inverse) of the sort:
        sorted row i is pair order[i] = token * k + choice, pair p is sorted row inverse[p])."""
        K = experts_NK.shape[1]
        flat = experts_NK.reshape(-1)
        order = flat.argsort(stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        x_MD = _SortRows.apply(x_ND, order, inverse, K)
        return x_MD, _ends(flat, num_experts), (order, inverse)

    def combine(
        self, y_MD: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor], N: int
    ) -> torch.Tensor:
        """[N, k, D]: the expert outputs back in (token, choice) order."""
        order, inverse = route
        return permute_rows(y_MD, inverse, order).view(N, -1, y_MD.shape[-1])


class _SortRows(torch.autograd.Function):
    """x_ND's rows for the sorted pairs (row order[i] // k); the gradient gathers each token's
    k pair gradients back (by ``inverse``) and sums them in fp32."""

    @staticmethod
    def forward(ctx, x_ND, order, inverse, K: int):
        ctx.save_for_backward(inverse)
        ctx.K = K
        return x_ND.index_select(0, order // K)

    @staticmethod
    def backward(ctx, grad_MD):
        (inverse,) = ctx.saved_tensors
        grad_NKD = grad_MD.index_select(0, inverse).view(-1, ctx.K, grad_MD.shape[-1])
        return grad_NKD.sum(1, dtype=torch.float32).to(grad_MD.dtype), None, None, None


def permute_rows(x_MD: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x_MD[index]`` for a permutation ``index`` whose inverse is ``inverse``; the gradient
    is the gather ``grad[inverse]`` (autograd's own would be a scatter-add with atomics)."""
    return _PermuteRows.apply(x_MD, index, inverse)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, index, inverse):
        ctx.save_for_backward(inverse)
        return x_MD.index_select(0, index)

    @staticmethod
    def backward(ctx, grad_MD):
        (inverse,) = ctx.saved_tensors
        return grad_MD.index_select(0, inverse), None, None


def _ends(flat_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 cumulative pair counts per expert, computed on the device."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_experts.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
    return counts.cumsum(0).to(torch.int32)


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of a dense feed-forward: ``forward(x_BTD)``.

    Layers report their balance loss through ``pop_auxiliary_losses`` and their load through
    ``take_load`` / ``update_bias`` (train/step.py's expert balancing)."""

    def __init__(
        self,
        dim: int,
        cfg: MoEConfig,
        impl: str = "torch",
        invariant: bool = False,
        init_std: float = 0.02,
        out_std: float | None = None,
        vocab_size: int = 0,
    ) -> None:
        """``vocab_size``: the rows of a hash-routed layer's token table (cfg.hash_routing)."""
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg, invariant, vocab_size=vocab_size)
        self.experts = GroupedExperts(dim, cfg, impl, invariant)
        self.shared_experts: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(dim, cfg.shared_dim, impl, init_std, out_std)
            self.shared_experts.gated = clamped_gate(self.shared_experts.gated, cfg.swiglu_limit)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        self.dispatcher = LocalDispatch()
        """Where the (token, expert) pairs go: ``dispatch(x_ND, experts_NK, num_experts) ->
        (x_MD sorted by expert, ends_E, state)`` and ``combine(y_MD, state, N) -> y_NKD``;
        expert parallelism installs its all-to-all one (parallel/expert_parallel.py)."""
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sums per-sequence statistics over the ranks holding other tokens of the same
        sequences (sequence or context parallelism install it), so the balance loss sees whole
        sequences; None: this rank holds whole sequences."""
        self.invariant = invariant
        self.init_std, self.out_std = init_std, init_std if out_std is None else out_std
        # int64: counts stay exact whatever dtype the model is cast to.
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False
        )
        self._auxiliary: dict[str, torch.Tensor] = {}

    def forward(self, x_BTD: torch.Tensor, tokens_BT: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens_BT``: the token ids, which a hash-routed layer routes by (others ignore it)."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        tokens_N = None if tokens_BT is None else tokens_BT.reshape(-1)
        weights_NK, experts_NK, scores_NE = self.router(x_ND, tokens_N)
        if self.training:
            self._record(experts_NK, scores_NE, B)
        x_MD, ends_E, order = self.dispatcher.dispatch(x_ND, experts_NK, self.cfg.num_experts)
        y_NKD = self.dispatcher.combine(self.experts(x_MD, ends_E), order, x_ND.shape[0])
        # Weighted in the compute dtype (autograd keeps one [N, k, D] copy), summed in fp32.
        weighted_NKD = y_NKD * weights_NK[..., None].to(y_NKD.dtype)
        if self.invariant:
            y_ND = batch_invariant.fixed_order_sum(weighted_NKD.float().transpose(1, 2))
        else:
            y_ND = weighted_NKD.sum(1, dtype=torch.float32)
        # A fresh [B, T, D] tensor, not a view: FSDP2 warns on a view out of a module it wraps
        # alone (the MoE under tensor or expert parallelism). With a compute dtype below fp32
        # this copy is the cast of the fp32 sum, no extra pass.
        y_BTD = y_ND.view(B, T, D).to(y_NKD.dtype, copy=True)
        if self.shared_experts is not None:
            shared_ND = self.shared_experts(x_ND)
            if self.shared_expert_gate is not None:
                gate_N1 = self.shared_expert_gate(x_ND)
                if self.invariant:
                    gate_N1 = batch_invariant.pointwise(torch.sigmoid, gate_N1)
                else:
                    gate_N1 = torch.sigmoid(gate_N1)
                shared_ND = gate_N1 * shared_ND
            y_BTD = y_BTD + shared_ND.view(B, T, D)
        return y_BTD

    def _record(self, experts_NK: torch.Tensor, scores_NE: torch.Tensor, rows: int) -> None:
        """Count this training forward's tokens per expert and keep its balance loss; a
        recomputation in the backward computes the same ops (so checkpointing finds what it
        saved) but neither counts nor reports again."""
        cfg, first = self.cfg, _first_pass()
        if first:
            with torch.no_grad():
                flat = experts_NK.reshape(-1)
                self.tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        if cfg.balance_loss != "none" and torch.is_grad_enabled():
            groups = rows if cfg.balance_loss == "sequence" else 1
            term = cfg.balance_loss_coef * balance_loss(
                scores_NE, experts_NK, groups, self.sequence_sum
            )
            if first:
                self._auxiliary = {"balance": term}

    def pop_auxiliary_losses(self) -> dict[str, torch.Tensor]:
        """The balance loss of the last training forward, handed over once."""
        terms, self._auxiliary = self._auxiliary, {}
        return terms

    @torch.no_grad()
    def take_load(self) -> torch.Tensor:
        """Tokens each expert received since the last call (this rank's), and reset."""
        load = self.tokens_per_expert.clone()
        self.tokens_per_expert.zero_()
        return load

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: move the choice bias toward the under-loaded experts,
        from ``load_E``, the tokens per expert over the whole step (all data ranks)."""
        bias, rate = self.router.expert_bias, self.cfg.bias_update_rate
        if bias is None or not rate:
            return
        load_E = load_E.float()
        bias += rate * torch.sign(load_E.mean() - load_E)

    def init_weights(self, init: ParamInit) -> None:
        """Router normal(0, init_std); experts and shared experts as SwiGLU (down at out_std);
        the choice bias at zero."""
        init.normal_(self.router.weight, self.init_std)
        self.experts.init_weights(init, self.init_std, self.out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init)
        if self.shared_expert_gate is not None:
            init.normal_(self.shared_expert_gate.weight, self.init_std)
        if self.router.expert_bias is not None:
            local_tensor(self.router.expert_bias).zero_()
        if self.router.tid2eid is not None:  # a checkpoint's table replaces this balanced one
            table = local_tensor(self.router.tid2eid)
            vocab, k = table.shape
            rows = torch.arange(vocab, device=table.device)[:, None] * k
            table.copy_((rows + torch.arange(k, device=table.device)) % self.cfg.num_experts)
        local_tensor(self.tokens_per_expert).zero_()

    def check_tp(self, tp: int) -> None:
        """Any tp degree: under tensor parallelism the layer is not split (see tp_plan)."""

    def tp_plan(self, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """Under sequence parallelism each tp rank routes its own tokens (its part of every
        sequence) through the whole layer, as a data rank would: no all-gather, and the layer's
        weights are data-parallel over tp too (their gradients summed there; parallel/mesh.py
        ``MoEMeshes``). Without it (generation) every rank computes the replicated stream."""
        if not sequence_parallel:
            return {}
        # The norm before hands over a sequence-sharded DTensor; the residual stream is local.
        local = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        return {"": local}

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token on the weights a token uses: the router, its top_k experts
        and the shared experts, 6 per weight (2 forward, 4 backward)."""
        cfg = self.cfg
        dim = self.router.weight.shape[1]
        active = cfg.num_experts * dim + cfg.top_k * 3 * cfg.expert_dim * dim
        if self.shared_experts is not None:
            active += self.shared_experts.flops_per_token(seq_len) // 6
        if self.shared_expert_gate is not None:
            active += dim
        return 6 * active


def balance_loss(
    scores_NE: torch.Tensor,
    experts_NK: torch.Tensor,
    groups: int,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_i f_i P_i averaged over ``groups`` equal runs of tokens (sequences; 1: all), with
    f_i = E / (k T) * (pairs routed to i) and P_i the mean normalised score of i over the run's
    T tokens (see the module docstring). Uncoefficiented. ``sequence_sum``: see
    ``MoE.sequence_sum`` (the runs' counts, score sums and lengths summed over ranks)."""
    N, E = scores_NE.shape
    K = experts_NK.shape[1]
    T = N // groups
    probs_GTE = (scores_NE / scores_NE.sum(-1, keepdim=True)).view(groups, T, E)
    flat_GM = experts_NK.reshape(groups, T * K)
    counts_GE = torch.zeros(groups, E, device=scores_NE.device)
    counts_GE.scatter_add_(1, flat_GM, torch.ones_like(flat_GM, dtype=counts_GE.dtype))
    if sequence_sum is None:
        f_GE = counts_GE * (E / (K * T))
        return (f_GE * probs_GTE.mean(1)).sum(-1).mean()
    tokens_G1 = counts_GE.new_full((groups, 1), T)
    summed = sequence_sum(torch.cat([counts_GE, probs_GTE.sum(1), tokens_G1], dim=1))
    counts_GE, prob_sums_GE, tokens_G1 = summed.split([E, E, 1], dim=1)
    f_GE = counts_GE * E / (K * tokens_G1)
    return (f_GE * prob_sums_GE / tokens_G1).sum(-1).mean()


def _first_pass() -> bool:
    """False while the backward pass recomputes a checkpointed forward (so a token is counted
    once); compiled regions replay their side effects once, so they always count."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._current_graph_task_id() == -1
