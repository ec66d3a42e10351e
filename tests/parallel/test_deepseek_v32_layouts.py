"""deepseek_v32 (DeepSeek sparse attention, the indexers trained by their KL loss) under
torchrun (gloo, CPU): FSDP x expert parallelism gives the single-process losses, indexer KL and
exported model, in the sparse stage and in the warm-up (every parameter but the indexers'
frozen). Micro-batches of 4 sequences everywhere (the single process accumulates two, each
data rank runs one), as in test_expert_parallel_trainer.py."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from torchloom.cli import main

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "deepseek_v32_debug", "--training.steps", "3",
          "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--training.device", "cpu",
          "--training.seq_len", "64", "--training.micro_batch_size", "4"]  # fmt: skip
STAGES = {"sparse": [], "warmup": ["--model.transforms", '["dsa_warmup"]']}


def _records(output_dir) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.parametrize("stage", list(STAGES))
def test_fsdp_ep_matches_single_process(stage, tmp_path, torchrun_train) -> None:
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    assert main(["train", *COMMON, *STAGES[stage], "--output.dir", str(single)]) == 0
    torchrun_train(2, *COMMON, *STAGES[stage], "--output.dir", str(parallel),
                   "--parallel.dp_shard", "2", "--parallel.ep", "2")  # fmt: skip
    ours, theirs = _records(parallel), _records(single)
    assert len(ours) == len(theirs) == 3
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs))
    kl_diff = max(abs(a["aux_indexer_kl"] - b["aux_indexer_kl"]) for a, b in zip(ours, theirs))
    expected = load_file(single / "model" / "model.safetensors")
    exported = load_file(parallel / "model" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    param_diff = max((exported[k] - v).abs().max().item() for k, v in expected.items())
    print(f"deepseek_v32 {stage}, dp_shard 2 x ep 2: max |loss diff| {loss_diff:.2e}, "
          f"|indexer KL diff| {kl_diff:.2e}, |param diff| {param_diff:.2e}")  # fmt: skip
    assert loss_diff < 1e-5 and kl_diff < 1e-6 and param_diff < 2e-5
