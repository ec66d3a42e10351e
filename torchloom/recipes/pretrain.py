"""Pre-training recipes on the built-in English corpus (Python's own documentation)."""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.models.config import ModelConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig

# A 3.1M-parameter llama3 (2.4M with tied embeddings, as qwen3_tiny has) that learns visibly in a few minutes on 2 CPU cores.
_TINY = {"dim": 192, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2, "ffn_dim": 512}


@register_recipe("debug")
def debug() -> JobConfig:
    """Tiny llama3 on the built-in corpus: seconds on a CPU, for tests and smoke runs."""
    return JobConfig(
        model=ModelConfig(name="llama3", flavor="debug"),
        training=TrainingConfig(steps=50, seq_len=128, global_batch_size=8, val_sequences=16),
        optimizer=OptimizerConfig(lr=3e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=5),
        output=OutputConfig(dir="outputs/debug"),
    )


@register_recipe("llama3_tiny")
def llama3_tiny() -> JobConfig:
    """llama3 (3.1M params) on the built-in corpus: a few minutes on 2 CPU cores, learns."""
    return JobConfig(
        model=ModelConfig(name="llama3", flavor="debug", overrides=dict(_TINY)),
        training=TrainingConfig(
            steps=120,
            seq_len=256,
            global_batch_size=32,
            val_interval=40,
            val_sequences=64,
            sample_prompt="This module provides",
        ),
        optimizer=OptimizerConfig(lr=2e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay="cosine"),
        # The HF export is what the sft_tiny recipe fine-tunes.
        checkpoint=CheckpointConfig(export_hf=True),
        output=OutputConfig(dir="outputs/llama3_tiny"),
    )


@register_recipe("qwen3_tiny")
def qwen3_tiny() -> JobConfig:
    """qwen3 (QK-norm, tied embeddings, 2.4M params) shaped like llama3_tiny, same data."""
    job = llama3_tiny()
    job.model = ModelConfig(name="qwen3", flavor="debug", overrides={**_TINY, "head_dim": 32})
    job.output.dir = "outputs/qwen3_tiny"
    return job
