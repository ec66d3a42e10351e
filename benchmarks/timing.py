"""CUDA-event timing shared by the GPU benchmarks (imported as a sibling module: the scripts run
as ``python benchmarks/<name>.py``, which puts this folder on sys.path)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median CUDA-event time of ``fn`` over ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) / 1e3
