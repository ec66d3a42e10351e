"""Decode tilings of the batch-invariant matmul, timed as a decode step meets them: weights
streamed from HBM, not replayed out of L2; then the batch-invariant generation row with each
tiling rule, against the normal (compiled) row. GPU only (sm_90, where tilings may follow M).

    python benchmarks/bi_decode_tiling.py --json outputs/bi_decode_tiling.json
    python benchmarks/bi_decode_tiling.py --rows 64 --batch 64 --json outputs/bi_tiling_64.json

benchmarks/batch_invariant_matmul.py replays one weight per timing, so a weight smaller than L2
(every 1B weight but the head) is read from L2 after the first replay. Here each timed call walks
over enough copies of the weight (``--cold-mb`` in all) that none is still in L2 when it comes
round again: the time a decode step pays for it. The candidates are the kernel's
timed alternatives for the row count (``timed_matmul_configs``: "decode" for M <= 16, "small"
for M <= 64); one is kept only if it gives the same bits as the shipped tiling on that weight
(checked on 64 rows).

Rules timed end to end (``Generator`` at ``--batch`` sequences, greedy, prompt 128 + 256 new
tokens): the shipped ``matmul_config``; and every weight taking its fastest streamed tiling for
the band of rows the batch falls in (``best``). Every rule must generate the same tokens (batch
invariance fixes the arithmetic whatever the tiling).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path

import generate as bench  # benchmarks/generate.py (this script's folder is on sys.path)
import torch
from batch_invariant_matmul import label, same_bits_across_tilings
from triton.testing import do_bench_cudagraph

from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.kernels import batch_invariant_triton as bit
from torchloom.kernels.batch_invariant_triton import MatmulConfig, launch_matmul


def streamed_us(N: int, K: int, M: int, config: MatmulConfig | None, cold_mb: int) -> float:
    """Microseconds per matmul of x[M, K] @ w[N, K]^T over ``cold_mb`` of weight copies in a row
    (cuBLAS when ``config`` is None)."""
    copies = max(1, math.ceil(cold_mb * 2**20 / (2 * N * K)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        for w in ws:
            if config is None:
                torch.matmul(x, w.T, out=out)
            else:
                launch_matmul(x, w, out, config)

    return 1e3 * do_bench_cudagraph(run, rep=30, return_mode="median") / copies


def band(M: int) -> str | None:
    """Which of the kernel's timed sets a call of M rows draws from (None: none)."""
    return "decode" if M <= 16 else "small" if M <= 64 else None


