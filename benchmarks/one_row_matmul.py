"""One-row matmuls (batch-1 decode) through each cuBLAS entry point PyTorch offers: which one
streams the weights fastest at each of a llama3 flavor's decode shapes.

    python3 benchmarks/one_row_matmul.py                       # Llama-3.2-1B shape, bf16
    python3 benchmarks/one_row_matmul.py --flavor 8B --json outputs/one_row.json

For each weight shape of the compiled decode step (q/k/v stacked, o, gate/up stacked, down, the
head), ``--copies`` separate weights (so none is served from L2, as in a step where each layer
has its own) are multiplied by one row, replayed from one CUDA graph:
- ``linear``: ``F.linear(x[1, K], W[N, K])``, what the model runs (cuBLAS gemm, N = 1 column);
- ``mv``: ``torch.mv(W, x[K])`` (cuBLAS gemv on the same row-major weight);
- ``kn``: ``x[1, K] @ Wt[K, N]``, the weight stored transposed (the other gemm layout);
- ``linear-lt``: ``F.linear`` with ``torch.backends.cuda.preferred_blas_library("cublaslt")``.
Each row: microseconds per matmul and the weight bytes' rate (TB/s); the sum over the step's
matmuls (x layers) per entry point, and the best per shape. GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_bench import ms_per_call

from torchloom.models import ModelConfig, resolve_model_config

VARIANTS = ("linear", "mv", "kn", "linear-lt")


def decode_shapes(flavor: str) -> dict[str, tuple[int, int, int]]:
    """name -> (out features N, in features K, how many a step runs)."""
    config = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    D, F_, L = config.dim, config.ffn_dim, config.num_layers
    head_dim = D // config.num_heads
    qkv = (config.num_heads + 2 * config.num_kv_heads) * head_dim
    return {"qkv": (qkv, D, L), "o": (D, D, L), "gate_up": (2 * F_, D, L), "down": (D, F_, L),
            "head": (config.vocab_size, D, 1)}  # fmt: skip


def time_variant(variant: str, n: int, k: int, copies: int, iters: int) -> float:
    """Microseconds per one-row matmul, replayed from a CUDA graph over ``copies`` weights."""
    device = torch.device("cuda")
    if variant == "kn":
        weights = [torch.randn(k, n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    else:
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    calls = {
        "linear": lambda w: F.linear(x, w),
        "linear-lt": lambda w: F.linear(x, w),
        "mv": lambda w: torch.mv(w, x[0]),
        "kn": lambda w: x @ w,
    }
    call = calls[variant]
    library = torch.backends.cuda.preferred_blas_library()
    try:
        if variant == "linear-lt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        for w in weights:  # cuBLAS's workspace and heuristics, outside the capture
            call(w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                call(w)
    finally:
        torch.backends.cuda.preferred_blas_library(library)
    graph.replay()
    return ms_per_call(graph.replay, iters) * 1e3 / copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--json", type=Path, default=Path("outputs/one_row_matmul.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("one_row_matmul.py times cuBLAS on a CUDA GPU; this machine has none.")
    rows, totals = [], dict.fromkeys(args.variants, 0.0)
    best_total = 0.0
    print(f"{'shape':>8} {'N x K':>14} | " + " | ".join(f"{v:>16}" for v in args.variants))
    for name, (n, k, count) in decode_shapes(args.flavor).items():
        copies = 2 if name == "head" else args.copies  # the head alone is 0.5 GB at 1B
        micros = {v: time_variant(v, n, k, copies, args.iters) for v in args.variants}
        rate = {v: n * k * 2 / (us * 1e-6) / 1e12 for v, us in micros.items()}
        for v in args.variants:
            totals[v] += micros[v] * count
        best_total += min(micros.values()) * count
        rows.append({"shape": name, "N": n, "K": k, "per_step": count,
                     "us": {v: round(us, 2) for v, us in micros.items()},
                     "TB_per_s": {v: round(r, 3) for v, r in rate.items()}})  # fmt: skip
        cells = " | ".join(f"{micros[v]:7.2f} us {rate[v]:4.2f}" for v in args.variants)
        print(f"{name:>8} {f'{n} x {k}':>14} | {cells}", flush=True)
    print(f"{'step':>8} {'sum, us':>14} | " + " | ".join(f"{totals[v]:16.1f}" for v in args.variants)
          + f" | best per shape {best_total:.1f}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
        "flavor": args.flavor, "rows": rows, "step_us": {v: round(t, 1) for v, t in totals.items()},
        "best_per_shape_step_us": round(best_total, 1),
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
