"""Multi-GPU scaling of the trainer: one `torchloom train` run per parallel layout, the same
model and tokens per GPU, tokens/s per GPU, MFU and peak memory from each run's metrics.jsonl
(median over the steps after --warmup). One table, JSON to --json.

    python benchmarks/scaling.py --flavor 8B --seq 8192 --layouts 1 fsdp fsdp_tp \\
        --extra --compile.enabled true --remat.mode full                  # 2+ GPUs
    python benchmarks/scaling.py --flavor debug --seq 256 --nproc 2 --device cpu --steps 4 \\
        --warmup 1                                                        # gloo smoke test

Layouts over --nproc processes (default: every visible GPU): 1 (one process, FSDP on one
device: --parallel.fsdp_always), fsdp (--parallel.dp_shard N), fsdp_tp (dp_shard N/2 x tp 2),
hsdp (dp_replicate 2 x dp_shard N/2). Each rank gets --batch sequences per step, so tokens per
GPU are the same in every layout (tensor parallelism: the tp ranks share their sequences, so
tokens per GPU are halved there and the table says so).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

LAYOUTS = {
    "1": lambda n: (1, ["--parallel.fsdp_always", "true"]),
    "fsdp": lambda n: (n, ["--parallel.dp_shard", str(n)]),
    "fsdp_tp": lambda n: (n, ["--parallel.dp_shard", str(n // 2), "--parallel.tp", "2"]),
    "hsdp": lambda n: (n, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", str(n // 2)]),
}


def run_layout(name: str, nproc: int, args: argparse.Namespace, out: Path) -> dict:
    procs, flags = LAYOUTS[name](nproc)
    data_ranks = procs // 2 if name == "fsdp_tp" else procs
    command = [
        "--recipe", "debug", "--model.flavor", args.flavor, "--training.seq_len", str(args.seq),
        "--training.global_batch_size", str(args.batch * data_ranks),
        "--training.steps", str(args.steps), "--lr_schedule.warmup_steps", "2",
        "--data.document_mask", "false", "--training.sample_tokens", "0",
        "--training.val_sequences", str(data_ranks), "--checkpoint.save_final_model", "false",
        "--checkpoint.export_hf", "false", "--metrics.tensorboard", "false",
        "--training.device", args.device, "--output.dir", str(out), "--output.overwrite", "true",
        "--model.overrides", json.dumps({"max_seq_len": max(args.seq, 256)}), *flags, *args.extra,
    ]  # fmt: skip
    launcher = [sys.executable, "-m", "torchloom", "train"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={procs}", "-m", "torchloom", "train"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([*launcher, *command], capture_output=True, text=True, env=env)
    record = {"layout": name, "processes": procs, "flags": flags, "error": None}
    if proc.returncode != 0:
        record["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1][:300]
        return record
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in steps if "tps" in r and r["step"] > args.warmup]
    record |= {
        "tokens_per_s_per_gpu": statistics.median(r["tps"] for r in timed),
        "tflops_per_gpu": statistics.median(r["tflops"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] else None,
        "peak_mem_gib": max(r["mem_gib"] for r in timed),
        "losses": [r["loss"] for r in steps if "loss" in r],
    }
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="sequences per data rank per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--layouts", nargs="+", default=["1", "fsdp", "fsdp_tp"],
                        choices=list(LAYOUTS))  # fmt: skip
    parser.add_argument("--nproc", type=int, default=max(torch.cuda.device_count(), 1))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("outputs/scaling"))
    parser.add_argument("--json", type=Path, default=Path("outputs/scaling.json"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more `torchloom train` flags for every run (last argument)")  # fmt: skip
    args = parser.parse_args()
    rows = []
    for name in args.layouts:
        rows.append(run_layout(name, args.nproc, args, args.out / name))
        r = rows[-1]
        shown = r["error"] or f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU"
        print(f"{name}: {shown}", flush=True)
    print(
        f"\n{'layout':<8} {'procs':>5} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8}"
    )
    for r in rows:
        if r["error"]:
            print(f"{r['layout']:<8} {r['processes']:>5} error: {r['error'][:70]}")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1f}%"
        print(f"{r['layout']:<8} {r['processes']:>5} {r['tokens_per_s_per_gpu']:>10,.0f} "
              f"{r['tflops_per_gpu']:>8.1f} {mfu:>6} {r['peak_mem_gib']:>8.1f}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "command": " ".join([sys.executable, *sys.argv]), "flavor": args.flavor, "seq": args.seq,
        "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
