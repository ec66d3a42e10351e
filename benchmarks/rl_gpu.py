"""The RL chain on one GPU: the RL recipe's starting model built by its own recipes
(pre-training, then chat SFT) when missing, then GRPO; one table of the reward curve, the time
split and tokens/s, JSON to --json.

    python benchmarks/rl_gpu.py --json rl_gpu.json                      # rl_gpu: 0.5B, one H200
    python benchmarks/rl_gpu.py --recipe rl_debug --json rl.json -- --training.steps 10   # CPU

Arguments after ``--`` override the RL recipe's fields as on the `torchloom rl` command line.
The reward curve is the mean reward of each tenth of the run's steps; ``first``/``last`` are
the first and last fifth, as `torchloom rl` reports them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from torchloom.cli import resolve_job
from torchloom.rl.loop import RLRunner, prepare_initial_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="rl_gpu")
    parser.add_argument("--json", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    overrides = [a for a in overrides if a != "--"]
    _, job = resolve_job(["--recipe", args.recipe, *overrides])
    setup_s = prepare_initial_model(job)
    began = time.perf_counter()
    trainer = RLRunner(job)
    result = trainer.train()
    rl_s = time.perf_counter() - began
    lines = (Path(job.output.dir) / "metrics.jsonl").read_text().splitlines()
    records = list(map(json.loads, lines))
    rows = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_pass@1" in r]
    tenth = max(1, len(rows) // 10)
    curve = [statistics.mean(r["reward_mean"] for r in rows[i : i + tenth])
             for i in range(0, len(rows), tenth)]  # fmt: skip
    total = {k: sum(r[k] for r in rows) for k in ("time_generate_s", "time_train_s",
                                                    "time_sync_s")}  # fmt: skip
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "recipe": args.recipe, "overrides": overrides, "steps": len(rows),
        "params_m": trainer.model_config.num_params() / 1e6,
        "setup_recipes_s": setup_s, "rl_wall_s": rl_s,
        "reward_first_fifth": result["reward_first"], "reward_last_fifth": result["reward_last"],
        "reward_curve": curve, "time_split_s": total,
        "gen_tps_median": statistics.median(r["gen_tps"] for r in rows),
        "train_tps_median": statistics.median(r["train_tps"] for r in rows),
        "response_len_mean": statistics.mean(r["response_len_mean"] for r in rows),
        "logprob_diff_max": max(r["logprob_diff_max"] for r in rows),
        "mem_gib_max": max(r.get("mem_gib") or 0.0 for r in rows),
        # Eval: greedy held-out pass@1 over the run, sampled pass@k at the start and the end.
        "eval_pass1": [(r["step"], r["eval_pass@1"]) for r in evals],
        "eval_passk": [(r["step"], {k: v for k, v in r.items() if k.startswith("eval_pass@")})
                       for r in evals if any(k.startswith("eval_pass@") and k != "eval_pass@1"
                                             for k in r)],
        "eval_s": sum(r.get("time_eval_s", 0.0) for r in evals),
        # Dynamic sampling and the step's time split (medians over steps).
        "groups_full_frac": statistics.mean(
            float(r["groups_kept"] >= job.rl.prompts_per_step) for r in rows),
        "refill_rounds_mean": statistics.mean(r.get("refill_rounds", 0) for r in rows),
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        "rollout_s_median": statistics.median(r.get("time_rollout_s", 0.0) for r in rows),
        "train_s_median": statistics.median(r["time_train_s"] for r in rows),
        "clip_frac_mean": statistics.mean(r["clip_frac"] for r in rows),
        "max_offpolicy_steps": job.rl.max_offpolicy_steps,
    }  # fmt: skip
    slowest = max(report["rollout_s_median"], report["train_s_median"])
    report["step_over_max"] = report["step_s_median"] / max(slowest, 1e-9)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def print_table(report: dict) -> None:
    print(f"\nRL chain: {report['recipe']} ({report['params_m']:.0f}M params) on "
          f"{report['device']}, {report['steps']} updates")  # fmt: skip
    for name, seconds in report["setup_recipes_s"].items():
        print(f"  built first: {name:<14} {seconds:8.1f} s")
    print(f"  RL wall time             {report['rl_wall_s']:8.1f} s")
    split = report["time_split_s"]
    print(f"  time split: generate {split['time_generate_s']:.1f} s, train "
          f"{split['time_train_s']:.1f} s, weight sync {split['time_sync_s']:.1f} s")  # fmt: skip
    print(f"  tokens/s: generate {report['gen_tps_median']:,.0f}, train "
          f"{report['train_tps_median']:,.0f} (medians over steps)")  # fmt: skip
    print(f"  reward: first fifth {report['reward_first_fifth']:.3f} -> last fifth "
          f"{report['reward_last_fifth']:.3f}")  # fmt: skip
    print("  reward by tenth: " + " ".join(f"{r:.3f}" for r in report["reward_curve"]))
    print(f"  step time (median) {report['step_s_median']:.2f} s = "
          f"{report['step_over_max']:.2f} x max(generate {report['rollout_s_median']:.2f} s, "
          f"train {report['train_s_median']:.2f} s); max_offpolicy_steps "
          f"{report['max_offpolicy_steps']}")  # fmt: skip
    print(f"  dynamic sampling: full batch on {100 * report['groups_full_frac']:.0f}% of steps, "
          f"{report['refill_rounds_mean']:.2f} refill rounds per step; clip_frac "
          f"{report['clip_frac_mean']:.3f}")  # fmt: skip
    if report["eval_pass1"]:
        print("  held-out pass@1 (greedy) by step: "
              + " ".join(f"{s}:{v:.3f}" for s, v in report["eval_pass1"])
              + f" ({report['eval_s']:.1f} s of evaluation)")  # fmt: skip
    for step, values in report["eval_passk"]:
        print(f"  step {step}: " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in values.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
