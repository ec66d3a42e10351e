"""Reasoning recipes: a llama3 that learns arithmetic and word problems with worked solutions.

The chain mirrors llama3_500m -> sft_500m: pre-train from scratch on ``builtin:word_problems``
(problems and their worked steps as plain text), then chat-SFT the HF export on
``builtin:word_problems_chat_mixed`` (the question as the user's message; as the reply, the
worked solution, or in half of the chats only its last line, "The answer is N."), so that the
model answers the RL task ``word_problems`` in the form its check reads. Like much instruct
data, the mix teaches two styles: worked answers, which the model gets right, and direct ones,
which it mostly cannot compute in its head. So the SFT model is right only sometimes, and RL
has a skill to learn: to work every problem out. (SFT on worked answers alone,
``builtin:word_problems_chat``, gave a model at 97.4% held-out pass@1: nothing left for RL.)
Neither data set holds a question of the held-out set (torchloom/rl/word_problems.py).
"""

from __future__ import annotations

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config import register_recipe
from torchloom.data.config import (
    BUILTIN_WORD_PROBLEMS,
    BUILTIN_WORD_PROBLEMS_CHAT_MIXED,
    DataConfig,
)
from torchloom.models.config import ModelConfig
from torchloom.rl.config import RLConfig, RLJobConfig
from torchloom.rl.evaluate import EvalConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.job import JobConfig, OutputConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig

SAMPLE_QUESTION = "What is 12 * 4 + 7?"

# 82M parameters on the built-in 4096-token vocabulary: small enough to see ~2 epochs of the
# 15.6M-token corpus in a few minutes on one H200.
_WP_BASE = {"dim": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 4, "ffn_dim": 2048,
            "max_seq_len": 1024}  # fmt: skip
# 3.1M parameters, llama3_tiny's shape: 200 steps take about 3.5 minutes on 2 idle CPU cores (120
# steps: 2 minutes, but held-out pass@1 / pass@8 fell from 0.05 / 0.11 to 0.01 / 0.04).
_WP_TINY = {"dim": 192, "num_layers": 4, "num_heads": 6, "num_kv_heads": 2, "ffn_dim": 512}
WP_BASE_HF = "outputs/wp_base/hf"
WP_SFT_HF = "outputs/wp_sft/hf"
WP_BASE_TINY_HF = "outputs/wp_base_tiny/hf"
WP_SFT_TINY_HF = "outputs/wp_sft_tiny/hf"


@register_recipe("wp_base")
def wp_base() -> JobConfig:
    """llama3 (82M) pre-trained from scratch on builtin:word_problems (one GPU, ~3 minutes)."""
    return JobConfig(
        model=ModelConfig(name="llama3", flavor="debug", overrides=dict(_WP_BASE)),
        data=DataConfig(sources=[BUILTIN_WORD_PROBLEMS]),
        training=TrainingConfig(
            steps=1200,
            seq_len=512,
            global_batch_size=64,
            val_interval=300,
            val_sequences=64,
            sample_prompt=f"Question: {SAMPLE_QUESTION}\nAnswer:\n",
        ),
        optimizer=OptimizerConfig(lr=1e-3),
        lr_schedule=LRScheduleConfig(warmup_steps=100, decay="cosine"),
        checkpoint=CheckpointConfig(export_hf=True),
        output=OutputConfig(dir="outputs/wp_base"),
    )


@register_recipe("wp_sft")
def wp_sft() -> JobConfig:
    """Chat SFT of wp_base's HF export on builtin:word_problems_chat_mixed (one GPU, about a
    minute)."""
    return JobConfig(
        # The architecture comes from the folder's config.json; the family must match it.
        model=ModelConfig(name="llama3", flavor="debug"),
        data=DataConfig(
            format="chat", sources=[BUILTIN_WORD_PROBLEMS_CHAT_MIXED], tokenizer=WP_BASE_HF
        ),
        training=TrainingConfig(
            steps=300,
            seq_len=512,
            global_batch_size=64,
            val_interval=100,
            val_sequences=64,
            sample_prompt=SAMPLE_QUESTION,
        ),
        optimizer=OptimizerConfig(lr=2e-4),
        lr_schedule=LRScheduleConfig(warmup_steps=20, decay="cosine"),
        checkpoint=CheckpointConfig(initial_load_hf=WP_BASE_HF, export_hf=True),
        output=OutputConfig(dir="outputs/wp_sft"),
    )


