"""The ``word_problems`` RL task: bare arithmetic and grade-school word problems with exact
integer answers, checked on the reply's final answer, and a fixed held-out set to measure
whether a model learned them.

The problems and their worked solutions come from ``torchloom.data.word_problems``, which also
writes the pre-training corpus (``builtin:word_problems``) and the chat SFT set
(``builtin:word_problems_chat``) in the same form, so an SFT model starts with some reward.

- Training prompts (``--rl.task word_problems``): prompt ``i`` is drawn from its own
  ``random.Random`` seeded with (task, seed, i) by ``TaskSource``; a problem whose question is
  in the held-out pool is replaced by the next draw from that same generator, so the stream
  stays seeded, resumable in O(1), and never shows a held-out question.
- Held out: ``held_out_problems(n)``, the first ``n`` of a fixed pool of 1000 distinct
  questions drawn from their own seed namespace; a constant answer gets at most ~1.5% of them
  right (``best_constant_accuracy``).
- Check: the reply's answer is the number after its last "The answer is", else its last
  number; the format holds when it says "The answer is <integer>".
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence

from torchloom.data.word_problems import (
    HELD_OUT_POOL,
    Problem,
    arithmetic_problem,
    held_out_pool,
    training_problem,
    word_problem,
)
from torchloom.rl.env import Check, Prompt

__all__ = [
    "Problem",
    "arithmetic_problem",
    "best_constant_accuracy",
    "check_final_answer",
    "held_out_problems",
    "word_problem",
    "word_problems_prompt",
]
TASK = "word_problems"


def problem_prompt(problem: Problem) -> Prompt:
    """The RL prompt of ``problem``: its question, its integer answer, and its worked solution
    in ``meta`` (for logging; the check reads only the answer)."""
    return Prompt(problem.question, answer=problem.answer,
                  meta={"task": TASK, "solution": problem.solution})  # fmt: skip


def word_problems_prompt(rng: random.Random) -> Prompt:
    """A training prompt: arithmetic (one in three) or a word problem, never a held-out one."""
    return problem_prompt(training_problem(rng))


def held_out_problems(n: int = 500) -> list[Prompt]:
    """The first ``n`` (at most 1000) problems of the fixed held-out pool, as prompts."""
    if not 0 < n <= HELD_OUT_POOL:
        raise ValueError(f"held_out_problems takes 1 to {HELD_OUT_POOL} problems; got {n}")
    return [problem_prompt(p) for p in held_out_pool()[:n]]


def best_constant_accuracy(problems: Sequence[Prompt]) -> tuple[int, float]:
    """The most common answer among ``problems`` and the fraction it is right for: what a policy
    that always gives one number would score."""
    if not problems:
        raise ValueError("best_constant_accuracy needs at least one problem")
    answer, count = Counter(p.answer for p in problems).most_common(1)[0]
    return answer, count / len(problems)


# A minus sign counts only where it does not follow a letter or digit: "12-30" is 12 and 30.
_FINAL = re.compile(r"The answer is\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def check_final_answer(reply: str, answer: int) -> Check:
    """``format_ok``: the reply says "The answer is <integer>". ``correct``: its answer (the
    number after the last "The answer is", else the reply's last number) equals ``answer``."""
    finals = _FINAL.findall(reply)
    if finals:
        value = finals[-1]
        return Check("." not in value, "." not in value and int(value) == answer)
    numbers = _NUMBER.findall(reply)
    if not numbers or "." in numbers[-1]:
        return Check(False, False)
    return Check(False, int(numbers[-1]) == answer)
