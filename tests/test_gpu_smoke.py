"""`make test-gpu`'s training smoke runs: every family's debug recipe trains a few steps on the
GPU through `torchloom train` (bf16 autocast, the family's kernels, MoE grouped products, the
linear-attention kernels), and RL runs a few updates. Each run must finish, log finite losses
and end lower than it started. Skipped on CPU machines (tests/conftest.py), where the same
recipes train in tests/models and tests/rl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from torchloom.cli import main

pytestmark = pytest.mark.gpu

FAMILY_RECIPES = ["debug", "qwen3_tiny", "deepseek_v3_debug", "qwen3_moe_debug",
                  "qwen3_next_debug", "qwen3_5_debug", "kimi_linear_debug", "qwen3_vl_debug",
                  "qwen3_vl_moe_debug", "kimi_k25_debug", "deepseek_v32_debug", "deepseek_v4_debug"]  # fmt: skip
QUICK = ["--metrics.tensorboard", "false", "--training.sample_tokens", "0",
         "--training.val_interval", "0", "--checkpoint.save_final_model", "false",
         "--checkpoint.export_hf", "false"]  # fmt: skip


def _records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_each_family_trains_on_the_gpu(tmp_path: Path, recipe: str) -> None:
    out = tmp_path / recipe
    assert main(["train", "--recipe", recipe, "--training.steps", "12", "--training.device",
                 "cuda", *QUICK, "--output.dir", str(out)]) == 0  # fmt: skip
    records = _records(out)
    losses = [r["loss"] for r in records]
    print(f"{recipe}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{records[-1].get('tps', 0):.0f} tok/s, {records[-1].get('mem_gib', 0):.2f} GiB")  # fmt: skip
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert records[-1]["mem_gib"] > 0  # measured on the GPU


def test_rl_updates_on_the_gpu(tmp_path: Path) -> None:
    """rl_debug's machinery on a random model (its task registered by tests/rl/common.py's
    pattern is not needed: the letters task rewards some replies of any model)."""
    out = tmp_path / "rl"
    assert main(["rl", "--recipe", "rl_debug", "--checkpoint.initial_load_hf", "",
                 "--data.tokenizer", "builtin:stdlib_bpe", "--rl.init_recipes", "[]",
                 "--rl.filter_zero_variance", "false", "--training.steps", "3",
                 "--training.device", "cuda", "--metrics.tensorboard", "false",
                 "--checkpoint.save_final_model", "false", "--output.dir", str(out)]) == 0  # fmt: skip
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["gen_tps"] > 0 for r in rows)
