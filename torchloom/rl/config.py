"""The job of `torchloom rl`: the training job's sections (model, data for the tokenizer,
training for steps / device / seed, optimizer, lr schedule, checkpoint, metrics, output) plus
the ``rl`` section below. ``--training.steps`` counts policy updates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from torchloom.config.errors import ConfigError
from torchloom.config.fields import warn_unused_options
from torchloom.generate.requests import MIN_TEMPERATURE
from torchloom.rl.evaluate import EvalConfig
from torchloom.train.job import JobConfig


@dataclass
class RLConfig:
    RENAMED: ClassVar[dict[str, str]] = {
        "tis_cap": "it is now --rl.is_high (the importance weight's cap; --rl.is_low is its "
        "floor).",
    }
    """Removed options and what replaced them (the command line names the replacement)."""

    task: str = "arithmetic"
    """Task the prompts, environment and reward come from. Built in (torchloom/rl/tasks.py):
    arithmetic, letters, sort, countdown, mixed, word_problems, and python_tool (the sandboxed
    Python tool environment, multi-turn); torchloom.rl.tasks.register_task adds your own."""
    prompts_per_step: int = 4
    """Prompts per policy update."""
    group_size: int = 8
    """Rollouts per prompt (GRPO's group); advantages are relative within a group."""
    max_new_tokens: int = 32
    """Tokens the model may generate per turn."""
    max_turns: int = 1
    """Replies per rollout for multi-turn environments (1: a single answer)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts. Both the generator and the trainer score tokens
    under the distribution they were sampled from (temperature and top_p applied)."""
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
    """Drop groups whose rollouts all got the same reward (no signal) from the update, and
    refill the batch with new groups (DAPO's dynamic sampling; see max_refill_rounds)."""
    max_refill_rounds: int = 3
    """With filter_zero_variance: extra rounds of generation, each for the groups still
    missing (scaled by the rate kept so far), until prompts_per_step groups carry signal; 0:
    no refill (the batch shrinks)."""
    objective: str = "ppo"
    """The RL objective (torchloom/rl/objectives.py's registry): ppo (the clipped surrogate of
    PPO / GRPO / DAPO, or GSPO with ratio_level sequence) or reinforce (no ratio clip)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts (each pass takes ``minibatches`` optimizer steps)."""
    minibatches: int = 1
    """Optimizer steps per pass: the step's groups split into this many parts, each one step.
    With more than one, every step after the first moves away from the policy that sampled the
    batch, and the clip acts (clip_frac > 0)."""
    clip_low: float | None = None
    """Ratio clip below 1: ratios under 1 - clip_low stop pushing a negative advantage (unset:
    0.2 per token; 3e-4 per sequence, GSPO's)."""
    clip_high: float | None = None
    """Ratio clip above 1 (unset: 0.28, DAPO's clip-higher, per token; 4e-4 per sequence)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO / GRPO / DAPO) or per sequence (GSPO: the geometric mean
    of its token ratios, with GSPO's clip range and sequence normalization unless set)."""
    loss_normalization: Literal["token", "sequence", "constant"] | None = None
    """How token losses are averaged: every response token of the batch equally (token, DAPO),
    per sequence then over sequences (sequence, GRPO / GSPO), or by a constant (Dr. GRPO:
    max_new_tokens x max_turns). Unset: token, or sequence with ratio_level sequence."""
    old_logprobs: Literal["recompute", "generator"] = "recompute"
    """The ratio's denominator. recompute: the trainer's own log-probs under the weights at the
    start of the step (= the weights that sampled the batch when on-policy; with lag, the
    proximal policy, and importance sampling corrects the rest). generator: the generator's
    log-probs as they came (the behavior policy itself, its numerics included). In batch-
    invariant mode on-policy the two are bitwise equal and no extra forward runs."""
    is_correction: Literal["none", "tis", "mis"] = "tis"
    """Importance sampling between the ratio's denominator and the generator's probabilities
    (numerics, lag): tis truncates the weight to [is_low, is_high]; mis masks the tokens (or
    sequences) whose weight falls outside it (the masked fraction is logged as is_masked_frac).
    Nothing to correct when old_logprobs is generator, or bitwise on-policy."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weight per token, or per sequence (the product of its token weights)."""
    is_low: float = 0.0
    """Lower bound of the importance weight (tis: clamp; mis: mask below)."""
    is_high: float = 2.0
    """Upper bound of the importance weight (tis: clamp; mis: mask above)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to a frozen copy of the initial policy (0: no reference)."""
    overlong_buffer: int = 0
    """DAPO's overlong reward shaping: a reply longer than max_new_tokens - overlong_buffer
    loses up to overlong_penalty linearly over the buffer's tokens (0: off)."""
    overlong_penalty: float = 1.0
    """The largest shaping penalty (a reply cut at max_new_tokens)."""
    overlong_filter: bool = False
    """Leave rollouts whose last reply was cut at max_new_tokens out of the loss (they still
    count in their group's advantages)."""
    micro_batch_size: int = 16
    """Rollouts per trainer forward (the update accumulates over the step's rollouts)."""
    generator_slots: int = 64
    """Rollouts the generator decodes at once (cache slots)."""
    unsafe_sandbox: bool = False
    """With task python_tool: run the model's code even where the sandbox cannot make the
    filesystem private (neither a mount namespace nor Landlock works), so that code can read
    every file you can. Without it the tool environment refuses to start on such a machine."""
    init_recipes: list[str] = field(default_factory=list)
    """Training recipes that build the starting model, run in order (each with its own output
    folder) when --checkpoint.initial_load_hf does not exist yet; e.g. pre-training, then SFT."""

    def validate(self) -> None:
        if self.group_size < 2:
            raise ConfigError(
                f"--rl.group_size must be at least 2: advantages are relative within a group; "
                f"got {self.group_size}."
            )
        for name in ("prompts_per_step", "max_new_tokens", "max_turns",
                     "micro_batch_size", "generator_slots", "generator_ranks",
                     "sync_bucket_mb"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"--rl.{name} must be at least 1; got {getattr(self, name)}.")
        if self.max_offpolicy_steps < 0:
            raise ConfigError(
                f"--rl.max_offpolicy_steps must be >= 0 (0: synchronous); got "
                f"{self.max_offpolicy_steps}."
            )
        low, high = self.clip_range()
        if not 0 <= low < 1:  # nan too
            raise ConfigError(f"--rl.clip_low must be in [0, 1); got {low}.")
        if not 0 <= high < math.inf:
            raise ConfigError(f"--rl.clip_high must be a finite number >= 0; got {high}.")
        if not MIN_TEMPERATURE <= self.temperature < math.inf:
            raise ConfigError(
                f"--rl.temperature must be a finite number >= {MIN_TEMPERATURE:g} for rollouts "
                "(greedy rollouts of a group are all alike, a smaller one overflows the "
                f"sampler's division, an infinite one samples uniform noise); got "
                f"{self.temperature}."
            )
        for name in ("ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--rl.{name} must be at least 1; got {getattr(self, name)}.")
        if self.minibatches > self.prompts_per_step:
            raise ConfigError(
                f"--rl.minibatches {self.minibatches} splits the step's {self.prompts_per_step} "
                "groups; it cannot exceed --rl.prompts_per_step."
            )
        for name in ("kl_coef", "max_refill_rounds", "overlong_buffer", "overlong_penalty",
                     "is_low"):  # fmt: skip
            value = getattr(self, name)
            if not 0 <= value < math.inf:  # nan too
                raise ConfigError(f"--rl.{name} must be a finite number >= 0; got {value}.")
        if not 0 <= self.format_reward <= 1:  # nan too
            raise ConfigError(
                f"--rl.format_reward must be in [0, 1] (an unparsable reply scores 0, a correct "
                f"one 1); got {self.format_reward}."
            )
        if not self.is_high > max(self.is_low, 0.0) or self.is_high == float("inf"):
            raise ConfigError(
                f"--rl.is_high must be a finite number above --rl.is_low ({self.is_low}); got "
                f"{self.is_high}."
            )
        if self.overlong_buffer >= self.max_new_tokens:
            raise ConfigError(
                f"--rl.overlong_buffer {self.overlong_buffer} must be below --rl.max_new_tokens "
                f"{self.max_new_tokens} (the shaping starts max_new_tokens - buffer tokens in)."
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--rl.top_p must be in (0, 1]; got {self.top_p}.")
        if not self.filter_zero_variance and self.max_refill_rounds:
            until = "--rl.filter_zero_variance true (refills replace the groups it drops)"
            warn_unused_options(self, "rl", ("max_refill_rounds",), until)
        if self.placement != "disaggregated":
            until = "--rl.placement disaggregated"
            warn_unused_options(self, "rl", ("generator_ranks", "sync_bucket_mb"), until)
        if self.is_correction == "none":
            until = "--rl.is_correction tis or mis"
            warn_unused_options(self, "rl", ("is_level", "is_low", "is_high"), until)
        if not self.overlong_buffer:
            warn_unused_options(self, "rl", ("overlong_penalty",), "--rl.overlong_buffer > 0")
        if self.unsafe_sandbox and self.task != "python_tool":
            raise ConfigError(
                f"--rl.unsafe_sandbox applies to the sandboxed Python tool (--rl.task "
                f"python_tool) only; task {self.task!r} runs no code. Leave it false."
            )

    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high) as set, else the defaults of the ratio level."""
        low, high = (0.2, 0.28) if self.ratio_level == "token" else (3e-4, 4e-4)
        return (low if self.clip_low is None else self.clip_low,
                high if self.clip_high is None else self.clip_high)  # fmt: skip

    def normalization(self) -> str:
        """The loss normalization as set, else the ratio level's."""
        if self.loss_normalization is not None:
            return self.loss_normalization
        return "token" if self.ratio_level == "token" else "sequence"


_PROMPTS = "its prompts come from --rl.task"
_BATCH = "a policy update trains on --rl.prompts_per_step x --rl.group_size rollouts"
_EVAL = "it evaluates with --eval.every and --eval.k"
_EAGER = "it runs eager: the generator shares the trainer's modules"
NOT_READ: dict[str, str] = {
    **{f"data.{name}": _PROMPTS for name in (
        "format", "sources", "text_field", "streaming", "mix", "prefetch_steps",
        "overlong_conversations", "media_layout", "max_images_per_row", "max_image_patches",
        "image_min_pixels", "image_max_pixels", "image_decode_limit", "max_audios_per_row",
        "max_audio_seconds", "document_mask", "val_fraction", "shuffle")},
    "training.global_batch_size": _BATCH,
    "training.global_batch_tokens": _BATCH,
    "training.micro_batch_size": "rollouts per trainer forward are --rl.micro_batch_size",
    "training.val_interval": _EVAL,
    "training.val_sequences": _EVAL,
    "training.sample_prompt": _EVAL,
    "training.sample_tokens": _EVAL,
    "training.cuda_graph": "its generator decodes from CUDA graphs on a GPU already, and its "
    "training step is not captured",
    "training.deterministic": "deterministic algorithms are not checked with its generator",
    **{f"compile.{name}": _EAGER for name in ("regions", "backend", "fullgraph", "mode")},
}  # fmt: skip
"""Options of the training job's sections that `torchloom rl` never reads, with what it does
instead: given on its command line to ask for something, they are refused (``check_read``), not
silently ignored."""


def check_read(job: JobConfig, recipe: JobConfig, given: list[str]) -> None:
    """ConfigError naming every option among ``given`` (dotted paths from the command line)
    that `torchloom rl` does not read and that asks for something in ``job`` (the recipe with
    the command line applied): a value other than the ``recipe``'s and other than off (0,
    false, empty), each with what rl does instead. Off values pass, so that one list of flags
    can serve train and rl."""

    def value(config: JobConfig, path: str) -> object:
        section, name = path.split(".")
        return getattr(getattr(config, section), name)

    unread = [path for path in dict.fromkeys(given) if path in NOT_READ
              and value(job, path) and value(job, path) != value(recipe, path)]  # fmt: skip
    if not unread:
        return
    reasons = " or ".join(f"--{path} ({NOT_READ[path]})" for path in unread)
    them = "it" if len(unread) == 1 else "them"
    raise ConfigError(f"torchloom rl does not read {reasons}; leave {them} out.")


@dataclass
class RLJobConfig(JobConfig):
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        super().validate()
        p, r = self.parallel, self.rl
        if (self.eval.every or self.eval.k) and r.placement == "disaggregated":
            raise ConfigError(
                "--eval.every / --eval.k evaluate with the colocated generator; with "
                "disaggregated placement set both to 0 (evaluate the exported model instead)."
            )
        if r.placement == "colocated" and max(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp,
                                                 p.ep) > 1:  # fmt: skip
            raise ConfigError(
                "Colocated RL runs the trainer and the generator on one device; set every "
                "--parallel degree to 1, or use --rl.placement disaggregated to train on several "
                "ranks (data or tensor parallel) beside generator ranks."
            )
        if r.placement == "disaggregated":
            if p.pp > 1:
                raise ConfigError(
                    f"--parallel.pp {p.pp} is not supported by torchloom rl: the pipeline "
                    "schedule carries only labels to the last stage, not the advantages and "
                    "log-probabilities the policy loss reads. Set --parallel.pp 1."
                )
            sequence_level = r.ratio_level == "sequence" or r.is_level == "sequence"
            if p.cp > 1 and sequence_level:
                raise ConfigError(
                    f"--parallel.cp {p.cp} splits each rollout over ranks, and sequence-level "
                    "ratios (--rl.ratio_level / --rl.is_level sequence) need the whole "
                    "sequence on one rank; use token level or --parallel.cp 1."
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
