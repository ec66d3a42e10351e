"""What a step cost: throughput, FLOPs, MFU, memory, data wait; to console, JSONL, TensorBoard."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchloom.config.errors import ConfigError


@dataclass
class MetricsConfig:
    log_interval: int = 1
    """Log every this many steps (the first and last step are always logged)."""
    tensorboard: bool = True
    """Also write TensorBoard events under <output_dir>/tb."""
    progress_bar: bool = True
    """Show a progress bar with ETA on the console (only when it is a terminal)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for MFU; 0 looks the device up in the built-in table."""

    def validate(self) -> None:
        if self.log_interval < 1:
            raise ConfigError("--metrics.log_interval must be at least 1.")
        if not (math.isfinite(self.peak_tflops) and self.peak_tflops >= 0):
            raise ConfigError(
                f"--metrics.peak_tflops must be a finite number >= 0 (0 looks the device up); got "
                f"{self.peak_tflops}."
            )


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets.
_PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def device_peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float | None, str]:
    """(peak TFLOP/s or None, device name). None means MFU cannot be stated honestly."""
    if device.type != "cuda":
        import platform

        return (override or None), f"CPU ({platform.processor() or platform.machine()})"
    name = torch.cuda.get_device_name(device)
    if override:
        return override, name
    for key, peak in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return peak, name
    return None, name


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory of this process: CUDA allocator peak, or max RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepWindow:
    """The wall time and data wait per step over the steps since the last ``take()``, timed
    between host syncs: the host queues steps ahead of the GPU and waits for it only at some
    (``synced()``), so a step's own wall time is not known, only a window's. Time between
    ``synced()`` and the next ``begin()`` (validation, a save, writing a trace) is left out."""

    def __init__(self) -> None:
        self.seconds = self.data_seconds = 0.0
        self.steps = 0
        self._since: float | None = None

    def begin(self) -> None:
        """A step starts; the clock runs from here unless it runs already."""
        if self._since is None:
            self._since = time.perf_counter()

    def add_step(self, data_seconds: float) -> None:
        self.steps += 1
        self.data_seconds += data_seconds

    def synced(self) -> None:
        """The host has waited for every step queued so far: stop the clock."""
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def take(self) -> tuple[float, float]:
        """(seconds, data-wait seconds) per step since the last take; after ``synced()``."""
        steps = max(self.steps, 1)
        per_step = (self.seconds / steps, self.data_seconds / steps)
        self.seconds = self.data_seconds = 0.0
        self.steps = 0
        return per_step


class MetricsLogger:
    """Writes one record per logged step to metrics.jsonl, TensorBoard and the console."""

    def __init__(
        self,
        output_dir: Path,
        cfg: MetricsConfig,
        total_steps: int,
        device: torch.device,
        flops_per_token: float,
        enabled: bool = True,
    ) -> None:
        self.cfg = cfg
        self.total_steps = total_steps
        self.device = device
        self.flops_per_token = flops_per_token
        self.enabled = enabled
        self.peak_tflops, self.device_name = device_peak_tflops(device, cfg.peak_tflops)
        self._jsonl = None
        self._tb = None
        self._progress = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (output_dir / "metrics.jsonl").open("a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(output_dir / "tb"))
        if cfg.progress_bar and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps, status="")
            self._progress.start()

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text, highlight=False)
        else:
            print(text, flush=True)

    def should_log(self, step: int) -> bool:
        return step == 1 or step == self.total_steps or step % self.cfg.log_interval == 0

    def step_record(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        step_seconds: float,
        data_seconds: float,
        num_devices: int = 1,
        media_flops: float = 0.0,
    ) -> dict[str, Any]:
        """The metrics of one optimizer step; tps/tflops/mfu are per device. ``media_flops``:
        the step's media encoders' FLOPs summed over every rank's micro-batches (the vision
        encoder's, per image grid), added to the text's ``flops_per_token * tokens``."""
        tps = tokens / step_seconds / num_devices
        media_tflops = media_flops / step_seconds / num_devices / 1e12
        tflops = tps * self.flops_per_token / 1e12 + media_tflops
        optional = {"media_tflops": media_tflops} if media_flops else {}
        if self.device.type == "cuda":  # what the allocator holds: tensors and its cache
            optional["mem_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tps": tps,
            "tflops": tflops,
            "mfu": (100.0 * tflops / self.peak_tflops) if self.peak_tflops else None,
            **optional,
            "mem_gib": peak_memory_gib(self.device),
            "data_wait_s": data_seconds,
            "step_s": step_seconds,
            "time": time.time(),
        }

    def log(self, record: dict[str, Any]) -> None:
        """Append a record (any keys; ``step`` required) to every sink."""
        if not self.enabled:
            return
        step = record["step"]
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(clean) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        if "tps" in record:
            line = _console_line(record, self.total_steps)
            if self._progress is not None:
                self._progress.update(
                    self._task, completed=step, status=f"loss {record['loss']:.4f}"
                )
            self.print(line)
        else:
            self.print("  ".join(f"{k} {_fmt(v)}" for k, v in record.items() if k != "time"))

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A line that is not a record (the torn last line of a run
    killed mid-write, or cut short by a full disk) is skipped with a warning naming it."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            print(
                f"warning: skipping line {number} of {path}: not a metrics record (a write cut "
                "short by a kill or a full disk)",
                file=sys.stderr,
            )
            continue
        records.append(record)
    return records


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _console_line(r: dict[str, Any], total: int) -> str:
    mfu = f"{r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    rl = f"reward {r['reward_mean']:.3f}  " if "reward_mean" in r else ""  # torchloom rl's steps
    return (
        f"step {r['step']:>{len(str(total))}}/{total}  {rl}loss {r['loss']:.4f}  "
        f"grad {r['grad_norm']:.3f}  lr {r['lr']:.2e}  {r['tps']:,.0f} tok/s  "
        f"{r['tflops']:.2f} TFLOP/s  mfu {mfu}  mem {r['mem_gib']:.2f} GiB  "
        f"data {1000 * r['data_wait_s']:.1f} ms"
    )
