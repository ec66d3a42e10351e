"""Profiling chosen training steps: a torch profiler trace per rank and, on GPUs, a CUDA memory
snapshot, written into the run folder."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchloom.config.errors import ConfigError
from torchloom.config.fields import warn_unused_options
from torchloom.config.paths import check_can_create


@dataclass
class ProfilingConfig:
    steps: list[int] = field(default_factory=list)
    """Training steps to trace with the torch profiler, e.g. [5, 6] (consecutive; empty: no
    trace). Pick steps after the first few: those include compilation and allocator warm-up."""
    folder: str = "profile"
    """Where traces go, relative to --output.dir: trace_rank<r>_steps<a>-<b>.json, viewable in
    https://ui.perfetto.dev or chrome://tracing."""
    record_shapes: bool = True
    """Record operator input shapes (to tell which matmul is which)."""
    with_stack: bool = False
    """Record Python stacks for every operator (larger traces, slower steps)."""
    memory_snapshot: bool = False
    """Also record the CUDA caching allocator's history over the traced steps and write
    memory_snapshot_rank<r>.pickle (open it at https://pytorch.org/memory_viz). GPUs only."""

    def validate(self) -> None:
        steps = sorted(self.steps)
        if steps and (steps[0] < 1 or steps != list(range(steps[0], steps[-1] + 1))):
            raise ConfigError(
                f"--profiling.steps must be consecutive training steps >= 1, e.g. [5, 6]; "
                f"got {self.steps}."
            )
        if not steps:
            options = ("folder", "record_shapes", "with_stack", "memory_snapshot")
            warn_unused_options(
                self, "profiling", options, "--profiling.steps names steps to trace"
            )


class StepProfiler:
    """Starts tracing before the first chosen step and writes the files after the last."""

    def __init__(
        self, config: ProfilingConfig, output_dir: Path, rank: int, device: torch.device
    ) -> None:
        config.validate()
        if config.memory_snapshot and device.type != "cuda":
            raise ConfigError(
                "--profiling.memory_snapshot records the CUDA allocator, which a CPU run does not "
                "use; set it to false (the trace still shows time per operator)."
            )
        self.config = config
        self.folder = Path(output_dir) / config.folder
        if config.steps and self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(
                f"--profiling.folder {config.folder}"
                f"{'' if str(self.folder) == config.folder else f' ({self.folder})'} is a file, "
                "not a folder; choose another path."
            )
        if config.steps and not self.folder.exists():
            check_can_create(self.folder)
        self.rank = rank
        self.device = device
        self.first, self.last = (min(config.steps), max(config.steps)) if config.steps else (0, -1)
        self._profile: profile | None = None
        self.written: list[Path] = []

    def covers(self, step: int) -> bool:
        """Whether ``step`` is traced (the trainer syncs after each, so its time is its own)."""
        return self.first <= step <= self.last

    def step_begins(self, step: int) -> None:
        if step != self.first:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            if self.config.memory_snapshot:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self._profile = profile(
            activities=activities,
            record_shapes=self.config.record_shapes,
            with_stack=self.config.with_stack,
        )
        self._profile.__enter__()

    def step_ends(self, step: int) -> None:
        if step != self.last or self._profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace_rank{self.rank}_steps{self.first}-{self.last}.json"
        self._profile.export_chrome_trace(str(trace))
        self.written.append(trace)
        self._profile = None
        if self.config.memory_snapshot:
            snapshot = self.folder / f"memory_snapshot_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snapshot)


KERNEL_KINDS = (  # (kind, pattern on the kernel's name); the first match wins
    ("attention", r"flash|fmha|attn|attention|cudnn"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|wgmma|matmul|sm90_"),
    ("communication", r"nccl"),
    ("multi_tensor", r"adam|multi_tensor|foreach"),  # AdamW, clipping, foreach copies
    ("triton", r"^triton_|^_\w+_kernel$"),  # inductor's kernels, then torchloom's own
    ("copy", r"memcpy|memset|copy|cat_|fill"),
    ("elementwise", r"elementwise|vectorized|reduce|softmax|norm|index|embedding|scatter|gather"),
)


def kernel_kind(name: str) -> str:
    """A coarse label for a CUDA kernel name: matmul, attention, communication, multi_tensor, copy,
    triton (inductor's and our own kernels), elementwise, or other."""
    lowered = name.lower()
    return next((kind for kind, pat in KERNEL_KINDS if re.search(pat, lowered)), "other")


def kernel_summary(prof: profile, steps: int, wall_s: float, top: int = 16) -> dict:
    """GPU time of a profiled run of ``steps`` steps that took ``wall_s`` seconds: busy time per
    step (the rest of the wall time the GPU waited on the host), time per kernel kind, and the
    ``top`` kernels by time."""
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in kernels)
    kinds: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / steps / 1e3
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {
        "wall_ms_per_step": 1e3 * wall_s / steps, "gpu_busy_ms_per_step": busy_us / 1e3 / steps,
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "ms_per_step_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top": [{"kernel": e.key[:120], "kind": kernel_kind(e.key), "calls_per_step": e.count / steps,
                 "us_per_step": e.self_device_time_total / steps} for e in ranked],
    }  # fmt: skip


def format_kernel_summary(label: str, summary: dict) -> str:
    """kernel_summary as printable lines."""
    kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in summary["ms_per_step_by_kind"].items())
    lines = [
        f"  profile {label}: {summary['wall_ms_per_step']:.3f} ms/step wall, GPU busy "
        f"{summary['gpu_busy_ms_per_step']:.3f} ms, {summary['kernels_per_step']:.0f} kernels/step",
        f"    ms/step by kind: {kinds}",
    ]
    lines += [f"    {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['kernel']}"
              for k in summary["top"]]  # fmt: skip
    return "\n".join(lines)
