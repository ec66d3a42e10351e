"""What the GPU micro-benchmarks share: CUDA-event timing and the JSON report (imported as a
sibling module: the scripts run as ``python benchmarks/<name>.py``, which puts this folder on
sys.path)."""

from __future__ import annotations

import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def median_seconds(
    fn: Callable[[], object],
    iters: int,
    warmup: int = 3,
    before: Callable[[], object] | None = None,
    cuda: bool = True,
) -> float:
    """Median time of ``fn`` over ``iters`` calls after ``warmup`` untimed ones (CUDA events;
    with ``cuda`` false, the host clock); ``before``, if given, runs (untimed) ahead of every
    call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if not cuda:
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    if not cuda:
        return statistics.median(times)
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) / 1e3


def ms_per_call(fn: Callable[[], object], count: int) -> float:
    """Milliseconds per call of ``fn`` over ``count`` calls back to back (a CUDA graph's
    replays, say), timed with one pair of CUDA events after a synchronize."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(count):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / count


def write_report(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON at ``path``, with the device, torch version, date and command."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {path}")
