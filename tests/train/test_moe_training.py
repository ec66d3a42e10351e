"""Training MoE models: the expert bias moves and is checkpointed (a resumed run continues
bitwise), loads and the balance loss are logged, recomputation counts each token once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from torchloom.cli import main
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.config import TrainingConfig

COMMON = ["--recipe", "qwen3_moe_debug", "--metrics.tensorboard", "false",
          "--training.sample_tokens", "0", "--training.val_sequences", "8",
          "--training.device", "cpu", "--training.seq_len", "64",
          "--model.overrides", json.dumps({"moe.expert_bias": True, "moe.bias_update_rate": 0.01})]  # fmt: skip


def train(output_dir: Path, *flags: str) -> list[dict]:
    assert main(["train", *COMMON, "--output.dir", str(output_dir), *flags]) == 0
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("moe") / "run"
    return out, train(out, "--training.steps", "8", "--checkpoint.interval", "4")


def test_step_records_carry_loads_and_the_balance_loss(uninterrupted) -> None:
    _, records = uninterrupted
    for record in records:
        assert record["aux_balance"] > 0
        for layer in ("0", "1"):
            low, high = record[f"expert_load/{layer}/min"], record[f"expert_load/{layer}/max"]
            assert 0 <= low <= high and record[f"expert_load/{layer}/cv"] >= 0
    # 8 sequences x 64 tokens x top-2 pairs per step, spread over the 8 experts of a layer.
    assert records[0]["expert_load/0/min"] <= 8 * 64 * 2 / 8 <= records[0]["expert_load/0/max"]


def test_expert_bias_moves_and_resume_continues_bitwise(uninterrupted, tmp_path) -> None:
    full_dir, full = uninterrupted
    with safe_open(full_dir / "model/model.safetensors", "pt") as f:
        bias = f.get_tensor("layers.0.mlp.router.expert_bias")
    assert bias.abs().max() > 0  # the updates happened and were saved
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints/step-4", out / "checkpoints/step-4")
    resumed = train(out, "--training.steps", "8", "--checkpoint.resume", "true")
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    for ours, theirs in zip(resumed, full[4:], strict=True):
        assert ours["loss"] == theirs["loss"]  # bitwise
        assert ours["expert_load/1/cv"] == theirs["expert_load/1/cv"]


def test_recomputation_counts_each_token_once(uninterrupted, tmp_path) -> None:
    _, full = uninterrupted
    remat = train(tmp_path / "remat", "--training.steps", "2", "--remat.mode", "full")
    for ours, theirs in zip(remat, full[:2], strict=True):
        for key in ("expert_load/0/min", "expert_load/0/max", "expert_load/1/max"):
            assert ours[key] == theirs[key], key


def test_deepseek_v3_balances_its_layers_and_keeps_the_mtp_bias(tmp_path) -> None:
    """deepseek_v3_debug (sigmoid routing with the choice bias, an MTP depth with its own MoE
    layer): the decoder's MoE layers are balanced and logged; the MTP depth's bias, past the
    layers, stays as initialized."""
    out = tmp_path / "ds"
    flags = [*COMMON[2:], "--recipe", "deepseek_v3_debug", "--training.steps", "3",
             "--output.dir", str(out)]  # fmt: skip
    assert main(["train", *flags]) == 0
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]  # fmt: skip
    assert {"expert_load/1/cv", "expert_load/2/cv"} <= set(records[-1])
    assert not any(k.startswith("expert_load/3/") for k in records[-1])  # the MTP depth's
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        assert f.get_tensor("layers.1.mlp.router.expert_bias").abs().max() > 0
        assert f.get_tensor("mtp.layers.3.block.mlp.router.expert_bias").abs().max() == 0


def test_kimi_linear_debug_trains_on_packed_documents(tmp_path) -> None:
    """kimi_linear_debug (KDA and NoPE MLA layers, sigmoid routing with the choice bias) on
    packed documents (each restarts KDA's recurrence): the loss falls, the MoE layers are
    balanced and logged, and their bias moves."""
    out = tmp_path / "kimi"
    flags = [*COMMON[2:-2], "--recipe", "kimi_linear_debug", "--training.steps", "6",
             "--output.dir", str(out)]  # fmt: skip
    assert main(["train", *flags]) == 0
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]  # fmt: skip
    print(f"kimi_linear_debug loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    assert records[-1]["loss"] < records[0]["loss"]
    assert {"expert_load/1/cv", "expert_load/3/cv"} <= set(records[-1])
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        assert f.get_tensor("layers.1.mlp.router.expert_bias").abs().max() > 0


def test_deepseek_v32_debug_loss_falls_and_logs_the_indexer_kl(tmp_path) -> None:
    """deepseek_v32_debug (sparse attention over 32 picks of 64 tokens, the indexers trained by
    their KL loss): the loss falls and aux_indexer_kl is logged; with the dsa_warmup transform
    only the indexers change."""
    out = tmp_path / "v32"
    flags = [*COMMON[2:-2], "--recipe", "deepseek_v32_debug", "--training.steps", "6",
             "--output.dir", str(out)]  # fmt: skip
    assert main(["train", *flags]) == 0
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]  # fmt: skip
    print(f"deepseek_v32_debug loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}, "
          f"indexer KL {records[0]['aux_indexer_kl']:.2e} -> {records[-1]['aux_indexer_kl']:.2e}")  # fmt: skip
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["aux_indexer_kl"] > 0 for r in records)
    warm = tmp_path / "warm"
    flags = [*COMMON[2:-2], "--recipe", "deepseek_v32_debug", "--training.steps", "2",
             "--model.transforms", '["dsa_warmup"]', "--output.dir", str(warm)]  # fmt: skip
    assert main(["train", *flags]) == 0
    initial = build_model(resolve_model_config(
        ModelConfig(name="deepseek_v32", flavor="debug", transforms=["dsa_warmup"])))  # fmt: skip
    initial.init_weights(TrainingConfig().seed)
    with safe_open(warm / "model" / "model.safetensors", "pt") as f:
        for name, tensor in initial.state_dict().items():
            moved = not torch.equal(f.get_tensor(name), tensor)
            assert moved == (".indexer." in name), name


def test_deepseek_v4_debug_trains_on_packed_documents(tmp_path) -> None:
    """deepseek_v4_debug (sliding, compressed sparse and heavily compressed attention over
    hyper-connected streams; a hash-routed MoE layer, then sqrt-softplus routing with the choice
    bias) on packed documents: the loss falls and the routed layers' bias moves."""
    out = tmp_path / "v4"
    flags = [*COMMON[2:-2], "--recipe", "deepseek_v4_debug", "--training.steps", "6",
             "--output.dir", str(out)]  # fmt: skip
    assert main(["train", *flags]) == 0
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "loss" in r]  # fmt: skip
    print(f"deepseek_v4_debug loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    assert records[-1]["loss"] < records[0]["loss"]
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        assert f.get_tensor("layers.1.mlp.router.expert_bias").abs().max() > 0
        assert f.get_tensor("layers.0.mlp.router.tid2eid").shape == (4096, 6)
