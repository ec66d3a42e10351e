"""Tilings of the batch-invariant matmul against cuBLAS, per weight shape and row count.

    python benchmarks/batch_invariant_matmul.py                     # llama3 1B shapes, bf16
    python benchmarks/batch_invariant_matmul.py --rows 1 64 --json outputs/bim.json

For each weight [N, K] of the model (q, k/v, o, gate/up, down, head) and each row count M, the
time of ``x[M, K] @ w[N, K]^T`` with cuBLAS (torch.matmul), with the tiling the kernel uses
(``matmul_config``, which follows M on sm_90) and with the candidate tilings below; and a check
that the op gives rows 0..M alone the bits they get among the most rows. Per weight, in bf16
and fp32, it also checks that every candidate tiling gives bitwise the chosen tiling's output
(what lets the tiling follow M, large tiles for training and small ones for decode, without
breaking invariance). GPU times: medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph), so launch cost is left out, as in a captured decode
step. Host cost of one eager call (what an uncaptured step pays per linear: the eager twin, the
custom op, a bare Triton launch and one through ``wrap_triton``) is printed apart.
Last, whole-kernel overheads at training and decode sizes: the 8192x4096x4096 matmul (bf16 and
fp32) and causal attention forward + backward and decode attention against SDPA.
One table, JSON to --json. GPU only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from torchloom.kernels.batch_invariant_triton import (
    MatmulConfig,
    attention,
    causal_attention,
    launch_matmul,
    linear,
    matmul_config,
)
from torchloom.models import ModelConfig, resolve_model_config
from torchloom.models.components.attention import sdpa_attention


def label(c: MatmulConfig) -> str:
    """A tiling's name in the tables: BLOCK_M x BLOCK_N x BLOCK_K, warps, stages."""
    return f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"


CANDIDATES = {  # BLOCK_M x BLOCK_N x BLOCK_K, warps, stages
    label(MatmulConfig(*t)): MatmulConfig(*t)
    for t in [
        (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 32, 64, 4, 4),
        (64, 256, 64, 4, 3), (64, 128, 64, 4, 3), (64, 64, 64, 4, 4), (64, 32, 64, 4, 4),
        (64, 64, 128, 4, 3), (64, 32, 128, 4, 3), (64, 16, 128, 4, 3),
        (32, 32, 128, 4, 3), (16, 64, 128, 4, 3), (16, 32, 128, 4, 3), (16, 16, 128, 2, 3),
        (16, 64, 256, 4, 3), (16, 16, 256, 4, 4), (16, 16, 512, 4, 4), (16, 64, 256, 4, 4),
        (16, 16, 1024, 4, 3),
    ]
}  # fmt: skip
# fp32 ("ieee", no tensor cores): shorter K blocks, so the pipelined tiles fit shared memory.
FP32_CANDIDATES = {
    label(MatmulConfig(*t)): MatmulConfig(*t)
    for t in [
        (128, 128, 32, 8, 3), (64, 64, 32, 4, 3), (64, 32, 32, 4, 3), (16, 64, 32, 4, 3),
        (16, 32, 64, 4, 3), (32, 64, 16, 4, 3),
    ]
}  # fmt: skip


def gpu_us(fn) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=20, return_mode="median")


