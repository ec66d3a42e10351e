"""`torchloom train --parallel.ep` under torchrun (gloo, CPU) gives the single-process losses,
expert loads and exported model, and its checkpoint resumes on one process (DCP reshards the
experts from 2 ranks to 1).

The balance loss is a function of a micro-batch, so every run uses micro-batches of 4 sequences
(the single process accumulates two, each data rank runs one).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from torchloom.cli import main
from torchloom.models import ModelConfig, build_model, list_models, resolve_model_config

pytestmark = pytest.mark.distributed

BIAS = json.dumps({"moe.expert_bias": True, "moe.bias_update_rate": 0.01})
COMMON = ["--training.steps", "4", "--metrics.tensorboard", "false",
          "--training.sample_tokens", "0", "--training.val_sequences", "8",
          "--training.device", "cpu", "--training.seq_len", "64",
          "--training.micro_batch_size", "4", "--model.overrides", BIAS]  # fmt: skip
RECIPES = ["qwen3_moe_debug"] + (
    ["deepseek_v3_debug"] if any(s.name == "deepseek_v3" for s in list_models()) else []
)


def records(output_dir) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r or "val_loss" in r]


def losses(output_dir) -> list[float]:
    return [r.get("loss", r.get("val_loss")) for r in records(output_dir)]


def loads(output_dir) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k.startswith("expert_load")} for r in records(output_dir)
    ]


@pytest.fixture(scope="module", params=RECIPES)
def reference(request, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("single")
    args = ["train", "--recipe", request.param, *COMMON, "--output.dir", str(output_dir)]
    assert main(args) == 0
    return request.param, output_dir


def compare(reference_dir, output_dir, label: str) -> None:
    single, parallel = losses(reference_dir), losses(output_dir)
    diff = max(abs(a - b) for a, b in zip(single, parallel))
    expected = load_file(reference_dir / "model" / "model.safetensors")
    exported = load_file(output_dir / "model" / "model.safetensors")
    assert sorted(exported) == sorted(expected), sorted(set(exported) ^ set(expected))
    shapes = {k: (exported[k].shape, v.shape) for k, v in expected.items()}
    assert all(a == b for a, b in shapes.values()), shapes
    param_diff = max((exported[k] - v).abs().max().item() for k, v in expected.items())
    print(f"{label}: losses {parallel}, max |loss diff| {diff:.2e}, |param diff| {param_diff:.2e}")
    assert len(single) == len(parallel) == 6  # val before, 4 steps, val after
    assert diff < 1e-5
    assert loads(output_dir) == loads(reference_dir)  # every token counted once
    assert param_diff < 2e-5  # 4 Adam steps amplify fp32 rounding noise


def test_fsdp_ep_matches_single_process_and_resumes_on_one(tmp_path, reference, torchrun_train):
    recipe, reference_dir = reference
    run = tmp_path / "ep"
    torchrun_train(2, "--recipe", recipe, *COMMON, "--output.dir", str(run),
                   "--parallel.dp_shard", "2", "--parallel.ep", "2",
                   "--checkpoint.interval", "2")  # fmt: skip
    compare(reference_dir, run, f"{recipe} dp_shard 2 x ep 2")
    # The step-2 checkpoint holds each expert stack once, split over 2 ranks; one process
    # (ep 1) loads it whole and continues as the uninterrupted single process does.
    resumed = tmp_path / "resumed"
    shutil.copytree(run / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    args = ["train", "--recipe", recipe, *COMMON, "--output.dir", str(resumed)]
    assert main([*args, "--checkpoint.resume", "true"]) == 0
    single, after = losses(reference_dir), losses(resumed)
    diff = max(abs(a - b) for a, b in zip(single[3:], after, strict=True))
    print(f"{recipe} saved with ep 2, resumed with ep 1: losses {after}, max |diff| {diff:.2e}")
    assert diff < 1e-5


def test_fsdp_tp_ep_matches_single_process(tmp_path, reference, torchrun_train):
    recipe, reference_dir = reference
    torchrun_train(4, "--recipe", recipe, *COMMON, "--output.dir", str(tmp_path),
                   "--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.ep", "2")  # fmt: skip
    compare(reference_dir, tmp_path, f"{recipe} dp_shard 2 x tp 2 x ep 2")


def test_dry_run_splits_the_experts():
    """dp_shard 2 x tp 2 x ep 2 on 4 ranks: every weight is held once over the ranks, except
    the norms' that tensor parallelism replicates; nothing is allocated."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "torchloom", "train", "--recipe", "qwen3_moe_debug", "--parallel.dp_shard", "2",
           "--parallel.tp", "2", "--parallel.ep", "2", "--dry-run"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print(proc.stdout)
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("(bytes)")) + 1
    params = [int(line.split()[1]) for line in lines[start : start + 4]]  # rank, parameters, ...
    model = build_model(resolve_model_config(ModelConfig(name="qwen3_moe", flavor="debug")))
    total = sum(p.numel() * 4 for p in model.parameters())
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert "ep 2 (from dp_shard x cp)" in proc.stdout
    assert sum(params) == total + norms, (params, total, norms)  # norms: one copy per tp rank
    assert len(set(params)) == 1, params  # 8 experts: 2 on each (ep rank, FSDP shard)
