"""The training step's matmuls one at a time: which shapes fall short of the ceiling.

    python benchmarks/matmul_shapes.py                         # 1B at 8 x 4096, 8B at 4 x 4096
    python benchmarks/matmul_shapes.py --shapes 8B --tokens 16384 --json outputs/mm.json

For every linear of a llama3 flavor's block (q, k, v, o, gate, up, down) and the output head
(in the chunks of --chunk tokens that --model.loss_impl chunked uses), the three bf16 matmuls
of a training step, each timed alone: forward (tokens x in -> out), input gradient (tokens x
out -> in) and weight gradient (out x tokens -> in; the head's accumulates into fp32, as the
chunked loss does). Also the same layers fused: q, k and v as one [q+k+v, dim] weight, gate and
up as one [2 ffn, dim]. Each row: time per call, TFLOP/s, and the step's total for that layer
(x layers, x chunks). The sums say how long the step's matmuls take when each runs alone at
its own speed, against the matmul time a profile of the whole step shows (benchmarks/train.py
--profile-steps). Times: median of --iters CUDA-event timed calls after 3 warm-up ones; one
table, JSON to --json. GPU only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from gpu_bench import median_seconds, write_report

from torchloom.models import ModelConfig, resolve_model_config

TOKENS = {"1B": 8 * 4096, "8B": 4 * 4096}  # the measured steps of benchmarks/RESULTS.md


def layer_shapes(flavor: str) -> tuple[list[tuple[str, int, int, int]], int]:
    """(name, in, out, count per step) for each linear, and the vocabulary."""
    cfg = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    d, hd, layers = cfg.dim, cfg.dim // cfg.num_heads, cfg.num_layers
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return [
        ("q", d, q, layers), ("k", d, kv, layers), ("v", d, kv, layers), ("o", q, d, layers),
        ("gate", d, cfg.ffn_dim, layers), ("up", d, cfg.ffn_dim, layers),
        ("down", cfg.ffn_dim, d, layers),
        ("qkv fused", d, q + 2 * kv, layers), ("gate_up fused", d, 2 * cfg.ffn_dim, layers),
    ], cfg.vocab_size  # fmt: skip


def step_rows(flavor: str, tokens: int, chunk: int) -> list[tuple[str, int, int, int, int, bool]]:
    """(name, m, k, n, count per step, fp32 weight gradient) of every matmul row: each linear
    at ``tokens`` tokens (the fused ones too), then the head in chunks of ``chunk`` tokens."""
    layers, vocab = layer_shapes(flavor)
    rows = [(name, tokens, k, n, count, False) for name, k, n, count in layers]
    rows.append(("head (chunk)", chunk, layers[0][1], vocab, tokens // chunk, True))
    return rows


def time_linear(m: int, k: int, n: int, iters: int, fp32_wgrad: bool = False) -> dict[str, float]:
    """ms of forward, input-gradient and weight-gradient matmuls of x [m, k] @ w[n, k]^T."""
    dev, bf = "cuda", torch.bfloat16
    x, w, dy = (torch.randn(s, device=dev, dtype=bf) for s in ((m, k), (n, k), (m, n)))
    out = {
        "fwd": 1e3 * median_seconds(lambda: x @ w.t(), iters),
        "dgrad": 1e3 * median_seconds(lambda: dy @ w, iters),
    }
    if fp32_wgrad:
        acc = torch.zeros(n, k, device=dev, dtype=torch.float32)
        out["wgrad"] = 1e3 * median_seconds(
            lambda: torch.addmm(acc, dy.t(), x, out_dtype=torch.float32), iters
        )  # as kernels/linear_cross_entropy.py accumulates the head's gradient
    else:
        out["wgrad"] = 1e3 * median_seconds(lambda: dy.t() @ x, iters)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(TOKENS), choices=list(TOKENS))
    parser.add_argument("--tokens", type=int, help="tokens per step (default: the shape's)")
    parser.add_argument("--chunk", type=int, default=4096, help="the head's tokens per chunk")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("outputs/matmul_shapes.json"))
    args = parser.parse_args()
    records = []
    for shape in args.shapes:
        tokens = args.tokens or TOKENS[shape]
        for name, m, k, n, count, fp32_wgrad in step_rows(shape, tokens, args.chunk):
            times = time_linear(m, k, n, args.iters, fp32_wgrad)
            for kind, ms in times.items():
                records.append({"shape": shape, "layer": name, "matmul": kind, "m": m, "k": k,
                                "n": n, "ms": ms, "tflops": 2 * m * k * n / ms / 1e9,
                                "per_step_ms": ms * count})  # fmt: skip
            print(f"  {shape} {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    print(f"\n{'shape':<5} {'layer':<14} {'matmul':<6} {'m x k x n':>22} {'ms':>7} {'TFLOP/s':>8} {'step ms':>8}")  # fmt: skip
    for r in records:
        mkn = f"{r['m']} x {r['k']} x {r['n']}"
        print(f"{r['shape']:<5} {r['layer']:<14} {r['matmul']:<6} {mkn:>22} {r['ms']:>7.3f} "
              f"{r['tflops']:>8.1f} {r['per_step_ms']:>8.1f}")  # fmt: skip
    for shape in args.shapes:
        mine = [r for r in records if r["shape"] == shape]
        unfused = sum(r["per_step_ms"] for r in mine if "fused" not in r["layer"])
        fused = (
            unfused
            - sum(r["per_step_ms"] for r in mine if r["layer"] in ("q", "k", "v", "gate", "up"))
            + sum(r["per_step_ms"] for r in mine if "fused" in r["layer"])
        )
        print(
            f"{shape}: the step's matmuls alone {unfused:.1f} ms; with q/k/v and gate/up "
            f"fused {fused:.1f} ms"
        )
    write_report(args.json, records)


if __name__ == "__main__":
    main()
