"""Optimizers and the learning-rate schedules.

The trainer holds one ``OptimizerContainer``: several torch optimizers, each over its own
parameters (AdamW over all of them today; Muon for matrices and AdamW for the rest next),
stepped, zeroed, scheduled, clipped and checkpointed as one. ``OPTIMIZERS`` maps
``--optimizer.name`` to the function that splits a model's parameters among optimizers.
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.fields import warn_unused_options
from torchloom.kernels.adamw import adamw_step_
from torchloom.kernels.triton_support import triton
from torchloom.parallel import clip_coefficient, clip_grad_norm_, grad_norm


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """Optimizer, a key of OPTIMIZERS: 'adamw' (AdamW with decoupled weight decay)."""
    lr: float = 3e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon (> 0: it keeps the update finite where a gradient is zero)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms, biases or embeddings)."""
    implementation: Literal["auto", "fused", "triton", "foreach", "for_loop"] = "auto"
    """AdamW kernel: auto takes fused on the GPU and foreach on the CPU; triton (CUDA only) is
    one Triton kernel per parameter that also applies the gradient clip (no pass of its own)."""
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage of the linear layers' weight gradients. bf16 halves their memory (at 8B, 14 GiB):
    each arrives in fp32 from autograd, is rounded to bf16 at once and the fp32 copy freed, so
    only one fp32 gradient exists at a time. Under bf16 compute a linear's weight gradient is a
    bf16 matmul's output, so with one micro-batch a step and each linear applied once a forward
    nothing is lost (bitwise the fp32 run); further micro-batches add into the bf16 sums
    (rounded, as Megatron's bf16 gradient accumulation is). Norms, biases and embeddings keep
    fp32 gradients. Needs the triton implementation, which reads bf16 gradients directly, on
    one GPU without parallelism."""

    def validate(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"Unknown --optimizer.name {self.name!r}.{did_you_mean(self.name, OPTIMIZERS)} "
                f"Available: {', '.join(sorted(OPTIMIZERS))}."
            )
        if not 0 < self.lr < math.inf:  # nan too
            raise ConfigError(f"--optimizer.lr must be a positive number; got {self.lr}.")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError("--optimizer.beta1 and --optimizer.beta2 must lie in [0, 1).")
        if not 0 < self.eps < math.inf:  # 0 divides 0 by 0 where a gradient is zero
            raise ConfigError(
                f"--optimizer.eps must be a number > 0 (1e-8 is usual); got {self.eps}."
            )
        if self.grad_dtype == "bf16" and self.implementation != "triton":
            raise ConfigError(
                "--optimizer.grad_dtype bf16 needs --optimizer.implementation triton (its kernel "
                "reads bf16 gradients into the fp32 update; torch's AdamW wants fp32 ones)."
            )
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError(
                f"--optimizer.weight_decay must be a number >= 0 (0: no decay); got "
                f"{self.weight_decay}."
            )


@dataclass
class LRScheduleConfig:
    warmup_steps: int = 10
    """Linear warm-up from 0 to the peak learning rate over this many steps."""
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape after warm-up: cosine or linear to min_lr_ratio, WSD (constant then linear decay
    over the last decay_fraction of the run), or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, linear and wsd)."""
    decay_fraction: float = 0.2
    """WSD only: fraction of all steps spent decaying at the end."""

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError("--lr_schedule.warmup_steps must be >= 0.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("--lr_schedule.min_lr_ratio must lie in [0, 1].")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError("--lr_schedule.decay_fraction must lie in (0, 1].")
        if self.decay != "wsd":
            warn_unused_options(self, "lr_schedule", ("decay_fraction",), "--lr_schedule.decay wsd")
        if self.decay == "constant":
            until = "--lr_schedule.decay is cosine, linear or wsd"
            warn_unused_options(self, "lr_schedule", ("min_lr_ratio",), until)


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device: torch.device
) -> OptimizerContainer:
    """The container of the optimizers ``--optimizer.name`` splits the model's trainable
    parameters among."""
    return OptimizerContainer(OPTIMIZERS[cfg.name](model, cfg, device))


def _adamw(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> list[Optimizer]:
    """AdamW over every trainable parameter, decaying only matrices that are not embeddings."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if impl == "triton":
        if device.type != "cuda" or triton is None:
            raise ConfigError(
                "--optimizer.implementation triton runs Triton kernels on a CUDA GPU (with "
                "Triton installed); elsewhere use auto."
            )
        bf16_grads = linear_weights(model) if cfg.grad_dtype == "bf16" else []
        return [TritonAdamW(groups, **hyper, bf16_grads=bf16_grads)]
    return [torch.optim.AdamW(groups, **hyper, fused=impl == "fused", foreach=impl == "foreach")]


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimizerConfig, torch.device], list[Optimizer]]] = {
    "adamw": _adamw,
}
"""``--optimizer.name`` -> a function splitting a model's parameters among optimizers."""


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weights of ``model``'s linear layers (float8 ones included), less any
    shared with an embedding (a tied output head): the gradients ``--optimizer.grad_dtype``
    stores in bf16."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return [w for i, w in weights.items() if w.requires_grad and i not in embeddings]


def _adamw_state_bytes(model: nn.Module, cfg: OptimizerConfig) -> int:
    """exp_avg and exp_avg_sq shaped like each trainable parameter's local shard, in its dtype,
    and a float32 step count per parameter (torch's AdamW and TritonAdamW alike)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(2 * _local(p).numel() * p.element_size() + 4 for p in params)


OPTIMIZER_STATE_BYTES: dict[str, Callable[[nn.Module, OptimizerConfig], int]] = {
    "adamw": _adamw_state_bytes,
}
"""``--optimizer.name`` -> the bytes of state its optimizers keep on this rank for a model (its
parameters may be meta tensors): what ``torchloom train --dry-run`` reports without building
the optimizer. Per model rather than per parameter, so an optimizer that splits parameters
(Muon for matrices, AdamW for the rest) counts them the way its builder splits them."""


class OptimizerContainer(Optimizer):
    """Several optimizers that the trainer, the lr schedule, clipping and checkpoints see as
    one. Its ``param_groups`` and ``state`` are read from its optimizers each time (loading a
    checkpoint gives an optimizer new group dicts), so a schedule that sets a group's lr sets
    it where the optimizer reads it."""

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self.optimizers: list[Optimizer] = []  # Optimizer.__init__ below sees no groups yet
        params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
        super().__init__(params, {})  # the hooks and bookkeeping torch's schedulers expect
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for o in self.optimizers for group in o.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        pass  # Optimizer.__init__ assigns its own list; the optimizers' groups are the truth

    @property
    def state(self) -> ChainMap:
        return ChainMap(*(o.state for o in self.optimizers))

    @state.setter
    def state(self, value: Any) -> None:
        pass

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(state)


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (the same hyper-parameters, state and checkpoints) stepped by one Triton
    kernel per parameter (kernels/adamw.py), which also multiplies each gradient by
    ``grad_scale`` when it is set: the trainer puts the clip coefficient there
    (``clip_coefficient``) instead of scaling every gradient in a pass of its own, as
    ``torch.amp.GradScaler`` hands fused optimizers its ``grad_scale``. ``step`` consumes it.

    The step counts live on the parameters' device and the learning rate may be a device
    tensor, so a CUDA graph can capture the step; the state_dict is torch's (a step count loaded
    onto the CPU moves to the device at the next step), so either optimizer resumes the other's
    checkpoint. DTensor parameters (FSDP) are updated through their local shards: the update is
    elementwise.
    """

    def __init__(self, params, bf16_grads: Iterable[nn.Parameter] = (), **hyper) -> None:
        """``bf16_grads``: parameters whose gradients are kept in bf16 (``Bf16Gradients``)."""
        super().__init__(params, **hyper, foreach=False, fused=False)
        self.grad_scale: torch.Tensor | None = None
        bf16_grads = list(bf16_grads)
        self.bf16_grads = Bf16Gradients(bf16_grads) if bf16_grads else None

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s gradient as this optimizer reads it (fp32, or held in bf16)."""
        if param.grad is not None or self.bf16_grads is None:
            return param.grad
        return self.bf16_grads.held.get(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.bf16_grads is not None:
            self.bf16_grads.clear(set_to_none)
        self.grad_scale = None  # it belonged to the gradients just dropped

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, self.grad_scale = self.grad_scale, None
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("TritonAdamW supports neither amsgrad nor maximize")
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for param in group["params"]:
                grad = self.gradient(param)
                if grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                if state["step"].device != param.device:  # loaded from a torch checkpoint
                    state["step"] = state["step"].to(param.device, torch.float32)
                params.append(_local(param))
                grads.append(_local(grad))
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            adamw_step_(
                params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], beta1=beta1,
                beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                grad_scale=grad_scale,
            )  # fmt: skip
        return loss


class Bf16Gradients:
    """Gradients kept in bf16 for fp32 parameters (``--optimizer.grad_dtype bf16``). torch
    holds a parameter's ``.grad`` in the parameter's dtype, so they live here instead: a hook
    after autograd accumulates each parameter's fp32 gradient rounds it into ``held`` and drops
    ``.grad``, which frees the fp32 copy before the next parameter's arrives. A later
    micro-batch's gradient adds into the held one (in bf16). ``.grad`` stays None for these
    parameters: readers ask the optimizer (``TritonAdamW.gradient``)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        for param in params:
            if isinstance(param, DTensor) or param.dtype != torch.float32:
                raise ConfigError(
                    "--optimizer.grad_dtype bf16 keeps bf16 gradients of fp32 parameters on one "
                    f"device; this model has a {param.dtype} {type(param).__name__} weight (data, "
                    "tensor or expert parallelism, or a bf16 model). Leave grad_dtype at fp32."
                )
        self.held: dict[nn.Parameter, torch.Tensor] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hold) for p in params]

    def _hold(self, param: nn.Parameter) -> None:
        grad, param.grad = param.grad, None
        held = self.held.get(param)
        if held is None:
            self.held[param] = grad.to(torch.bfloat16)
        else:
            held.add_(grad)

    def clear(self, set_to_none: bool = True) -> None:
        if set_to_none:
            self.held = {}
        else:
            for held in self.held.values():
                held.zero_()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_gradients(
    optimizer: Optimizer,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip the gradients' global norm to ``max_norm`` for ``optimizer``'s next step and return
    the norm before clipping. When every optimizer is a ``TritonAdamW`` the clip is their
    ``grad_scale`` (their kernel applies it, and the norm is summed by the Triton kernel);
    otherwise every gradient is scaled in place (``clip_grad_norm_``)."""
    optimizers = getattr(optimizer, "optimizers", [optimizer])
    if all(isinstance(o, TritonAdamW) for o in optimizers):
        grads = [g for p in parameters if (g := _gradient(optimizers, p)) is not None]
        norm = grad_norm(grads=grads, pp_mesh=pp_mesh, triton_kernel=True)
        scale = clip_coefficient(norm, max_norm)
        for o in optimizers:
            o.grad_scale = scale
        return norm
    return clip_grad_norm_(parameters, max_norm, pp_mesh=pp_mesh)


def _gradient(optimizers: list[TritonAdamW], param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s gradient as the optimizer stepping it reads it."""
    for optimizer in optimizers:
        if (grad := optimizer.gradient(param)) is not None:
            return grad
    return None


def lr_multiplier(step: int, total_steps: int, cfg: LRScheduleConfig) -> float:
    """Learning-rate factor (of the peak) for optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    floor = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        start = total_steps - decay_steps
        if step < start:
            return 1.0
        return 1.0 - (1.0 - floor) * min(1.0, (step - start + 1) / decay_steps)
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps + 1) / span)
    if cfg.decay == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Float32LambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose rates are float32 values. A CUDA-graph step (train/cuda_graph.py) reads
    its rate from a float32 tensor; rounding every run's rates alike keeps captured and eager
    steps bitwise equal (the change is below 1e-7 relative)."""

    def get_lr(self) -> list[float]:
        return self.rates()

    def rates(self) -> list[float]:
        """Each group's float32 rate at the current step (``last_epoch``)."""
        return [float(np.float32(base * rate(self.last_epoch)))
                for rate, base in zip(self.lr_lambdas, self.base_lrs, strict=True)]  # fmt: skip


def build_lr_scheduler(
    optimizer: Optimizer, cfg: LRScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (so its state saves and restores) following ``lr_multiplier``, in float32."""
    return _Float32LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))


# The param-group settings a resume takes from this run's flags, not from the checkpoint.
_GROUP_FLAGS = {"weight_decay": "--optimizer.weight_decay", "eps": "--optimizer.eps",
                "betas": "--optimizer.beta1/beta2", "momentum": "--optimizer.momentum"}  # fmt: skip


class ResumedSettings:
    """What a resume must not take from the checkpoint. Loading an optimizer restores its
    param groups' settings (weight decay, betas, eps), and loading a LambdaLR its base rates,
    so flags changed for the resumed run would be dropped without a word, and the first resumed
    step would run at the old schedule's rate. Captured from the freshly built optimizer and
    schedule before the load; ``reapply`` after it puts this run's settings back (the optimizer
    state's moments stay the checkpoint's), sets each group's rate from this run's schedule at
    the resumed step, and returns what changed. A resume with the same flags changes nothing
    (the same float32 rates)."""

    def __init__(self, optimizers: list[Optimizer], scheduler: _Float32LambdaLR | None) -> None:
        """``optimizers``: those whose state is loaded (none when it is excluded); ``scheduler``:
        the schedule, when its state is loaded."""
        self.optimizers, self.scheduler = optimizers, scheduler
        self._groups = [[{k: v for k, v in g.items() if k in _GROUP_FLAGS} for g in o.param_groups]
                        for o in optimizers]  # fmt: skip
        self._base_lrs = list(scheduler.base_lrs) if scheduler is not None else None

    def reapply(self) -> list[str]:
        changed: dict[str, str] = {}
        for optimizer, fresh_groups in zip(self.optimizers, self._groups, strict=True):
            for group, fresh in zip(optimizer.param_groups, fresh_groups, strict=True):
                for key, value in fresh.items():
                    if group.get(key) != value:
                        changed.setdefault(_GROUP_FLAGS[key], f"{group.get(key)} -> {value}")
                        group[key] = value
        scheduler = self.scheduler
        if scheduler is None:
            return [f"{flag} {change}" for flag, change in changed.items()]
        if scheduler.base_lrs != self._base_lrs:
            changed["--optimizer.lr"] = f"{scheduler.base_lrs[0]:.4g} -> {self._base_lrs[0]:.4g}"
            scheduler.base_lrs = list(self._base_lrs)
        groups, rates = scheduler.optimizer.param_groups, scheduler.rates()
        moved = any(g["lr"] != r for g, r in zip(groups, rates, strict=True))
        if moved and "--optimizer.lr" not in changed:
            changed["the schedule's rate (--training.steps, --lr_schedule.*)"] = (
                f"{groups[0]['lr']:.4g} -> {rates[0]:.4g}"
            )
        for group, rate, base in zip(groups, rates, scheduler.base_lrs, strict=True):
            group["lr"], group["initial_lr"] = rate, base
        scheduler._last_lr = rates
        return [f"{flag} {change}" for flag, change in changed.items()]
