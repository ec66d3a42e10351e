"""Held-out evaluation through the generator: greedy pass@1, and sampled pass@k.

Each prompt is rendered as the RL rollouts render it (one user message through the tokenizer's
chat template, the assistant's reply opened) and answered until an end-of-turn id or
``max_new_tokens``. Greedy decoding gives ``pass@1``; with ``k > 0`` every prompt is also
sampled ``k`` times, each sample with its own seed derived from (seed, prompt, sample), so the
numbers are the same on every run. With exactly ``k`` samples per prompt the unbiased estimator
``pass_at_k(k, c, k)`` is 1 when any sample is right: ``pass@k`` is the fraction of prompts
solved at least once, and ``pass@1_sampled`` the mean correctness of the samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.data.word_problems import HELD_OUT_POOL
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.generate.sampling import derive_seed
from torchloom.rl.env import Check, Prompt


@dataclass
class EvalConfig:
    """Held-out evaluation of the policy during RL, on the task's held-out set (tasks.HELD_OUT)."""

    every: int = 0
    """Greedy held-out pass@1 every this many updates (0: off)."""
    problems: int = 500
    """Held-out problems to evaluate on: the first N of the task's fixed set (word_problems: 1000)."""
    k: int = 0
    """Samples per problem for pass@k at the start and the end of the run (0: off; e.g. 8)."""
    max_new_tokens: int = 0
    """Tokens an answer may take (0: the rollouts' max_new_tokens)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples (pass@1 is always greedy)."""

    def validate(self) -> None:
        for name in ("every", "k", "max_new_tokens"):
            if (value := getattr(self, name)) < 0:
                raise ConfigError(f"--eval.{name} must be 0 (off) or more; got {value}.")
        if not 0 < self.problems <= HELD_OUT_POOL:
            raise ConfigError(
                f"--eval.problems must be between 1 and {HELD_OUT_POOL} (the held-out set's "
                f"size); got {self.problems}."
            )
        if not self.temperature > 0:
            raise ConfigError(
                f"--eval.temperature must be above 0 for pass@k sampling (pass@1 is greedy "
                f"already); got {self.temperature}."
            )


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased chance that at least one of ``k`` samples is right, from ``n`` samples of
    which ``c`` were right: ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021)."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 0 < k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The sampling seed of one (prompt, sample) pair, the same on every machine."""
    return derive_seed(seed, prompt, sample)


def evaluate(
    generator: Generator,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    check_fn: Callable[[str, Any], Check],
    *,
    max_new_tokens: int,
    k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """``pass@1`` (greedy) and ``format@1`` (greedy replies in the checked form) of
    ``check_fn(reply, prompt.answer)`` over ``prompts``; with ``k > 0`` also ``pass@k`` (a
    prompt counts when any of its ``k`` samples at ``temperature`` is right) and
    ``pass@1_sampled`` (the samples' mean correctness)."""
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    contexts = [
        tokenizer.encode_chat(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p.text}], add_generation_prompt=True
            )
        )
        for p in prompts
    ]
    stop_ids = tokenizer.stop_ids(chat=True)

    def verdicts(temperature: float, samples: int) -> list[list[Check]]:
        """Each prompt's ``samples`` verdicts (its requests are adjacent: one shared prefill)."""

        def params(i: int, j: int) -> SamplingParams:
            return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=sample_seed(seed, i, j), stop_ids=stop_ids)  # fmt: skip

        requests = [
            Request(list(ids), params(i, j))
            for i, ids in enumerate(contexts)
            for j in range(samples)
        ]
        completions = generator.generate(requests)
        checks: list[list[Check]] = [[] for _ in prompts]
        for index, completion in enumerate(completions):
            if completion.finish_reason == "error":
                raise ConfigError(
                    f"The generator refused an evaluation prompt: {completion.error}. Lower "
                    "--eval.max_new_tokens (0: the rollouts' --rl.max_new_tokens) or raise "
                    f"--training.seq_len ({generator.max_len}), the context it generates in."
                )
            reply = tokenizer.decode(completion.tokens, skip_special_tokens=True)
            prompt = prompts[index // samples]
            checks[index // samples].append(check_fn(reply, prompt.answer))
        return checks

    greedy = [checks[0] for checks in verdicts(0.0, 1)]
    metrics = {
        "pass@1": sum(c.correct for c in greedy) / len(prompts),
        "format@1": sum(c.format_ok for c in greedy) / len(prompts),
    }
    if k > 0:
        right = [sum(c.correct for c in checks) for checks in verdicts(temperature, k)]
        metrics[f"pass@{k}"] = sum(pass_at_k(k, c, k) for c in right) / len(prompts)
        metrics["pass@1_sampled"] = sum(right) / (k * len(prompts))
    return metrics
