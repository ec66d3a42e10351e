"""Supervised fine-tuning recipes: chat SFT on the builtin task set, from a Hugging Face folder."""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.data.config import BUILTIN_CHAT, DataConfig
from torchloom.models.config import ModelConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig

# What `make train` (the llama3_tiny recipe with --checkpoint.export_hf) writes.
PRETRAINED_HF = "outputs/llama3_tiny/hf"


@register_recipe("sft_tiny")
def sft_tiny() -> JobConfig:
    """Chat SFT of llama3_tiny's HF export (run `make train` first) on builtin:chat_tasks."""
    return JobConfig(
        # The architecture comes from the folder's config.json; the family must match it.
        model=ModelConfig(name="llama3", flavor="debug"),
        # The folder's own tokenizer, whose chat template renders the conversations.
        data=DataConfig(format="chat", sources=[BUILTIN_CHAT], tokenizer=PRETRAINED_HF),
        training=TrainingConfig(
            steps=100,
            seq_len=256,
            global_batch_size=16,
            val_interval=25,
            val_sequences=16,
            sample_prompt="Add 12 and 30.",
        ),
        optimizer=OptimizerConfig(lr=1e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=10, decay="cosine"),
        checkpoint=CheckpointConfig(initial_load_hf=PRETRAINED_HF, export_hf=True),
        output=OutputConfig(dir="outputs/sft_tiny"),
    )