def generate_row(
    model, vocab: int, rule: dict | None, compile_: bool, new_tokens: int, batch: int
) -> tuple[float, list]:
    """Tokens/s of one generate call of ``batch`` sequences (after a warm-up call) and its
    tokens, with the tiling ``rule`` ({(band, N, K): MatmulConfig}) patched in."""
    shipped = bit.matmul_config

    def patched(M, N, K, dtype, device):
        if rule is not None and (band(M), N, K) in rule:
            return rule[(band(M), N, K)]
        return shipped(M, N, K, dtype, device)

    bit.matmul_config = patched
    try:
        options = {"compile": True} if compile_ else {}
        generator = Generator(model, max_batch=batch, max_len=128 + new_tokens,
                              decode_attention="torch", **options)  # fmt: skip
        seeds = torch.Generator().manual_seed(0)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        requests = [
            Request(torch.randint(0, vocab, (128,), generator=seeds).tolist(), sampling)
            for _ in range(batch)
        ]
        generator.generate(requests)  # warm-up: compiles, captures the CUDA graphs
        torch.cuda.synchronize()
        start = time.perf_counter()
        completions = generator.generate(requests)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        bit.matmul_config = shipped
    return batch * new_tokens / seconds, [list(c.tokens) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold-mb", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="ascending, <= 64")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the generation rows")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("outputs/bi_decode_tiling.json"))
    args = parser.parse_args()
    if max(args.rows) > 64 or args.batch > 64:
        parser.error("--rows and --batch go up to 64 (the bands the kernel times tilings for)")
    device = torch.device("cuda")
    model, cfg = bench.build("1B", device, torch.bfloat16, batch_invariant=True)
    hd = cfg.resolved_head_dim
    shapes = [  # the matmuls of a decode step from CUDA graphs: q/k/v and gate/up stacked
        ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, cfg.dim),  # q/k/v
        (cfg.dim, cfg.num_heads * hd),  # o
        (2 * cfg.ffn_dim, cfg.dim),  # gate/up
        (cfg.dim, cfg.ffn_dim),  # down
        (cfg.vocab_size, cfg.dim),  # head
    ]
    timings, rule, differs = [], {}, {}
    for N, K in shapes:
        x = torch.randn(64, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
        for M in args.rows:
            key = (band(M), N, K)
            candidates = {label(c): c for c in bit.timed_matmul_configs(torch.bfloat16, key[0])}
            if key not in differs:  # against the shipped tiling at M = 64
                differs[key] = same_bits_across_tilings(x, w, candidates)
            differ = differs[key]
            good = [c for name, c in candidates.items() if name not in differ]
            shipped = bit.matmul_config(M, N, K, torch.bfloat16, device)
            us = {label(c): streamed_us(N, K, M, c, args.cold_mb) for c in good}
            row = {"N": N, "K": K, "M": M, "shipped": label(shipped), "differ": differ,
                   "cublas_us": streamed_us(N, K, M, None, args.cold_mb),
                   "shipped_us": streamed_us(N, K, M, shipped, args.cold_mb), "us": us}  # fmt: skip
            best = min(good, key=lambda c: row["us"][label(c)])
            row["best"] = label(best)
            rule.setdefault(key, best)  # the band's fewest rows' best (--rows ascending)
            gbps = 2 * N * K / (row["us"][label(best)] * 1e3)
            print(f"N {N:>6} K {K:>5} M {M:>3}: cuBLAS {row['cublas_us']:.1f} us, shipped "
                  f"{row['shipped']} {row['shipped_us']:.1f}, best {row['best']} "
                  f"{row['us'][row['best']]:.1f} ({gbps:.0f} GB/s); differ: {differ}",
                  flush=True)  # fmt: skip
            timings.append(row)
    print("\nstreamed us, every agreeing candidate:")
    for row in timings:
        fastest_first = sorted(row["us"].items(), key=lambda item: item[1])
        print(f"N {row['N']:>6} K {row['K']:>5} M {row['M']:>3}: "
              + ", ".join(f"{k} {v:.1f}" for k, v in fastest_first))  # fmt: skip
    normal, _ = bench.build("1B", device, torch.bfloat16)
    normal.load_state_dict(model.state_dict())
    rows, tokens = {}, {}
    for _ in range(args.repeats):
        # The batch-invariant rows first: the normal row's compile is the slowest part.
        for name, m, r, compile_ in (
            ("batch-invariant, shipped", model, None, False),
            ("batch-invariant, best", model, rule, False),
            ("normal (compiled, step_kernel auto)", normal, None, True),
        ):
            tps, completion = generate_row(
                m, cfg.vocab_size, r, compile_, args.new_tokens, args.batch
            )
            rows.setdefault(name, []).append(tps)
            if "batch-invariant" in name:
                tokens.setdefault(name, completion)
            print(f"{name}: {tps:.1f} tokens/s", flush=True)
    same = len({tuple(map(tuple, t)) for t in tokens.values()}) == 1
    print(f"\nbatch-invariant rules give the same tokens: {same}")
    base = max(rows["normal (compiled, step_kernel auto)"])
    for name, values in rows.items():
        print(f"{name:<40} best {max(values):8.1f} tokens/s  {max(values) / base:6.1%} of normal")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cold_mb": args.cold_mb, "timings": timings,
        "batch": args.batch, "rule": {f"{b} {n}x{k}": label(c) for (b, n, k), c in rule.items()},
        "generate_tokens_per_s": rows, "same_tokens": same,
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
