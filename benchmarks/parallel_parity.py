"""Loss parity of parallel layouts against one process, through the real `torchloom train`.

Runs the debug recipe (4 layers, fp32 everywhere so differences are rounding only) once on one
process, then once per layout under torchrun, and prints one table of the largest loss
difference per layout (validation before, every step, validation after); JSON to --json.

    python benchmarks/parallel_parity.py --nproc 2                  # CPU (gloo) or GPUs (NCCL)
    python benchmarks/parallel_parity.py --nproc 2 --layouts fsdp tp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = [
    "--recipe", "debug", "--training.steps", "6", "--training.sample_tokens", "0",
    "--metrics.tensorboard", "false", "--training.val_sequences", "8",
    "--model.overrides", '{"num_layers": 4}', "--training.mixed_precision", "fp32",
    "--parallel.mixed_precision_param", "fp32", "--checkpoint.save_final_model", "false",
]  # fmt: skip

TWO_RANK_LAYOUTS = {
    "fsdp": ["--parallel.dp_shard", "2"],
    "replicate": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"],
    "tp": ["--parallel.tp", "2"],
    "tp_gathered_logits": ["--parallel.tp", "2", "--parallel.loss_parallel", "false"],
    "cp": ["--parallel.cp", "2"],
    **{
        f"pp_{schedule}": ["--parallel.pp", "2", "--parallel.pp_schedule", schedule]
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
    },
}
FOUR_RANK_LAYOUTS = {
    "hsdp": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"],
    "fsdp_tp": ["--parallel.dp_shard", "2", "--parallel.tp", "2"],
    "fsdp_cp": ["--parallel.dp_shard", "2", "--parallel.cp", "2"],
    "fsdp_pp": ["--parallel.dp_shard", "2", "--parallel.pp", "2"],
    "tp_pp": ["--parallel.tp", "2", "--parallel.pp", "2"],
    "cp_tp": ["--parallel.cp", "2", "--parallel.tp", "2"],
}


def losses(output_dir: Path) -> list[float]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [r.get("loss", r.get("val_loss")) for r in records]


def train(output_dir: Path, nproc: int, layout: list[str]) -> tuple[float, str]:
    launcher = [sys.executable, "-m", "torchloom"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", "-m", "torchloom"]  # fmt: skip
    cmd = [*launcher, "train", *COMMON, "--output.dir", str(output_dir), *layout]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
    error = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]
    return time.perf_counter() - start, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--layouts", nargs="*", help="names to run (default: all for --nproc)")
    parser.add_argument("--json", type=Path, default=Path("outputs/parallel_parity.json"))
    args = parser.parse_args()
    table = TWO_RANK_LAYOUTS if args.nproc == 2 else FOUR_RANK_LAYOUTS
    names = args.layouts or list(table)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        seconds, error = train(Path(tmp) / "single", 1, [])
        if error:
            sys.exit(f"single-process run failed: {error}")
        reference = losses(Path(tmp) / "single")
        print(f"single process: {seconds:.0f} s, losses {[round(x, 5) for x in reference]}")
        print(f"{'layout':<22} {'ranks':>5} {'max |loss diff|':>16} {'seconds':>8}")
        for name in names:
            seconds, error = train(Path(tmp) / name, args.nproc, table[name])
            diff = None
            if not error:
                diff = max(abs(a - b) for a, b in zip(reference, losses(Path(tmp) / name)))
            rows.append({"layout": name, "ranks": args.nproc, "max_loss_diff": diff,
                         "seconds": round(seconds, 1), "error": error})  # fmt: skip
            shown = f"{diff:.2e}" if diff is not None else f"error: {error[:60]}"
            print(f"{name:<22} {args.nproc:>5} {shown:>16} {seconds:>8.0f}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"reference": reference, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
