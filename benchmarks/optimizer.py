"""The optimizer's share of a training step: gradient norm, clipping and AdamW, side by side.

    python benchmarks/optimizer.py                          # 1B (fp32 weights) and 8B (bf16)
    python benchmarks/optimizer.py --shapes 1B --iters 20 --json outputs/optimizer.json

For the parameters of a llama3 flavor (their real shapes, weights in the dtype
benchmarks/train.py trains them in, random gradients), each row times what follows backward:

- ``torch``: the Trainer's step with ``--optimizer.implementation fused``: torch's
  ``get_total_norm`` over the gradients (the ``_foreach_norm`` kernel), every gradient scaled
  in place (``clip_grad_norm_``), then torch's fused AdamW.
- ``triton``: ``--optimizer.implementation triton``: the norm summed by a Triton kernel into
  fp32 per-block partials (parallel/grad.py ``grad_norm``), then one Triton AdamW kernel per
  parameter that multiplies the gradient by the clip coefficient on the way in.
- ``torch-norm`` / ``triton-norm``: the norm alone; ``torch-adamw`` / ``triton-adamw``: the
  AdamW step alone (no clipping).

GB/s counts the bytes the step must move at least: AdamW reads parameter, gradient and both
moments and writes parameter and moments (7 tensors of the parameters' size); the norm reads
the gradients once; clipping in place adds a read and a write of them. Times: median of
--iters CUDA-event timed iterations after 3 warm-up ones. One table, JSON to --json. GPU only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_bench import median_seconds, write_report

from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.parallel import grad_norm
from torchloom.train.optim import OptimizerConfig, build_optimizer, clip_gradients

SHAPES = {"1B": torch.float32, "8B": torch.bfloat16}  # weight dtype, as benchmarks/train.py
# Clip at a norm the gradients never reach: both paths still do all their work (torch's scales
# by 1.0), and repeated iterations do not shrink the gradients toward zero.
MAX_NORM = 1e6
ROWS = ("torch", "triton", "torch-norm", "triton-norm", "torch-adamw", "triton-adamw")


def _model(flavor: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    cfg = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    gen = torch.Generator(device).manual_seed(0)
    for p in model.parameters():
        p.detach().normal_(0, 0.02, generator=gen)
        p.grad = torch.empty_like(p).normal_(0, 1e-4, generator=gen)
    return model


def _steps(model: torch.nn.Module, device: torch.device) -> dict[str, Callable[[], object]]:
    """Each row's work, as the Trainer does it (``clip_gradients`` then ``step``)."""
    params = list(model.parameters())
    optimizers = {impl: build_optimizer(model, OptimizerConfig(implementation=impl), device)
                  for impl in ("fused", "triton")}  # fmt: skip

    def clip_and_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            clip_gradients(optimizer, params, MAX_NORM)
            optimizer.step()

        return step

    fused, triton = optimizers["fused"], optimizers["triton"]
    return {"torch": clip_and_step(fused), "triton": clip_and_step(triton),
            "torch-norm": lambda: grad_norm(params),
            "triton-norm": lambda: grad_norm(params, triton_kernel=True),
            "torch-adamw": fused.step, "triton-adamw": triton.step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path, default=Path("outputs/optimizer_bench.json"))
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    records = []
    for shape in args.shapes:
        dtype = SHAPES[shape]
        model = _model(shape, dtype, device)
        numel = sum(p.numel() for p in model.parameters())
        size = numel * dtype.itemsize
        moved = {"torch": 10 * size, "triton": 8 * size, "torch-norm": size,
                 "triton-norm": size, "torch-adamw": 7 * size, "triton-adamw": 7 * size}  # fmt: skip
        steps = _steps(model, device)
        for row in args.rows:
            ms = 1e3 * median_seconds(steps[row], args.iters)
            records.append({"shape": shape, "row": row, "params": numel,
                            "dtype": str(dtype).removeprefix("torch."), "ms": ms,
                            "gb_per_s": moved[row] / ms / 1e6})  # fmt: skip
            print(f"  {shape} {row}: {ms:.2f} ms", flush=True)
        del model, steps
        torch.cuda.empty_cache()
    print(
        f"\n{'shape':<5} {'row':<13} {'params':>7} {'dtype':<9} {'ms':>8} {'GB/s':>7} {'vs torch':>8}"
    )
    for r in records:
        base = next((b["ms"] for b in records if b["shape"] == r["shape"]
                     and b["row"] == r["row"].replace("triton", "torch")), None)  # fmt: skip
        ratio = f"{base / r['ms']:.2f}x" if base else ""
        print(f"{r['shape']:<5} {r['row']:<13} {r['params'] / 1e9:>6.2f}B {r['dtype']:<9} "
              f"{r['ms']:>8.2f} {r['gb_per_s']:>7.0f} {ratio:>8}")  # fmt: skip
    write_report(args.json, records)


if __name__ == "__main__":
    main()
