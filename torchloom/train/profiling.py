"""Profiling chosen training steps: a torch profiler trace per rank and, on GPUs, a CUDA memory
snapshot, written into the run folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from torchloom.config.errors import ConfigError


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
        self.rank = rank
        self.device = device
        self.first, self.last = (min(config.steps), max(config.steps)) if config.steps else (0, -1)
        self._profile: profile | None = None
        self.written: list[Path] = []

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