@register_recipe("wp_base_tiny")
def wp_base_tiny() -> JobConfig:
    """wp_base at 3.1M parameters for 2 CPU cores (about 3.5 minutes)."""
    job = wp_base()
    job.model = ModelConfig(name="llama3", flavor="debug", overrides=dict(_WP_TINY))
    job.training.steps, job.training.seq_len, job.training.global_batch_size = 200, 256, 16
    job.training.val_interval, job.training.val_sequences = 100, 32
    job.optimizer = OptimizerConfig(lr=3e-3)
    job.lr_schedule = LRScheduleConfig(warmup_steps=10, decay="cosine")
    job.output.dir = "outputs/wp_base_tiny"
    return job


@register_recipe("wp_sft_tiny")
def wp_sft_tiny() -> JobConfig:
    """wp_sft of wp_base_tiny's export for 2 CPU cores (about a minute)."""
    job = wp_sft()
    job.data.tokenizer = job.checkpoint.initial_load_hf = WP_BASE_TINY_HF
    job.training.steps, job.training.seq_len, job.training.global_batch_size = 60, 256, 16
    job.training.val_interval, job.training.val_sequences = 30, 16
    job.optimizer = OptimizerConfig(lr=1e-3)
    job.lr_schedule = LRScheduleConfig(warmup_steps=5, decay="cosine")
    job.output.dir = "outputs/wp_sft_tiny"
    return job


@register_recipe("rl_wp")
def rl_wp() -> RLJobConfig:
    """RL on word problems from wp_sft's model (built first if missing), one GPU: greedy
    held-out pass@1 every 10 updates, sampled pass@8 at the start and the end (40 updates,
    about 5 minutes on one H200)."""
    return RLJobConfig(
        model=ModelConfig(name="llama3", flavor="debug"),
        data=DataConfig(tokenizer=WP_SFT_HF),
        training=TrainingConfig(steps=40, seq_len=192, max_norm=1.0),
        optimizer=OptimizerConfig(lr=2e-5, weight_decay=0.0),
        lr_schedule=LRScheduleConfig(warmup_steps=0, decay="constant"),
        checkpoint=CheckpointConfig(initial_load_hf=WP_SFT_HF, export_hf=True),
        rl=RLConfig(
            task="word_problems",
            temperature=0.8,
            prompts_per_step=32,
            group_size=8,
            max_new_tokens=64,
            minibatches=2,
            micro_batch_size=64,
            generator_slots=256,
            max_refill_rounds=2,
            init_recipes=["wp_base", "wp_sft"],
        ),
        eval=EvalConfig(every=10, problems=500, k=8, temperature=0.8),
        output=OutputConfig(dir="outputs/rl_wp"),
    )


@register_recipe("rl_wp_tiny")
def rl_wp_tiny() -> RLJobConfig:
    """rl_wp from wp_sft_tiny's model for 2 CPU cores: the same machinery, smaller."""
    job = rl_wp()
    job.data.tokenizer = job.checkpoint.initial_load_hf = WP_SFT_TINY_HF
    job.training.steps = 40
    job.optimizer.lr = 1e-4
    job.rl.prompts_per_step, job.rl.group_size, job.rl.generator_slots = 8, 8, 64
    job.rl.init_recipes = ["wp_base_tiny", "wp_sft_tiny"]
    job.eval = EvalConfig(every=10, problems=100, k=4)
    job.output.dir = "outputs/rl_wp_tiny"
    return job
