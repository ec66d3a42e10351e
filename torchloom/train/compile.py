"""Regional compilation: ``torch.compile`` on chosen modules (each transformer block by
default), the rest eager.

A region's ``forward`` is replaced by its compiled version in place, so module and parameter
names do not change (unlike wrapping in ``torch.compile(module)``, which adds ``_orig_mod``),
and hooks that FSDP registers on the module run eagerly around the compiled code. Identical
blocks share one compiled graph: parameters are graph inputs, not constants.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.fields import warn_unused_options
from torchloom.train.remat import recomputing

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_COMMON_BACKENDS = ("inductor", "aot_eager", "eager")
_BACKEND_PACKAGES = {"tvm": ("tvm", "apache-tvm"), "openxla": ("torch_xla", "torch_xla"),
                     "openxla_eval": ("torch_xla", "torch_xla")}  # fmt: skip
"""Backends torch registers whose package is imported only at the first compile: (module,
what to pip install)."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """Compile the `regions` with torch.compile (the rest of the model stays eager)."""
    regions: list[str] = field(default_factory=lambda: ["Block"])
    """What to compile: module class names (Block, Attention, SwiGLU, RMSNorm, ...) or glob
    patterns over module names (layers.*, norm, output). A module inside a region already
    compiled is not compiled again."""
    backend: str = "inductor"
    """torch.compile backend: inductor (fast code), or aot_eager / eager to debug."""
    fullgraph: bool = True
    """Require each region to compile to one graph (a graph break is an error, not a silent
    slowdown)."""
    mode: str = "default"
    """torch.compile mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs."""

    def validate(self) -> None:
        """Checked whether or not compile is enabled: a typo must not wait for the run that
        turns it on. (Regions are matched against the model when it is compiled.) An option
        set while compile is off is accepted with a warning that it does nothing."""
        if self.mode not in COMPILE_MODES:
            raise ConfigError(
                f"--compile.mode must be one of {', '.join(COMPILE_MODES)}; got {self.mode!r}."
                f"{did_you_mean(self.mode, COMPILE_MODES)}"
            )
        if not self.regions:
            raise ConfigError("--compile.regions is empty; name at least one region, e.g. Block.")
        if self.backend not in _COMMON_BACKENDS:
            import torch._dynamo  # only for a backend out of the ordinary: importing costs 0.5 s

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.backend not in backends:
                raise ConfigError(
                    f"Unknown --compile.backend {self.backend!r}."
                    f"{did_you_mean(self.backend, backends)} Common ones: "
                    f"{', '.join(_COMMON_BACKENDS)}."
                )
            if self.enabled:
                _check_backend_usable(self.backend)
        if not self.enabled:
            options = ("regions", "backend", "fullgraph", "mode")
            warn_unused_options(self, "compile", options, "--compile.enabled true")


def _check_backend_usable(name: str) -> None:
    """ConfigError for a registered backend this environment cannot run: its package is
    missing, or a plugin's entry point fails to load. Nothing is compiled."""
    import importlib.util

    import torch._dynamo

    unusable = f"--compile.backend {name} is registered but cannot run here"
    fix = f"use one of {', '.join(_COMMON_BACKENDS)}"
    if name in _BACKEND_PACKAGES:
        module, package = _BACKEND_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{unusable}: it needs {package} (pip install {package}); or {fix}.")
    try:
        torch._dynamo.lookup_backend(name)  # loads a plugin backend's entry point
    except Exception as err:  # whatever a plugin's import raises
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        raise ConfigError(
            f"{unusable}: loading it failed ({type(err).__name__}: {reason}); {fix}."
        ) from None


def compile_regions(
    model: nn.Module,
    config: CompileConfig,
    eager_types: tuple[str, ...] = (),
    memory_budget: float | None = None,
    graph_break_types: tuple[str, ...] = (),
    recompute_casts: bool = False,
) -> list[str]:
    """Compile ``config.regions`` of ``model`` in place; returns the compiled module names.

    A region holding a module whose class is in ``eager_types`` is not compiled whole: its
    children are, recursively, and the ``eager_types`` modules stay eager. A region holding
    one of ``graph_break_types`` (modules calling kernels Dynamo does not trace, such as fla's)
    is compiled with graph breaks allowed whatever ``config.fullgraph``: the code around those
    kernels is compiled, the kernels run as they are. A region that may break its graph and
    recomputes its activations (apply_remat) has the checkpoint moved outside the compiled
    code: Dynamo runs a compiled checkpoint with a graph break inside all eagerly. ``memory_budget``
    (remat mode budget): the fraction of activation memory the min-cut partitioner keeps when
    it compiles these regions (set for their compilation only, not for the whole process).
    ``recompute_casts`` (``--remat.weight_casts recompute``): inductor's partitioner casts the
    regions' weights again in backward instead of keeping the forward's copies.
    """
    if not config.enabled:
        return []
    modules = dict(model.named_modules())
    class_names = {type(m).__name__ for m in modules.values()}
    for region in config.regions:
        if region not in class_names and not fnmatch.filter(modules, region):
            raise ConfigError(
                f"--compile.regions entry {region!r} matches no module class or name of this "
                f"model.{did_you_mean(region, [*class_names, *modules])} Classes: "
                f"{', '.join(sorted(class_names))}."
            )
    mode = None if config.mode == "default" else config.mode
    compiled: list[str] = []

    def visit(name: str, module: nn.Module, selected: bool) -> None:
        selected = selected or any(
            type(module).__name__ == r or fnmatch.fnmatchcase(name, r) for r in config.regions
        )
        if type(module).__name__ in eager_types:
            return
        has_eager = any(type(m).__name__ in eager_types for m in module.modules())
        if selected and not has_eager:
            breaks = any(type(m).__name__ in graph_break_types for m in module.modules())
            fullgraph = config.fullgraph and not breaks
            forward = module.forward
            # Dynamo runs a checkpointed region with a graph break all eagerly: where breaks
            # are allowed, compile what the checkpoint wraps and checkpoint around that.
            recomputes = None if fullgraph else getattr(forward, "recomputes", None)
            region = torch.compile(
                forward if recomputes is None else recomputes[0],
                backend=config.backend,
                fullgraph=fullgraph,
                mode=mode,
            )
            if memory_budget is not None or recompute_casts:
                region = _partitioned(region, memory_budget, recompute_casts)
            module.forward = region if recomputes is None else recomputing(region, recomputes[1])
            compiled.append(name)
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, selected)

    visit("", model, False)
    return compiled


def _partitioned(
    forward: Callable[..., Any], budget: float | None, recompute_casts: bool
) -> Callable[..., Any]:
    """``forward`` compiled (at its first call, where the forward and backward are split) with
    the partitioner's activation memory budget set to ``budget`` and, with
    ``recompute_casts``, inductor's pass that recomputes casts of the graph's inputs; both
    only for the duration of each call, not for the process."""
    settings: list[tuple[Any, dict[str, Any]]] = []
    if budget is not None:
        settings.append((torch._functorch.config, {"activation_memory_budget": budget}))
    if recompute_casts:
        from torch._inductor import config as inductor

        from torchloom.train.weight_casts import RecomputeInputCasts

        settings.append((inductor, {"joint_custom_pre_pass": RecomputeInputCasts()}))

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for config, values in settings:
                stack.enter_context(config.patch(values))
            return forward(*args, **kwargs)

    return call
