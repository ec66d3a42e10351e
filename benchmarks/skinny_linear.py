"""Few-row linears (a decode step's) on one GPU: cuBLAS (``F.linear``) against
kernels/skinny_linear.py's Triton kernel, at the llama3 1B and 8B weight shapes; one table,
JSON to --json.

    python benchmarks/skinny_linear.py                 # one GPU, rows 1 2 4 8
    python benchmarks/skinny_linear.py --sweep         # also every kernel block shape tried

Each row times ``--calls`` products in one captured CUDA graph (as the generator replays a
decode step), each on another copy of the weight so that no call reads it from L2 (the copies
total at least 4 x the L2), and reports the weight bytes read per second. ``--sweep`` also times
the kernel at each (BLOCK_N, BLOCK_K, warps) in SWEEP and reports the fastest, to check the
configuration ``skinny_config`` picks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from torchloom.kernels.skinny_linear import launch_skinny_linear, skinny_config

SHAPES = {  # name: (features, inputs) of llama3's 1B and 8B shapes
    "1B qkv": (3072, 2048), "1B q/o": (2048, 2048), "1B k/v": (512, 2048),
    "1B gate/up": (8192, 2048), "1B down": (2048, 8192), "1B head": (128256, 2048),
    "8B q/o": (4096, 4096), "8B k/v": (1024, 4096), "8B gate/up": (14336, 4096),
    "8B down": (4096, 14336),
}  # fmt: skip
SWEEP = [(n, k, w) for n in (2, 4, 8, 16) for k in (256, 512, 1024) for w in (4, 8)]


def time_calls(fn, xs: list[torch.Tensor], weights: list[torch.Tensor], calls: int) -> float:
    """Seconds per call of ``fn(x, w)`` over ``calls`` calls captured in one CUDA graph."""
    for x, w in zip(xs, weights):  # compile / warm up outside the capture
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(xs[i % len(xs)], weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[1])
    parser.add_argument("--json", type=Path, default=Path("outputs/skinny_linear_bench.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    records = []
    print(f"{'shape':<11} {'rows':>4} {'cuBLAS GB/s':>11} {'kernel GB/s':>11} {'ratio':>6} "
          f"{'blocks (N, K, warps)':>20} {'best swept GB/s':>15} {'best blocks':>14}")  # fmt: skip
    for name in args.shapes:
        features, inputs = SHAPES[name]
        nbytes = features * inputs * 2
        copies = max(2, -(-4 * l2 // nbytes))
        weights = [torch.randn(features, inputs, device=device, dtype=torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        for rows in args.rows:
            xs = [torch.randn(rows, inputs, device=device, dtype=torch.bfloat16) for _ in range(2)]
            cublas = time_calls(F.linear, xs, weights, args.calls)
            kernel = time_calls(launch_skinny_linear, xs, weights, args.calls)
            config = skinny_config(rows, features, inputs)
            record = {"shape": name, "features": features, "inputs": inputs, "rows": rows,
                      "cublas_gbps": nbytes / cublas / 1e9, "kernel_gbps": nbytes / kernel / 1e9,
                      "config": list(config)}  # fmt: skip
            best = ("", "")
            if args.sweep and rows in args.sweep_rows:
                swept = {}
                for block_n, block_k, warps in SWEEP:
                    block_m = config[0]
                    if block_m * block_n * block_k > 32768:
                        continue

                    def fn(x, w, c=(block_m, block_n, block_k, warps)):
                        return launch_skinny_linear(x, w, c)

                    swept[(block_n, block_k, warps)] = nbytes / time_calls(fn, xs, weights, 8) / 1e9
                top = max(swept, key=swept.get)
                record["sweep"] = {str(k): v for k, v in swept.items()}
                best = (f"{swept[top]:,.0f}", str(top))
            records.append(record)
            print(f"{name:<11} {rows:>4} {record['cublas_gbps']:>11,.0f} "
                  f"{record['kernel_gbps']:>11,.0f} {cublas / kernel:>5.2f}x "
                  f"{config[1:]!s:>20} {best[0]:>15} {best[1]:>14}", flush=True)  # fmt: skip
        del weights
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]), "calls": args.calls, "rows": records,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
