"""Recomputation (activation checkpointing): which activations the backward pass recomputes
instead of keeping from the forward pass, chosen by one config field.

Applied per transformer block, after tensor parallelism and before compile and FSDP, by
wrapping the block's ``forward`` in ``torch.utils.checkpoint`` (non-reentrant). The block keeps
its module and parameter names, so checkpoints and HF exports are unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.fields import warn_unused_options

RematMode = Literal["none", "full", "selective", "every_k", "budget"]
WeightCasts = Literal["keep", "recompute"]

DEFAULT_SAVE_OPS = [
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
]
"""aten ops whose outputs selective recomputation keeps: the matmuls and attention (costly to
redo), so only pointwise work (norms, activations, rotary) is recomputed."""


@dataclass
class RematConfig:
    mode: RematMode = "none"
    """none: keep every activation. full: keep only each block's input, recompute the rest.
    selective: keep the outputs of `save_ops` (matmuls, attention), recompute pointwise ops.
    every_k: full recomputation on every k-th block only. budget: let the compiler choose what
    to recompute to fit `memory_budget` (needs --compile.enabled true)."""
    every_k: int = 2
    """With mode every_k: blocks 0, k, 2k, ... recompute; the others keep their activations."""
    save_ops: list[str] = field(default_factory=lambda: list(DEFAULT_SAVE_OPS))
    """With mode selective: aten op names (e.g. mm, _scaled_dot_product_flash_attention) whose
    outputs are kept; every other op inside a block is recomputed in the backward pass."""
    memory_budget: float = 0.5
    """With mode budget: torch's activation memory budget for each compiled block, in (0, 1]
    (1 recomputes nothing); the compiler's min-cut partitioner picks the ops. It is measured
    between saving only the block's inputs (weights included) and saving everything, so it is
    not a share of the activations: benchmarks/block_memory.py --budgets shows what a block
    keeps at each value (docs/performance.md)."""
    weight_casts: WeightCasts = "keep"
    """Under bf16 autocast over fp32 weights (one GPU without FSDP), what compiled blocks do
    with the bf16 copies of their weights that the forward's matmuls read. keep: the backward
    reuses them, which holds 2 bytes per block parameter from each block's forward until its
    backward. recompute: the backward casts the weights again (one more read of them), and
    that memory is free for activations; needs --compile.enabled true with inductor (refused
    otherwise)."""

    def validate(self) -> None:
        if self.mode not in get_args(RematMode):
            raise ConfigError(
                f"--remat.mode must be one of {', '.join(get_args(RematMode))}; got {self.mode!r}."
            )
        if self.every_k < 1:
            raise ConfigError(f"--remat.every_k must be >= 1; got {self.every_k}.")
        if self.weight_casts not in get_args(WeightCasts):
            raise ConfigError(
                f"--remat.weight_casts must be one of {', '.join(get_args(WeightCasts))}; "
                f"got {self.weight_casts!r}."
            )
        if not 0.0 < self.memory_budget <= 1.0:
            raise ConfigError(f"--remat.memory_budget must be in (0, 1]; got {self.memory_budget}.")
        save_ops(self.save_ops)  # unknown op names are refused here, before any model is built
        for name, mode in (("every_k", "every_k"), ("save_ops", "selective"),
                           ("memory_budget", "budget")):  # fmt: skip
            if self.mode != mode:
                warn_unused_options(self, "remat", (name,), f"--remat.mode {mode}")


def save_ops(names: list[str]) -> set:
    """The aten overload packets behind ``names``; ConfigError for a name aten does not have."""
    ops = set()
    for name in names:
        short = name.removeprefix("aten.").removeprefix("torch.ops.aten.")
        if not hasattr(torch.ops.aten, short):
            raise ConfigError(
                f"--remat.save_ops: unknown aten op {name!r}.{did_you_mean(short, DEFAULT_SAVE_OPS)}"
            )
        ops.add(getattr(torch.ops.aten, short))
    return ops


def _selective_context(ops: set):
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _recompute(module: nn.Module, context_fn=None) -> None:
    """Make ``module``'s forward recompute its activations in backward (names unchanged)."""
    module.forward = recomputing(module.forward, context_fn)


def recomputing(forward: Callable, context_fn=None) -> Callable:
    """``forward`` under activation checkpointing. The wrapper keeps ``forward`` and
    ``context_fn`` (``.recomputes``), so that compile_regions can compile the inner forward
    and checkpoint around it where Dynamo cannot trace the checkpoint: a region with graph
    breaks, which inside a checkpoint make Dynamo run the whole region eagerly."""
    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        # The blocks draw no random numbers (no dropout), so the RNG state need not be kept.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False,
                          **extra, **kwargs)  # fmt: skip

    checkpointed.recomputes = (forward, context_fn)
    return checkpointed


def apply_remat(layers: nn.ModuleDict, config: RematConfig, compile_enabled: bool) -> None:
    """Apply ``config`` to the transformer blocks ``layers`` (keyed by layer index, as in the
    model or a pipeline stage, so every_k picks the same blocks on every layout), in place."""
    config.validate()
    if config.weight_casts == "recompute" and not compile_enabled:
        raise ConfigError(
            "--remat.weight_casts recompute tells the compiler's partitioner to cast the "
            "weights again in backward, so it needs --compile.enabled true; or leave it at keep."
        )
    if config.mode == "budget":
        if not compile_enabled:
            raise ConfigError(
                "--remat.mode budget lets the compiler choose what to recompute, so it needs "
                "--compile.enabled true; or pick full, selective or every_k without compile."
            )
        return  # compile_regions hands each compiled region the budget (memory_budget below)
    if config.mode == "none":
        return
    context_fn = (
        _selective_context(save_ops(config.save_ops)) if config.mode == "selective" else None
    )
    for name, block in layers.items():
        if config.mode != "every_k" or int(name) % config.every_k == 0:
            _recompute(block, context_fn)


def memory_budget(config: RematConfig) -> float | None:
    """The activation-memory budget compiled regions partition with (mode budget), else None."""
    return config.memory_budget if config.mode == "budget" else None


def recompute_weight_casts(config: RematConfig) -> bool:
    """Whether compiled regions recompute their weights' casts (``--remat.weight_casts``)."""
    return config.weight_casts == "recompute"
