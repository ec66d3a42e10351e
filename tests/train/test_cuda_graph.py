"""--training.cuda_graph: refusals (CPU), float32 learning rates, and on a GPU losses bitwise
equal to the uncaptured step's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.cuda_graph import check_cuda_graph_runtime
from torchloom.train.optim import (
    LRScheduleConfig,
    OptimizerConfig,
    build_lr_scheduler,
    build_optimizer,
)
from torchloom.train.trainer import Trainer

COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8"]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--training.device", "cpu"], "needs a CUDA GPU, not --training.device cpu"),
        (["--training.skip_nonfinite", "true"], "skip_nonfinite true decides on the host"),
        (["--parallel.dp_shard", "2"], "captures a single-GPU step"),
        (["--parallel.tp", "2"], "captures a single-GPU step"),
        (["--parallel.pp", "2"], "captures a single-GPU step"),
        (["--parallel.fsdp_always", "true"], "captures a single-GPU step"),
        (["--optimizer.implementation", "foreach"], "captures a device-side AdamW"),
        (["--model.batch_invariant", "true"], "not verified with --model.batch_invariant"),
    ],
)
def test_refused_where_a_step_cannot_be_captured(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_job([*COMMON, "--training.cuda_graph", "true", *overrides])


def test_refused_at_run_time_without_a_gpu_or_with_several_processes(tmp_path) -> None:
    model = torch.nn.Linear(4, 4)
    check_cuda_graph_runtime(torch.device("cuda"), 1, model, torch.bfloat16)
    with pytest.raises(ConfigError, match="2 processes were launched"):
        check_cuda_graph_runtime(torch.device("cuda"), 2, model, torch.bfloat16)
    if torch.cuda.is_available():
        return
    _, job = resolve_job([*COMMON, "--training.cuda_graph", "true", "--output.dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="needs a CUDA GPU, but training runs on cpu"):
        Trainer(job)


def test_refused_for_experts_that_run_as_a_loop() -> None:
    """An MoE step whose expert matmuls loop (fp32, batch-invariant, no grouped matmul here:
    kernels/grouped_mm.py) reads row counts on the host; it is refused before capture."""
    config = resolve_model_config(ModelConfig(name="qwen3_moe", flavor="debug"))
    model = build_model(config)
    with pytest.raises(ConfigError, match=r"experts \(layers.0.mlp.experts\) run as a loop"):
        check_cuda_graph_runtime(torch.device("cuda"), 1, model, torch.float32)


def test_learning_rates_are_float32_values() -> None:
    """A captured step reads its rate from a float32 tensor; eager steps use the same value."""
    optimizer = build_optimizer(
        torch.nn.Linear(4, 4), OptimizerConfig(lr=3e-4), torch.device("cpu")
    )
    scheduler = build_lr_scheduler(optimizer, LRScheduleConfig(warmup_steps=3), 20)
    for _ in range(20):
        lr = optimizer.param_groups[0]["lr"]
        assert isinstance(lr, float) and float(np.float32(lr)) == lr, lr
        optimizer.step()
        scheduler.step()


def _run(tmp_path, name: str, *overrides: str) -> tuple[Trainer, list[dict]]:
    _, job = resolve_job(
        [*COMMON, "--output.dir", str(tmp_path / name), "--training.device", "cuda",
         "--training.deterministic", "true", "--training.steps", "8",
         "--training.val_interval", "4", *overrides]
    )  # fmt: skip
    trainer = Trainer(job)
    trainer.train()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return trainer, [json.loads(line) for line in lines]


def _numbers(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["--training.micro_batch_size", "4"],
        ["--optimizer.implementation", "triton"],
        ["--compile.enabled", "true"],
        ["--compile.enabled", "true", "--training.micro_batch_size", "4"],
    ],
    ids=["one-micro-batch", "two-micro-batches", "triton-adamw", "compiled", "compiled-two-micro"],
)
def test_captured_steps_give_bitwise_the_eager_losses(tmp_path, overrides: list[str]) -> None:
    _, eager = _run(tmp_path, "eager", *overrides)
    trainer, graphed = _run(tmp_path, "graph", "--training.cuda_graph", "true", *overrides)
    step_graph = trainer.train_step.graph
    assert step_graph is not None and step_graph.graph is not None, "steps 4-8 were replayed"
    assert len(step_graph.static_batches) == trainer.train_loader.grad_accum_steps
    print(f"eager: {_numbers(eager)}\ngraph: {_numbers(graphed)}")
    assert _numbers(graphed) == _numbers(eager)
