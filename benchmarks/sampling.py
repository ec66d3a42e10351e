"""Sampling rows one by one vs together, in the generator, on the same model: the A/B behind
torchloom/generate/sampling.py. One table, JSON to --json.

    python benchmarks/sampling.py                       # 0.5B llama3 shape, one GPU
    python benchmarks/sampling.py --shape tiny --device cpu --requests 8 --new-tokens 4

"per-row" is the draw the generator used before: for each sampling row, a softmax and a
``torch.multinomial`` with the request's own ``torch.Generator``, then a host read. "batched"
is the generator's draw now. Random weights; every request samples (temperature 1) for
--new-tokens tokens after a --prompt-len-token prompt; timed after a warm-up call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

import torchloom.generate.engine as engine
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.models import ModelConfig, build_model, resolve_model_config

SHAPES = {
    "tiny": {},
    "0.5B": {"dim": 1536, "num_layers": 20, "num_heads": 12, "num_kv_heads": 4,
             "ffn_dim": 4096, "max_seq_len": 1024},
}  # fmt: skip


def per_row_draw(states, logprobs_BV, index):
    drawn = {}
    for i, state in enumerate(states):
        params = state.request.params
        if params.temperature == 0:
            continue
        stream = torch.Generator(logprobs_BV.device)
        stream.manual_seed(state.seed + len(state.completion.tokens))
        probs_V = torch.softmax(logprobs_BV[index[i]] / params.temperature, dim=-1)
        token = int(torch.multinomial(probs_V, 1, generator=stream))
        drawn[i] = (token, logprobs_BV[index[i], token].item())
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="0.5B")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug",
                                              overrides=SHAPES[args.shape]))  # fmt: skip
    with device:
        model = build_model(config)
    model.init_weights(0)
    model.eval()
    rows, batched = [], engine._draw
    for graphs in (False, True) if device.type == "cuda" else (False,):
        generator = Generator(model, max_batch=args.requests, max_len=128, cuda_graphs=graphs)
        for name, draw in (("per-row", per_row_draw), ("batched", batched)):
            engine._draw = draw
            requests = [Request(list(range(1, args.prompt_len + 1)),
                                SamplingParams(max_new_tokens=args.new_tokens, seed=i))
                        for i in range(args.requests)]  # fmt: skip
            generator.generate(requests[:8])  # warm-up (and graph capture)
            _sync(device)
            start = time.perf_counter()
            completions = generator.generate(requests)
            _sync(device)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.tokens) for c in completions)
            rows.append({"decode": "cuda graphs" if graphs else "eager", "draw": name,
                         "tokens": tokens, "tokens_per_s": tokens / seconds})  # fmt: skip
        engine._draw = batched
    print(f"\nsampling {args.requests} requests x {args.new_tokens} tokens, {args.shape} llama3 "
          f"on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")  # fmt: skip
    for row in rows:
        print(f"  {row['decode']:<12} {row['draw']:<8} {row['tokens_per_s']:>10,.0f} tokens/s")
    if args.json:
        report = {"date": datetime.date.today().isoformat(), "args": vars(args) | {"json": None},
                  "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
