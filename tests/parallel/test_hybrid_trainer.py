"""The hybrid linear-attention families' debug recipes train on the built-in data, and under
FSDP and tensor parallelism (gloo, CPU: `torchloom train --parallel.dp_shard 2`, `--parallel.tp
2`, both) give the single-process losses;
context parallelism is refused with one clear message (the linear layers' recurrent state does
not pass between ranks)."""

import json

import pytest
import torch

from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.config.recipes import get_recipe, list_recipes
from torchloom.models import build_model, resolve_model_config
from torchloom.parallel import ParallelConfig, ParallelDims
from torchloom.train.builders import check_layout

pytestmark = pytest.mark.distributed

COMMON = ["--training.steps", "3", "--metrics.tensorboard", "false",
          "--training.sample_tokens", "0", "--training.val_sequences", "8",
          "--training.device", "cpu", "--training.seq_len", "64",
          "--training.micro_batch_size", "4", "--checkpoint.save_final_model", "false"]  # fmt: skip
HYBRID = ("qwen3_next_debug", "qwen3_5_debug", "kimi_linear_debug")
RECIPES = [name for name in HYBRID if name in {r.name for r in list_recipes()}]


def losses(output_dir) -> list[float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r.get("loss", r.get("val_loss")) for r in map(json.loads, lines)
            if "loss" in r or "val_loss" in r]  # fmt: skip


# Layouts beside one process: FSDP, TP (heads of every mixer split, sequence parallel), and for
# the fused-projection model with experts both at once.
LAYOUTS = {
    "dp_shard 2": (2, ["--parallel.dp_shard", "2"]),
    "tp 2": (2, ["--parallel.tp", "2"]),
    "dp_shard 2 x tp 2": (4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp_and_tp_match_one_process(tmp_path, recipe, torchrun_train):
    single = tmp_path / "single"
    assert main(["train", "--recipe", recipe, *COMMON, "--output.dir", str(single)]) == 0
    one = losses(single)
    assert len(one) == 5 and one[-1] < one[0]  # val before, 3 steps, val after; it trains
    layouts = LAYOUTS if recipe == "qwen3_next_debug" else dict(list(LAYOUTS.items())[:2])
    for name, (nproc, flags) in layouts.items():
        out = tmp_path / name.replace(" ", "_")
        torchrun_train(nproc, "--recipe", recipe, *COMMON, "--output.dir", str(out), *flags)
        other = losses(out)
        diff = max(abs(a - b) for a, b in zip(one, other, strict=True))
        print(f"{recipe}: one process {one}, {name} {other}, max |diff| {diff:.2e}")
        assert diff < 1e-5, f"{recipe} {name}: losses differ by {diff:.2e}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_context_parallel_is_refused_clearly(recipe):
    """The layout check every build runs (train, dry run) refuses cp before anything starts."""
    job = get_recipe(recipe).build()
    with torch.device("meta"):
        model = build_model(resolve_model_config(job.model))
    dims = ParallelDims(ParallelConfig(dp_shard=1, cp=2), 2, 0, "cpu")
    with pytest.raises(ConfigError, match="--parallel.cp 2 supports grouped-query attention"):
        check_layout(model, dims)