def host_us(fn, calls: int = 200) -> float:
    """Wall time per call of ``calls`` eager calls in a row (GPU work is tiny: launch-bound)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def same_bits_across_tilings(
    x: torch.Tensor, w: torch.Tensor, candidates: dict[str, MatmulConfig] | None = None
) -> list[str]:
    """The ``candidates`` (default: this dtype's candidate tilings above) whose output differs
    in any bit from the chosen tiling's. An empty list means neither BLOCK_M / BLOCK_N / BLOCK_K
    nor the warps and stages change a bit: every tile chains the same 16-deep tensor-core (or
    FMA) steps over K in the same order, so a tiling could follow M without breaking batch
    invariance."""
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    launch_matmul(x, w, out, matmul_config(*x.shape[:1], *w.shape, x.dtype, x.device))
    reference = out.clone()
    if candidates is None:
        candidates = FP32_CANDIDATES if x.dtype == torch.float32 else CANDIDATES
    differ = []
    for name, config in candidates.items():
        out.fill_(float("nan"))
        launch_matmul(x, w, out, config)
        if not torch.equal(out, reference):
            differ.append(name)
    print(f"  {x.dtype} {tuple(w.shape)}: tilings that change bits: {differ}", flush=True)
    return differ


def weights(flavor: str) -> dict[str, tuple[int, int]]:
    cfg = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    hd = cfg.resolved_head_dim
    return {
        "q/o": (cfg.num_heads * hd, cfg.dim),
        "k/v": (cfg.num_kv_heads * hd, cfg.dim),
        "gate/up": (cfg.ffn_dim, cfg.dim),
        "down": (cfg.dim, cfg.ffn_dim),
        "head": (cfg.vocab_size, cfg.dim),
    }


def overheads(device: torch.device) -> dict[str, float]:
    """Batch-invariant / normal time of whole kernels (do_bench_cudagraph medians)."""
    bf16 = torch.bfloat16
    x, w = (torch.randn(n, 4096, device=device, dtype=bf16) for n in (8192, 4096))
    x32, w32 = x.float(), w.float()
    q, k, v = (torch.randn(4, h, 2048, 128, device=device, dtype=bf16).requires_grad_()
               for h in (32, 8, 8))  # fmt: skip
    q_dec = torch.randn(64, 32, 1, 128, device=device, dtype=bf16)
    k_dec, v_dec = (torch.randn(64, 8, 2048, 128, device=device, dtype=bf16) for _ in range(2))
    positions = torch.full((64, 1), 2047, device=device)

    def train(attend):
        return lambda: attend(q, k, v, None).backward(torch.ones_like(q))

    cases = {  # name: (normal mode, batch-invariant mode)
        "matmul bf16 8192x4096x4096": (lambda: x @ w.T, lambda: linear(x, w)),
        "matmul fp32 8192x4096x4096": (lambda: x32 @ w32.T, lambda: linear(x32, w32)),
        "matmul bf16 64x4096x4096": (lambda: x[:64] @ w.T, lambda: linear(x[:64], w)),
        "causal attention fwd+bwd B4 H32/8 T2048 d128": (train(sdpa_attention),
                                                         train(causal_attention)),
        "decode attention B64 L2048 (normal: SDPA, no mask)": (
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q_dec, k_dec, v_dec, enable_gqa=True),
            lambda: attention(q_dec, k_dec, v_dec, positions)),
    }  # fmt: skip
    ratios = {}
    for name, (normal, invariant) in cases.items():
        try:
            ratios[name] = gpu_us(invariant) / gpu_us(normal)
        except Exception as err:  # recorded; the other cases still run
            print(f"{name}: failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
            continue
        print(f"{name}: batch-invariant / normal time = {ratios[name]:.2f}", flush=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 4096])
    parser.add_argument("--json", type=Path, default=Path("outputs/bi_matmul.json"))
    args = parser.parse_args()
    dtype, device = torch.bfloat16, torch.device("cuda")
    x = torch.randn(1, 2048, device=device, dtype=dtype)
    w = torch.randn(2048, 2048, device=device, dtype=dtype)
    out = torch.empty(1, 2048, device=device, dtype=dtype)
    config = matmul_config(1, 2048, 2048, dtype, device)
    launch = {
        "torch F.linear": host_us(lambda: torch.nn.functional.linear(x, w)),
        "batch-invariant linear (eager twin)": host_us(lambda: linear(x, w)),
        "its custom op (what torch.compile calls)": host_us(
            lambda: torch.ops.torchloom.batch_invariant_matmul(x, w)
        ),
        "bare Triton launch": host_us(lambda: launch_matmul(x, w, out, config)),
        "launch through wrap_triton": host_us(lambda: launch_matmul(x, w, out, config, True)),
    }
    print("host us per eager call, M=1 2048x2048:",
          ", ".join(f"{k} {v:.1f}" for k, v in launch.items()))  # fmt: skip
    results, tilings_agree = [], {}
    for name, (N, K) in weights(args.flavor).items():
        w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
        x_all = torch.randn(max(args.rows), K, device=device, dtype=dtype)
        for M in args.rows:
            x = x_all[:M]
            chosen = matmul_config(M, N, K, dtype, device)
            out = torch.empty(M, N, device=device, dtype=dtype)
            row = {"weight": name, "N": N, "K": K, "M": M,
                   "cublas_us": gpu_us(lambda x=x, w=w: x @ w.T)}  # fmt: skip
            for tiling, config in {"chosen": chosen, **CANDIDATES}.items():
                run = lambda c=config, x=x, w=w, out=out: launch_matmul(x, w, out, c)  # noqa: E731
                row[tiling + "_us"] = gpu_us(run)
            row["chosen"] = str(chosen)
            row["best"] = min(CANDIDATES, key=lambda c: row[c + "_us"])
            results.append(row)
            print(f"{name:<8} N {N:>6} K {K:>5} M {M:>5}: cublas {row['cublas_us']:.1f} chosen "
                  f"{row['chosen_us']:.1f} best {row['best']} {row[row['best'] + '_us']:.1f}",
                  flush=True)  # fmt: skip
        among_all = linear(x_all, w)
        for M in args.rows:  # the op as the model calls it: its tiling follows M
            if not torch.equal(among_all[:M], linear(x_all[:M], w)):
                print(f"NOT INVARIANT: {name}, rows 0..{M} alone vs among {x_all.shape[0]}")
        tilings_agree[name] = same_bits_across_tilings(x_all, w)
        tilings_agree[name + " fp32"] = same_bits_across_tilings(x_all.float(), w.float())
    print("\nall candidates (us):")
    print(f"{'weight':<8} {'M':>5} {'cublas':>7} " + " ".join(f"{c:>17}" for c in CANDIDATES))
    for r in results:
        print(f"{r['weight']:<8} {r['M']:>5} {r['cublas_us']:>7.1f} "
              + " ".join(f"{r[c + '_us']:>17.1f}" for c in CANDIDATES))  # fmt: skip
    weight_bytes = {name: 2 * N * K for name, (N, K) in weights(args.flavor).items()}
    print(
        f"\n{'weight':<8} {'M':>5} {'cuBLAS us':>10} {'chosen us':>10} {'ratio':>6} {'GB/s chosen':>12}"
    )
    for r in results:
        gbps = weight_bytes[r["weight"]] / (r["chosen_us"] * 1e3)
        print(f"{r['weight']:<8} {r['M']:>5} {r['cublas_us']:>10.1f} {r['chosen_us']:>10.1f} "
              f"{r['chosen_us'] / r['cublas_us']:>5.2f}x {gbps:>12.0f}")  # fmt: skip
    ratios = overheads(device)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "flavor": args.flavor, "host_us_per_call": launch,
        "rows": results, "overheads": ratios, "same_bits_across_tilings": tilings_agree,
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
