"""What the RL loop tests share: a task registered in a few lines, as a user's would be (a reply
earns 1 when it has an even number of characters, which a random model's replies do about half
the time, so groups have rewards to compare and steps update the policy), the command line of
a tiny run on it, and the metrics a run writes."""

from __future__ import annotations

import json
from pathlib import Path

from torchloom.rl.env import Prompt
from torchloom.rl.tasks import TASKS, Check, register_task


def _even_length(reply: str, answer: object) -> Check:
    return Check(format_ok=True, correct=len(reply) % 2 == 0)


if "even_length" not in TASKS:
    register_task("even_length", lambda rng: Prompt(f"Say a word ({rng.randrange(100)}).",
                                                   meta={"task": "even_length"}), _even_length)  # fmt: skip

BASE = ["--recipe", "rl_debug", "--checkpoint.initial_load_hf", "", "--data.tokenizer",
        "builtin:stdlib_bpe", "--rl.init_recipes", "[]", "--rl.task", "even_length",
        "--rl.prompts_per_step", "2", "--rl.group_size", "4", "--rl.max_new_tokens", "6",
        "--training.seq_len", "64", "--metrics.tensorboard", "false",
        "--checkpoint.save_final_model", "false", "--optimizer.lr", "1e-3"]  # fmt: skip
KEYS = {"step", "reward_mean", "reward_max", "response_len_mean", "logprob_diff_max", "kl",
        "clip_frac", "policy_lag", "gen_tps", "train_tps", "weight_sync_s", "time_generate_s",
        "time_train_s", "time_sync_s", "loss", "grad_norm", "lr"}  # fmt: skip


def records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward_mean" in r]
