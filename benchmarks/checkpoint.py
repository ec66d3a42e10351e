"""Checkpoint save/load cost: blocking vs write time of each save mode, throughput, host memory.

For each model shape it builds the llama3 model on the device with its optimizer state, then
for each mode saves twice through the trainer's CheckpointManager while training steps run
(forward + backward on one sequence; the "optimizer step" waits for an async_pinned save's
staging, as the trainer does), and loads the last checkpoint back (page cache dropped first
when the OS lets us). One table, JSON to --json.

    python benchmarks/checkpoint.py --shapes 1B 8B --dir /local/disk/ckpt_bench    # one GPU
    python benchmarks/checkpoint.py --shapes small --device cpu --dir /tmp/ckpt_bench

Shapes: small (llama3 dim 512, 8 layers, ~41M params: fp32 weights + fp32 AdamW), 1B (fp32
weights + fp32 AdamW state, as the trainer keeps master weights), 8B (bf16 weights + fp32
AdamW state). "sync, 1 thread" is PyTorch's default DCP writer (one thread per rank), the
baseline the others are compared with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.checkpoint.manager import CheckpointManager
from torchloom.checkpoint.stateful import ModelState, OptimizerState
from torchloom.checkpoint.storage import ParallelRead
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.remat import RematConfig, apply_remat

SHAPES = {
    "small": ("debug", {"dim": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                        "ffn_dim": 1536, "vocab_size": 32000}, torch.float32),
    "1B": ("1B", {}, torch.float32),
    "8B": ("8B", {}, torch.bfloat16),
}  # fmt: skip
MODES = [("sync, 1 thread", "sync", 1), ("sync", "sync", 8), ("async", "async", 8),
         ("async_pinned", "async_pinned", 8)]  # fmt: skip


class _Loader:  # the data loader's part of the state, which the benchmark does not exercise
    def state_dict(self) -> dict:
        return {"step": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class RssPeak:
    """Peak resident host memory of this process while active (sampled every 20 ms)."""

    def __enter__(self) -> RssPeak:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def build(shape: str, device: torch.device):
    flavor, overrides, dtype = SHAPES[shape]
    config = resolve_model_config(ModelConfig(name="llama3", flavor=flavor, overrides=overrides))
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    model.init_weights(0)
    model.to(dtype)
    apply_remat(model.layers, RematConfig(mode="full"), compile_enabled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # fp32 moments, whatever the weights' dtype
        optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(p.shape, device=device),
            "exp_avg_sq": torch.rand(p.shape, device=device),
        }
    return model, optimizer, config


def train_step(model, config, device, manager: CheckpointManager | None) -> None:
    tokens = torch.randint(0, config.vocab_size, (1, min(4096, config.max_seq_len)), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        model(tokens).float().logsumexp(-1).mean().backward()
    if manager is not None:
        manager.wait_for_staging()
    with torch.no_grad():  # stands in for the optimizer: the weights change after each step
        torch._foreach_add_(
            list(model.parameters()), [p.grad for p in model.parameters()], alpha=-1e-9
        )
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_shape(
    shape: str, device: torch.device, root: Path, modes: list[str], saves: int, no_load: bool
) -> list[dict]:
    model, optimizer, config = build(shape, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes += sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
    )
    train_step(model, config, device, None)  # warm-up
    step_times = []
    for _ in range(3):
        start = time.perf_counter()
        train_step(model, config, device, None)
        step_times.append(time.perf_counter() - start)
    step_s = statistics.median(step_times)
    print(f"{shape}: {config.num_params() / 1e9:.2f}B params, state {state_bytes / 1e9:.1f} GB, "
          f"training step (fwd+bwd, 1 x 4096 tokens) {step_s:.2f} s", flush=True)  # fmt: skip
    rows = []
    for label, mode, threads in MODES:
        if label not in modes:
            continue
        folder = root / f"{shape}_{mode}_{threads}"
        shutil.rmtree(folder, ignore_errors=True)
        config_ = CheckpointConfig(interval=1, mode=mode, folder=str(folder), writer_threads=threads,
                                   keep_latest_k=1)  # fmt: skip
        parts = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
                 "lr_scheduler": scheduler, "dataloader": _Loader()}  # fmt: skip
        make = lambda c, parts=parts: CheckpointManager(  # noqa: E731
            c, root, parts=parts, device=device, marker_extra={}, is_rank0=True
        )
        manager = make(config_)
        manager.resume()
        records = []
        with RssPeak() as rss:
            for save in range(1, saves + 1):
                manager.storage.remove(save - 1)  # the disk holds one checkpoint at a time
                manager.save(save, 0)
                steps = 0
                while manager.saving:
                    train_step(model, config, device, manager)
                    steps += 1
                records += manager.poll() or manager.finish()
        cold = load = False
        if not no_load:
            cold = _drop_page_cache()
            loader_manager = make(CheckpointConfig(resume=True, folder=str(folder)))
            loader_manager.resume()
            load = loader_manager.load_seconds
        on_disk = sum(f.stat().st_size for f in (folder / f"step-{saves}").iterdir())
        last = records[-1]
        row = {
            "shape": shape, "mode": label, "writer_threads": threads,
            "state_gb": round(state_bytes / 1e9, 2), "disk_gb": round(on_disk / 1e9, 2),
            "step_s": round(step_s, 3),
            "blocking_s": [r["ckpt_blocking_s"] for r in records],
            "write_s": [r["ckpt_write_s"] for r in records],
            "write_gb_per_s": round(on_disk / 1e9 / last["ckpt_write_s"], 2),
            "load_s": round(load, 2) if load else None,
            "load_gb_per_s": round(on_disk / 1e9 / load, 2) if load else None,
            "load_cold": cold,
            "host_rss_peak_gb": round((rss.peak - rss.base) / 1e9, 2),
        }  # fmt: skip
        rows.append(row)
        print(f"  {label:<16} blocking {row['blocking_s']} s, write {row['write_s']} s "
              f"({row['write_gb_per_s']} GB/s), load {row['load_s']} s ({row['load_gb_per_s']} "
              f"GB/s{', cold' if cold else ', page cache warm'}), host RSS +"
              f"{row['host_rss_peak_gb']} GB", flush=True)  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["small"], choices=list(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", type=Path, default=Path("outputs/ckpt_bench"))
    parser.add_argument("--modes", nargs="+", default=[m[0] for m in MODES],
                        choices=[m[0] for m in MODES])  # fmt: skip
    parser.add_argument(
        "--saves",
        type=int,
        default=2,
        help="saves per mode (the first async_pinned one allocates the pinned buffers)",
    )
    parser.add_argument("--json", type=Path, default=Path("outputs/checkpoint_bench.json"))
    parser.add_argument("--no-load", action="store_true", help="skip the load measurement")
    parser.add_argument("--read-threads", type=int, default=ParallelRead.read_threads,
                        help="threads each rank reads its checkpoint files with")  # fmt: skip
    args = parser.parse_args()
    ParallelRead.read_threads = args.read_threads
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes:
        rows += bench_shape(shape, device, args.dir, args.modes, args.saves, args.no_load)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    print(f"\n{'shape':<6} {'mode':<16} {'blocking s':>11} {'write s':>8} {'GB/s':>6} "
          f"{'load s':>7} {'load GB/s':>9} {'blocking vs sync':>17}")  # fmt: skip
    for row in rows:
        base = next((r for r in rows if r["shape"] == row["shape"] and r["mode"] == "sync"), row)
        ratio = row["blocking_s"][-1] / base["blocking_s"][-1]
        print(f"{row['shape']:<6} {row['mode']:<16} {row['blocking_s'][-1]:>11.3f} "
              f"{row['write_s'][-1]:>8.2f} {row['write_gb_per_s']:>6.2f} {row['load_s'] or 0:>7.2f} "
              f"{row['load_gb_per_s'] or 0:>9.2f} {100 * ratio:>16.2f}%")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                     "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
