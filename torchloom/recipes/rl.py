"""RL recipes: GRPO-family post-training with `torchloom rl`."""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.data.config import DataConfig
from torchloom.models.config import ModelConfig
from torchloom.rl.config import RLConfig, RLJobConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig

# What the sft_tiny recipe writes (it fine-tunes llama3_tiny's export: `make train`).
SFT_HF = "outputs/sft_tiny/hf"


@register_recipe("rl_debug")
def rl_debug() -> RLJobConfig:
    """GRPO on the builtin letter-count task from sft_tiny's model (trained first if missing)."""
    return RLJobConfig(
        model=ModelConfig(name="llama3", flavor="debug"),
        data=DataConfig(tokenizer=SFT_HF),
        training=TrainingConfig(steps=60, seq_len=128, max_norm=1.0),
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        lr_schedule=LRScheduleConfig(warmup_steps=0, decay="constant"),
        checkpoint=CheckpointConfig(initial_load_hf=SFT_HF),
        rl=RLConfig(
            task="letters",
            prompts_per_step=8,
            group_size=8,
            max_new_tokens=16,
            init_recipes=["llama3_tiny", "sft_tiny"],
        ),
        output=OutputConfig(dir="outputs/rl_debug"),
    )
