"""Multi-turn rollouts with a slow tool: the pipeline against turn-by-turn schedules.

64 episodes (16 prompts x 4) x 4 replies, 3 tool calls per episode that take ``--tool-s``
(1 s) each, on a tiny random llama3 on the CPU (the workload of tests/rl/test_rollout.py:
tests/rl/turns.py). Rows:

- ``pipeline``: torchloom's generate_rollouts: tools in a thread pool, each episode back to
  the generator as soon as its tool answers, each turn continuing its cache slot;
- ``turns``: the same with ``pipeline=False`` (every turn waits for all replies and tools);
- ``serial``: turn by turn with one environment thread, the tools one after another (how
  rollouts ran before the pool; about 64 x 3 x tool-s seconds).

Each row's wall time is compared with the slowest episode alone (its generation run alone plus
its tools' time); the prefilled prompt tokens are compared with prefilling each turn's whole
context. ``--tool python`` runs the sleeps in the Python sandbox (a subprocess per call).

    python benchmarks/rl_turns.py --json rl_turns.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from tests.rl.turns import (  # the workload lives beside its tests
    ByteChat,
    ScriptedPythonTool,
    SleepToolEnv,
    alone_seconds,
    prefill_counts,
    rl_config,
    tiny_model,
    tool_prompts,
)
from torchloom.generate.engine import Generator
from torchloom.rl.rollout import generate_rollouts

ROWS = {"pipeline": {"pipeline": True}, "turns": {"pipeline": False},
        "serial": {"pipeline": False, "env_workers": 1}}  # fmt: skip
MAX_LEN = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool-s", type=float, default=1.0)
    parser.add_argument("--staggered", action="store_true",
                        help="one slow call per episode (tool-s), the others tool-s / 10")  # fmt: skip
    parser.add_argument("--tool", choices=["sleep", "python"], default="sleep")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = tiny_model()
    cfg = rl_config(args.group_size, args.turns, args.max_new_tokens)
    prompts = tool_prompts(args.rollouts // args.group_size, args.turns, args.tool_s,
                           args.staggered)  # fmt: skip
    env = ScriptedPythonTool if args.tool == "python" else SleepToolEnv
    rows, reference = [], None
    for name in args.rows:
        generator = Generator(model, max_batch=args.rollouts, max_len=MAX_LEN)
        start = time.perf_counter()
        batch = generate_rollouts(generator, ByteChat(), prompts, env, cfg, seed=0, step=0,
                                  version=0, **ROWS[name])  # fmt: skip
        wall = time.perf_counter() - start
        if reference is None:
            reference = batch.rollouts
        same = [r.tokens for r in batch.rollouts] == [r.tokens for r in reference]
        rows.append({"row": name, "wall_s": wall, "prefill_tokens": generator.prefill_tokens,
                     "same_tokens": same})  # fmt: skip
    assert reference is not None
    alone = alone_seconds(model, prompts, cfg, reference, MAX_LEN, env)
    kept, whole = prefill_counts(reference, cfg.group_size)
    slowest = max(alone)
    print(f"{args.rollouts} rollouts x {args.turns} turns, tool {args.tool} {args.tool_s:g} s"
          f"{' staggered' if args.staggered else ''}; {sum(r.turns for r in reference)} replies, "
          f"{sum(r.info.get('tool_s', 0.0) for r in reference):.0f} s of tools in all")  # fmt: skip
    print(f"slowest episode alone: {slowest:.2f} s (generation alone + its tools)")
    print(f"{'row':<10} {'wall s':>8} {'x slowest':>10} {'prefilled':>10} {'same tokens':>12}")
    for row in rows:
        row["vs_slowest_alone"] = row["wall_s"] / slowest
        print(f"{row['row']:<10} {row['wall_s']:>8.2f} {row['vs_slowest_alone']:>10.2f} "
              f"{row['prefill_tokens']:>10} {row['same_tokens']!s:>12}")  # fmt: skip
    print(f"prefilling each turn's whole context instead: {whole} tokens (kept cache: {kept})")
    if args.json:
        report = {"config": vars(args) | {"json": str(args.json)}, "rows": rows,
                  "slowest_alone_s": slowest, "alone_s": alone,
                  "prefill_tokens_kept": kept, "prefill_tokens_whole": whole}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
