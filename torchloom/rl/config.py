"""The job of `torchloom rl`: the training job's sections (model, data for the tokenizer,
training for steps / device / seed, optimizer, lr schedule, checkpoint, metrics, output) plus
the ``rl`` section below. ``--training.steps`` counts policy updates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchloom.config.errors import ConfigError
from torchloom.train.job import JobConfig


@dataclass
class RLConfig:
    task: str = "arithmetic"
    """Built-in task the prompts, environment and reward come from (torchloom/rl/tasks.py:
    arithmetic, sort, countdown, mixed; python_tool: the sandboxed Python tool environment)."""
    prompts_per_step: int = 4
    """Prompts per policy update."""
    group_size: int = 8
    """Rollouts per prompt (GRPO's group); advantages are relative within a group."""
    max_new_tokens: int = 32
    """Tokens the model may generate per turn."""
    max_turns: int = 1
    """Replies per rollout for multi-turn environments (1: a single answer)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (log-probs are those of the model itself)."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts (1: the whole distribution)."""
    format_reward: float = 0.0
    """Reward of a reply in the checked format with a wrong value (correct: 1, unparsable: 0)."""
    max_offpolicy_steps: int = 0
    """How many policy updates a rollout may lag behind the policy that trains on it: 0 =
    synchronous and exactly on-policy; k > 0 lets generation run ahead, overlapping training."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """Where the generator runs. colocated: on the trainer's device (one process), sharing its
    very parameters when on-policy (weight sync is nothing; with lag, an in-place device copy).
    disaggregated: on the last ``generator_ranks`` processes of the torchrun job, the others
    training (with --parallel.dp_shard / tp); weights go over torch.distributed after each
    update (docs/rl.md)."""
    generator_ranks: int = 1
    """With disaggregated placement: how many processes generate, each with a whole copy of
    the model and its share of the step's prompts."""
    sync_bucket_mb: int = 256
    """With disaggregated placement: weights travel in flat buckets of up to this many MiB."""
    normalize_std: bool = True
    """GRPO advantages divided by the group's reward std (false: Dr. GRPO, centred only)."""
    filter_zero_variance: bool = True
    """Drop groups whose rollouts all got the same reward (no signal; DAPO's dynamic
    filtering) from the update."""
    clip_low: float = 0.2
    """PPO ratio clip below 1: ratios under 1 - clip_low stop pushing a negative advantage."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (clip-higher: DAPO's 0.28 keeps exploration alive)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO / GRPO / DAPO) or per sequence (GSPO)."""
    loss_normalization: Literal["token", "sequence", "constant"] = "token"
    """How token losses are averaged: every response token of the batch equally (DAPO), per
    sequence then over sequences (GRPO), or by a constant (Dr. GRPO: max_new_tokens)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to a frozen copy of the initial policy (0: no reference)."""
    tis_cap: float = 2.0
    """Truncated importance sampling cap on trainer / generator probability ratios when they
    can differ (batch-invariant mode off, or lagging rollouts); 0 disables the correction."""
    micro_batch_size: int = 16
    """Rollouts per trainer forward (the update accumulates over the step's rollouts)."""
    generator_slots: int = 64
    """Rollouts the generator decodes at once (cache slots)."""
    init_recipes: list[str] = field(default_factory=list)
    """Training recipes that build the starting model, run in order (each with its own output
    folder) when --checkpoint.initial_load_hf does not exist yet; e.g. pre-training, then SFT."""

    def validate(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "max_turns",
                     "micro_batch_size", "generator_slots", "generator_ranks",
                     "sync_bucket_mb"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"--rl.{name} must be at least 1; got {getattr(self, name)}.")
        if self.max_offpolicy_steps < 0:
            raise ConfigError(
                f"--rl.max_offpolicy_steps must be >= 0 (0: synchronous); got "
                f"{self.max_offpolicy_steps}."
            )
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError(
                f"--rl.clip_low must be in [0, 1) and --rl.clip_high >= 0; got {self.clip_low} "
                f"and {self.clip_high}."
            )
        if self.temperature <= 0:
            raise ConfigError(
                f"--rl.temperature must be > 0 for rollouts (greedy rollouts of a group are all "
                f"alike); got {self.temperature}."
            )
        if self.group_size < 2:
            raise ConfigError(
                "--rl.group_size must be at least 2: advantages are relative within a group."
            )
        if self.kl_coef < 0 or self.tis_cap < 0:
            raise ConfigError("--rl.kl_coef and --rl.tis_cap must be >= 0.")


@dataclass
class RLJobConfig(JobConfig):
    rl: RLConfig = field(default_factory=RLConfig)

    def validate(self) -> None:
        super().validate()
        p, r = self.parallel, self.rl
        if r.placement == "colocated" and max(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp,
                                                 p.ep) > 1:  # fmt: skip
            raise ConfigError(
                "Colocated RL runs the trainer and the generator on one device; set every "
                "--parallel degree to 1, or use --rl.placement disaggregated to train on several "
                "ranks (data or tensor parallel) beside generator ranks."
            )
        if r.placement == "disaggregated":
            unsupported = {"dp_replicate": p.dp_replicate, "cp": p.cp, "pp": p.pp, "ep": p.ep}
            unsupported = {name: v for name, v in unsupported.items() if v > 1}
            if unsupported:
                name, value = next(iter(unsupported.items()))
                raise ConfigError(
                    f"Disaggregated RL trains with --parallel.dp_shard and --parallel.tp; "
                    f"--parallel.{name} {value} is not supported there yet. Set it to 1."
                )
            if r.kl_coef > 0:
                raise ConfigError(
                    "--rl.kl_coef > 0 (a frozen reference model) is not supported with "
                    "disaggregated placement yet; use colocated placement or --rl.kl_coef 0."
                )
        if self.compile.enabled:
            raise ConfigError(
                "torchloom rl runs the trainer's modules in the generator too; with regional "
                "compile each decode shape would recompile. Set --compile.enabled false."
            )
        if self.rl.max_new_tokens * self.rl.max_turns >= self.training.seq_len:
            raise ConfigError(
                f"--training.seq_len {self.training.seq_len} must exceed the longest rollout's "
                f"generated tokens (--rl.max_new_tokens {self.rl.max_new_tokens} x --rl."
                f"max_turns {self.rl.max_turns}) plus its prompt; raise seq_len."
            )
