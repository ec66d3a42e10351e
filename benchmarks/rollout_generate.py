"""An RL step's generation alone: many groups of requests that share a prompt, sampled, with
replies of mixed lengths (as stop tokens end them), through one Generator with many slots. The
scheduling before and after batched admission and the mixed-prefill padding cap, side by
side; one table, JSON to --json.

    python benchmarks/rollout_generate.py                       # rl_gpu's 0.5B shape, one GPU
    python benchmarks/rollout_generate.py --device cpu --dim 64 --layers 2 --groups 4 --slots 8

The "before" row admits every waiting request as soon as a slot frees (``admit_batch=1``) and
lets any short prefill carry every decoding row (no padding cap): what the H200 countdown run
of 2026-12-04 used. Weights are random; each request's reply length is drawn uniformly from
[--min-new, --max-new] (its max_new_tokens), so requests end at different steps as in RL.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from torchloom.generate import engine
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.models import ModelConfig, build_model, resolve_model_config

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import write_report


def requests(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(0)
    out = []
    for group in range(args.groups):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        for member in range(args.group_size):
            params = SamplingParams(max_new_tokens=rng.randint(args.min_new, args.max_new),
                                    temperature=1.0, seed=group * args.group_size + member)  # fmt: skip
            out.append(Request(prompt, params))
    return out


def run(model: torch.nn.Module, args: argparse.Namespace, before: bool) -> dict:
    padding = engine.MIXED_PREFILL_PADDING
    if before:
        engine.MIXED_PREFILL_PADDING = 10**12
    try:
        generator = Generator(model, max_batch=args.slots, max_len=args.prompt_len + args.max_new,
                              admit_batch=1 if before else None)  # fmt: skip
        counts = {"prefill": 0, "decode": 0}
        for kind in counts:
            original = getattr(generator, f"_{kind}")

            def counted(*a, kind=kind, original=original):
                counts[kind] += 1
                return original(*a)

            setattr(generator, f"_{kind}", counted)
        work = requests(args, model.config.vocab_size)
        generator.generate(work[: args.slots])  # warm-up: allocator, kernels
        counts.update(prefill=0, decode=0)
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        done = generator.generate(work)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    finally:
        engine.MIXED_PREFILL_PADDING = padding
    tokens = sum(len(c.tokens) for c in done)
    return {"row": "before" if before else "after", "requests": len(work), "seconds": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds, **counts}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--groups", type=int, default=184, help="prompts (RL groups)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=24)
    parser.add_argument("--slots", type=int, default=512, help="the generator's max_batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=Path("outputs/rollout_generate.json"))
    args = parser.parse_args()
    heads = max(1, args.dim // 128)
    shape = {"dim": args.dim, "num_layers": args.layers, "num_heads": heads,
             "num_kv_heads": max(1, heads // 3), "ffn_dim": args.dim * 8 // 3 // 64 * 64 or 64,
             "max_seq_len": 1024}  # fmt: skip
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug", overrides=shape))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device=args.device).to(dtype)
    model.init_weights(0)
    model.eval()
    rows = [run(model, args, before) for before in (True, False)]
    print(f"{config.num_params() / 1e6:.0f}M params, {args.groups} x {args.group_size} requests, "
          f"prompt {args.prompt_len}, replies {args.min_new}-{args.max_new}, {args.slots} slots")  # fmt: skip
    print(f"{'row':8} {'seconds':>8} {'tokens':>7} {'tokens/s':>10} {'prefills':>9} "
          f"{'decodes':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['row']:8} {r['seconds']:8.2f} {r['tokens']:7d} {r['tokens_per_s']:10,.0f} "
              f"{r['prefill']:9d} {r['decode']:8d}")  # fmt: skip
    print(f"speed-up {rows[0]['seconds'] / rows[1]['seconds']:.2f}x")
    if args.device == "cuda":
        write_report(args.json, [{**r, "args": vars(args) | {"json": str(args.json)}}
                                 for r in rows])  # fmt: skip


if __name__ == "__main__":
    main()
