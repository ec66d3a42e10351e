"""Mixture-of-experts recipes on the built-in English corpus: small enough for a CPU."""

from __future__ import annotations

from torchloom.config import register_recipe
from torchloom.models.config import ModelConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig


@register_recipe("qwen3_moe_debug")
def qwen3_moe_debug() -> JobConfig:
    """qwen3_moe's debug flavor (2 MoE layers of 8 experts, top-2) on the built-in corpus:
    seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="qwen3_moe", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/qwen3_moe_debug"),
    )


@register_recipe("deepseek_v3_debug")
def deepseek_v3_debug() -> JobConfig:
    """deepseek_v3's debug flavor (multi-head latent attention, 1 dense + 2 MoE layers of 8
    experts in 2 groups with a shared expert and the balancing bias, one MTP depth) on the
    built-in corpus: seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="deepseek_v3", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/deepseek_v3_debug"),
    )
