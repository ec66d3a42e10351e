"""RL recipes: GRPO-family post-training with `torchloom rl`."""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.data.config import DataConfig
from torchloom.models.config import ModelConfig
from torchloom.recipes.pretrain import llama3_tiny
from torchloom.recipes.sft import sft_tiny
from torchloom.rl.config import RLConfig, RLJobConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
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
            max_refill_rounds=0,  # 2 CPU cores: refills would multiply the generation time
            init_recipes=["llama3_tiny", "sft_tiny"],
        ),
        output=OutputConfig(dir="outputs/rl_debug"),
    )


# A 0.5B llama3 on the built-in tokenizer's 4096-token vocabulary (516M parameters): big enough
# to take the GPU seriously, small enough that pre-training, SFT and RL fit in minutes on one.
_HALF_B = {"dim": 1536, "num_layers": 20, "num_heads": 12, "num_kv_heads": 4, "ffn_dim": 4096,
           "max_seq_len": 1024}  # fmt: skip
BASE_500M_HF = "outputs/llama3_500m/hf"
SFT_500M_HF = "outputs/sft_500m/hf"


@register_recipe("llama3_500m")
def llama3_500m() -> JobConfig:
    """llama3 at 0.5B on the built-in corpus (one GPU, ~2 minutes): rl_gpu's base model."""
    job = llama3_tiny()
    job.model = ModelConfig(name="llama3", flavor="debug", overrides=dict(_HALF_B))
    job.training = TrainingConfig(steps=300, seq_len=512, global_batch_size=32, val_interval=100,
                                  val_sequences=64, sample_prompt="This module provides")  # fmt: skip
    job.optimizer = OptimizerConfig(lr=6e-4)
    job.output.dir = "outputs/llama3_500m"
    return job


@register_recipe("sft_500m")
def sft_500m() -> JobConfig:
    """Chat SFT of llama3_500m's HF export on builtin:chat_tasks (one GPU, about a minute)."""
    job = sft_tiny()
    job.model = ModelConfig(name="llama3", flavor="debug")
    job.data.tokenizer = BASE_500M_HF
    job.checkpoint.initial_load_hf = BASE_500M_HF
    job.training.steps, job.training.global_batch_size = 300, 32
    job.optimizer = OptimizerConfig(lr=1e-4)
    job.output.dir = "outputs/sft_500m"
    return job


@register_recipe("rl_gpu")
def rl_gpu() -> RLJobConfig:
    """GRPO at 0.5B on countdown (not in the SFT set), on one GPU: pre-training and SFT first."""
    job = rl_debug()
    job.data.tokenizer = job.checkpoint.initial_load_hf = SFT_500M_HF
    job.training = TrainingConfig(steps=150, seq_len=128, max_norm=1.0)
    job.optimizer = OptimizerConfig(lr=1e-5, weight_decay=0.0)
    # The SFT model already answers the letter-count task (0.94 reward from the first update,
    # benchmarks/RESULTS.md); countdown starts at 0, and its format reward gives a signal.
    job.rl = RLConfig(task="countdown", format_reward=0.1, prompts_per_step=16, group_size=8,
                      max_new_tokens=24, micro_batch_size=32, generator_slots=512,
                      # Early on 1-3% of groups vary (the model rarely writes a valid
                      # expression), late ~2% (every reply well-formed, rewards equal): up
                      # to 10 refill rounds, each sized by that rate (rl/sources.py).
                      max_refill_rounds=10,
                      init_recipes=["llama3_500m", "sft_500m"])  # fmt: skip
    job.output.dir = "outputs/rl_gpu"
    return job
