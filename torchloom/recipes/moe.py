"""Mixture-of-experts and hybrid linear-attention recipes on the built-in English corpus: small
enough for a CPU."""

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


@register_recipe("deepseek_v32_debug")
def deepseek_v32_debug() -> JobConfig:
    """deepseek_v32's debug flavor (deepseek_v3_debug with DeepSeek sparse attention: each
    query attends to the 32 keys its lightning indexer picks out of up to 128, the indexer
    trained by its KL loss, logged as aux_indexer_kl) on the built-in corpus: seconds on a CPU.
    Add --model.transforms '["dsa_warmup"]' for the dense warm-up of the indexers alone."""
    job = deepseek_v3_debug()
    job.model = ModelConfig(name="deepseek_v32", flavor="debug")
    job.output.dir = "outputs/deepseek_v32_debug"
    return job


@register_recipe("deepseek_v4_debug")
def deepseek_v4_debug() -> JobConfig:
    """deepseek_v4's debug flavor (a sliding-window, a compressed sparse and a heavily compressed
    attention layer over 4-wide hyper-connected streams; the first MoE layer hash-routed, the
    others by sqrt-softplus scores with the balancing bias) on the built-in corpus: seconds on
    a CPU."""
    return JobConfig(
        model=ModelConfig(name="deepseek_v4", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/deepseek_v4_debug"),
    )


@register_recipe("kimi_linear_debug")
def kimi_linear_debug() -> JobConfig:
    """kimi_linear's debug flavor (3 Kimi Delta Attention layers and 1 NoPE MLA layer, 1 dense
    + 3 MoE layers of 8 experts with a shared expert and the balancing bias) on the built-in
    corpus: seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="kimi_linear", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/kimi_linear_debug"),
    )


@register_recipe("qwen3_next_debug")
def qwen3_next_debug() -> JobConfig:
    """qwen3_next's debug flavor (3 Gated DeltaNet layers and 1 gated attention layer, MoE of 8
    experts with a gated shared expert) on the built-in corpus: seconds on a CPU."""
    return JobConfig(
        model=ModelConfig(name="qwen3_next", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/qwen3_next_debug"),
    )


@register_recipe("qwen3_5_debug")
def qwen3_5_debug() -> JobConfig:
    """qwen3_5's debug flavor (the dense Qwen3.5 text decoder: 3 Gated DeltaNet layers, then 1
    gated attention layer, SwiGLU feed-forwards) on the built-in corpus: seconds on a CPU."""
    job = qwen3_next_debug()
    job.model = ModelConfig(name="qwen3_5", flavor="debug")
    job.output.dir = "outputs/qwen3_5_debug"
    return job
