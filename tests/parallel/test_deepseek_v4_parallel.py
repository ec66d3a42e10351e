"""deepseek_v4_debug under FSDP and expert parallelism (gloo, CPU) gives the single-process
losses; pipeline and context parallelism are refused with one clear message (tensor
parallelism too: the family declares no plan, which the model builder refuses by name)."""

import json

import pytest
import torch

import torchloom.recipes  # noqa: F401  (registers the recipes)
from torchloom.cli import main
from torchloom.config.errors import ConfigError
from torchloom.config.recipes import get_recipe
from torchloom.models import build_model, resolve_model_config
from torchloom.parallel import ParallelConfig, ParallelDims
from torchloom.train.builders import check_layout

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "deepseek_v4_debug", "--training.steps", "3",
          "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--training.device", "cpu", "--training.seq_len", "64",
          "--training.micro_batch_size", "4", "--checkpoint.save_final_model", "false"]  # fmt: skip


def losses(output_dir) -> list[float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r.get("loss", r.get("val_loss")) for r in map(json.loads, lines)
            if "loss" in r or "val_loss" in r]  # fmt: skip


def test_fsdp_and_expert_parallel_match_one_process(tmp_path, torchrun_train) -> None:
    single = tmp_path / "single"
    assert main(["train", *COMMON, "--output.dir", str(single)]) == 0
    one = losses(single)
    assert len(one) == 5 and one[-1] < one[0]
    for name, flags in {"dp_shard 2": ["--parallel.dp_shard", "2"],
                        "ep 2 x dp_shard 2": ["--parallel.ep", "2", "--parallel.dp_shard", "2"]}.items():  # fmt: skip
        out = tmp_path / name.replace(" ", "_")
        torchrun_train(2, *COMMON, "--output.dir", str(out), *flags)
        other = losses(out)
        diff = max(abs(a - b) for a, b in zip(one, other, strict=True))
        print(f"deepseek_v4_debug: one process {one}, {name} {other}, max |diff| {diff:.2e}")
        assert diff < 1e-5, f"{name}: losses differ by {diff:.2e}"


@pytest.mark.parametrize(
    ("axis", "message"),
    [("cp", "supports grouped-query attention layers only"), ("pp", "cannot split a DeepSeekV4")],
)
def test_context_and_pipeline_parallel_are_refused(axis, message) -> None:
    job = get_recipe("deepseek_v4_debug").build()
    with torch.device("meta"):
        model = build_model(resolve_model_config(job.model))
    dims = ParallelDims(ParallelConfig(dp_shard=1, **{axis: 2}), 2, 0, "cpu")
    with pytest.raises(ConfigError, match=message):
        check_layout(model, dims)
