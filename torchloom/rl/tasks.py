"""Built-in verifiable tasks for RL: seeded prompt streams and one-turn exact-match environments.

- ``arithmetic``: add or subtract two numbers below 100, asked exactly as the SFT chat set asks.
- ``letters``: how many letters a word has, asked as the SFT chat set asks.
- ``sort``: sort 3 to 6 numbers up or down, asked exactly as the SFT chat set asks.
- ``countdown``: reach a target from given numbers with ``+ - *``; not in the SFT set.
- ``mixed``: arithmetic or sort, chosen per prompt.
- ``word_problems``: bare arithmetic and grade-school word problems, answered with worked steps
  and "The answer is N." (torchloom/rl/word_problems.py; held-out questions never appear).

The arithmetic and sort questions come from the same generators as ``torchloom.data.chat_tasks``,
so a model fine-tuned on that set starts with a non-zero reward for RL to raise.

Every prompt ``i`` of a source is drawn from its own ``random.Random`` seeded with the task name,
the seed and ``i``, using only integer methods: the stream is the same on every machine, and
resuming from ``state_dict()`` (seed and number drawn) skips ahead in O(1).

Reward: 1.0 for a correct answer; ``format_reward`` (default 0.0) when the reply has the right
form but the wrong value; 0.0 otherwise. ``Turn.info`` carries ``format_ok`` and ``correct``.
"""

from __future__ import annotations

import ast
import functools
import operator
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# Private on purpose there; used here so RL questions stay worded exactly as the SFT ones.
from torchloom.data.chat_tasks import (
    WORDS,
    _add,
    _count_letters,
    _sort_numbers,
    _subtract,
    count_letters_task,
)
from torchloom.rl.env import Check, Environment, Prompt, PromptSource, Turn
from torchloom.rl.word_problems import check_final_answer, held_out_problems, word_problems_prompt

# --- prompts ---------------------------------------------------------------------------------


def arithmetic_prompt(rng: random.Random) -> Prompt:
    """An addition or subtraction question; the answer is the integer result."""
    question, _, result = rng.choice((_add, _subtract))(rng)
    return Prompt(question, answer=result, meta={"task": "arithmetic"})


def letters_prompt(rng: random.Random) -> Prompt:
    """How many letters a word has; the answer is the count (checked as arithmetic is: the
    reply's last number)."""
    question, _, count = _count_letters(rng)
    return Prompt(question, answer=count, meta={"task": "letters"})


# Words the letters task never asks about (its stream and the chat SFT set draw from WORDS):
# counting their letters is the held-out skill. Lengths 3 to 9, so no one count is most of them.
LETTERS_HELD_OUT = (
    "cup", "owl", "jam", "fox", "frog", "bell", "coat", "drum", "kite", "nest", "ocean",
    "wagon", "bench", "piano", "puzzle", "mouse", "clock", "lemon", "ladder", "bottle", "castle",
    "rocket", "planet", "tomato", "spider", "carpet", "pillow", "blanket", "thunder", "kitchen",
    "morning", "harvest", "library", "diamond", "mountain", "elephant", "dinosaur", "umbrella",
    "notebook", "sandwich", "butterfly", "chocolate", "telescope", "waterfall", "blueberry",
    "crocodile", "hurricane", "pineapple",
)  # fmt: skip
assert not set(LETTERS_HELD_OUT) & set(WORDS), "a held-out word is in the training words"


def held_out_letters(n: int) -> list[Prompt]:
    """The first ``n`` (at most 48) held-out letter-count questions."""
    if not 0 < n <= len(LETTERS_HELD_OUT):
        raise ValueError(f"the letters task has {len(LETTERS_HELD_OUT)} held-out words; got {n}")
    prompts = []
    for word in LETTERS_HELD_OUT[:n]:
        question, _, count = count_letters_task(word)
        prompts.append(Prompt(question, answer=count, meta={"task": "letters"}))
    return prompts


def sort_prompt(rng: random.Random) -> Prompt:
    """A sorting question; the answer is the sorted list of ints."""
    question, answer, _ = _sort_numbers(rng)
    return Prompt(question, answer=[int(n) for n in answer.split(", ")], meta={"task": "sort"})


def countdown_prompt(rng: random.Random) -> Prompt:
    """2, 3 or 4 numbers in 1..25 and a target built from some of them, so it is always reachable.

    The two-number third is the bottom rung: one operation to find, within reach of a small
    SFT model, so its groups' rewards vary once every reply is well-formed (with 3-4 numbers
    only, a 0.5B model learned the format and then nearly every group was all-equal, and
    dynamic sampling had nothing to keep; benchmarks/RESULTS.md). The answer is
    ``{"numbers": [...], "target": int}``.
    """
    numbers = [rng.randrange(1, 26) for _ in range(rng.randrange(2, 5))]
    used = rng.sample(numbers, rng.randrange(2, len(numbers) + 1))
    target = used[0]
    for n in used[1:]:
        op = rng.randrange(3)
        # Keep the target positive and below ~1000, falling back to addition.
        if op == 2 and target * n < 1000:
            target *= n
        elif op == 1 and target - n > 0:
            target -= n
        else:
            target += n
    listed = ", ".join(map(str, numbers))
    text = (
        f"Use the numbers {listed} to make {target}. You may use +, -, * and parentheses, "
        "and each number at most once. Answer with the expression only."
    )
    return Prompt(text, answer={"numbers": numbers, "target": target}, meta={"task": "countdown"})


def mixed_prompt(rng: random.Random) -> Prompt:
    """An arithmetic or a sort prompt, one in two each; ``meta["task"]`` says which."""
    return rng.choice((arithmetic_prompt, sort_prompt))(rng)


class TaskSource:
    """An endless, seeded, resumable stream of one task's prompts (a ``PromptSource``).

    Prompt ``i`` depends only on (task, seed, i). Iterating advances the source's position,
    shared by all its iterators; ``state_dict()`` is that position and the seed.
    """

    def __init__(self, task: str, make_prompt: Callable[[random.Random], Prompt], seed: int = 0):
        self.task = task
        self.make_prompt = make_prompt
        self.seed = seed
        self.drawn = 0

    def prompt(self, index: int) -> Prompt:
        """Prompt number ``index`` of this stream."""
        # A str seed is hashed with SHA-512 by random.Random: the same on every machine.
        return self.make_prompt(random.Random(f"{self.task}:{self.seed}:{index}"))

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            index = self.drawn
            self.drawn += 1
            yield self.prompt(index)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = state["seed"]
        self.drawn = state["drawn"]


_PROMPTS: dict[str, Callable[[random.Random], Prompt]] = {
    "arithmetic": arithmetic_prompt,
    "letters": letters_prompt,
    "sort": sort_prompt,
    "countdown": countdown_prompt,
    "mixed": mixed_prompt,
    "word_problems": word_problems_prompt,
}
TASKS: dict[str, Callable[..., PromptSource]] = {
    name: functools.partial(TaskSource, name, make_prompt) for name, make_prompt in _PROMPTS.items()
}
"""Task name -> source factory; call with ``seed=...``."""
BUILTIN_TASKS = (*TASKS, "python_tool")
"""The tasks torchloom ships (``--rl.task``; python_tool's source is in rl/tool_env.py), in the
order ``rl --help`` lists them."""

# --- rewards ---------------------------------------------------------------------------------


# A minus sign counts only where it does not follow a letter or digit: "12-30" is 12 and 30.
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
_INT_LIST = re.compile(r"(?<![\w.])-?\d+(?:\s*,\s*-?\d+)*")


def check_arithmetic(reply: str, answer: int) -> Check:
    """The reply's last number is its answer (so "12 + 30 = 42" and "It is 42." both give 42).

    Format fails when the reply has no number or its last number has a decimal point.
    """
    numbers = _NUMBER.findall(reply)
    if not numbers or "." in numbers[-1]:
        return Check(False, False)
    return Check(True, int(numbers[-1]) == answer)


def check_sort(reply: str, answer: list[int]) -> Check:
    """The reply's last run of comma-separated integers is its answer ("Sorted: 1, 5, 9.").

    Format holds when that run has as many numbers as the question; correct when it equals
    ``answer`` in order.
    """
    runs = _INT_LIST.findall(reply)
    if not runs:
        return Check(False, False)
    numbers = [int(n) for n in runs[-1].split(",")]
    return Check(len(numbers) == len(answer), numbers == answer)


_EXPRESSION_CHARS = re.compile(r"[\d\s+\-*()]+")
_MAX_EXPRESSION_CHARS = 200
_OPERATORS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def countdown_value(expression: str, numbers: Sequence[int]) -> int | None:
    """The value of ``expression`` if it is a valid countdown answer for ``numbers``, else None.

    Valid: only non-negative integer literals, binary ``+ - *`` and parentheses (no names,
    calls, unary minus, ``/`` or ``**``), each literal one of ``numbers`` and used no more often
    than given. Parsed with ``ast`` and evaluated by walking the tree; nothing is ``eval``-ed.
    """
    expression = expression.strip()
    if len(expression) > _MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(expression):
        return None
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if Counter(used) - Counter(numbers):  # a literal not given, or used too often
        return None
    return value


def _evaluate(node: ast.expr, used: list[int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)}")


def check_countdown(reply: str, answer: dict[str, Any]) -> Check:
    """The expression is the reply's last non-empty line, cut at its first "=" (so "3 * 7 + 12 =
    33" is read as "3 * 7 + 12").

    Format holds when it is valid for the given numbers (see ``countdown_value``) and combines
    at least two of them; correct when it also equals the target. A bare number is not an
    answer: with it accepted, the 0.5B model of the H200 run (benchmarks/RESULTS.md, twentieth
    session) learned to reply with one of the given numbers (2 tokens) and collected the format
    reward without solving anything.
    """
    lines = [line for line in reply.splitlines() if line.strip()]
    if not lines:
        return Check(False, False)
    expression = lines[-1].split("=")[0]
    value = countdown_value(expression, answer["numbers"])
    if value is None or not _has_operator(expression):
        return Check(False, False)
    return Check(True, value == answer["target"])


def _has_operator(expression: str) -> bool:
    """Whether a valid countdown expression applies an operator (so uses two numbers or more):
    its parsed body is a binary operation, not a literal (parentheses around one are not)."""
    return isinstance(ast.parse(expression.strip(), mode="eval").body, ast.BinOp)


CHECKS: dict[str, Callable[[str, Any], Check]] = {
    "arithmetic": check_arithmetic,
    "letters": check_arithmetic,
    "sort": check_sort,
    "countdown": check_countdown,
    "word_problems": check_final_answer,
}
"""Task name (``prompt.meta["task"]``) -> the check of a reply against ``prompt.answer``."""

HELD_OUT: dict[str, Callable[[int], list[Prompt]]] = {
    "word_problems": held_out_problems,
    "letters": held_out_letters,
}
"""Task name -> its fixed held-out set (the first n problems; never in the training stream),
what ``--eval.every`` and ``--eval.k`` evaluate the policy on."""


class OneTurnEnv:
    """An episode of one reply, scored by ``check``: 1.0 if correct, ``format_reward`` if only
    the format is right, else 0.0."""

    def __init__(self, check: Callable[[str, Any], Check], format_reward: float = 0.0):
        self.check = check
        self.format_reward = format_reward
        self.max_turns = 1
        self.prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> str:
        self.prompt = prompt
        return prompt.text

    def step(self, reply: str) -> Turn:
        if self.prompt is None:
            raise RuntimeError("OneTurnEnv.step was called before reset(prompt).")
        verdict = self.check(reply, self.prompt.answer)
        if verdict.correct:
            reward = 1.0
        elif verdict.format_ok:
            reward = self.format_reward
        else:
            reward = 0.0
        return Turn(done=True, reward=reward, info=verdict._asdict())


def make_env(prompt: Prompt, format_reward: float = 0.0) -> Environment:
    """The environment that scores replies to ``prompt``, picked by ``prompt.meta["task"]``."""
    task = prompt.meta.get("task")
    if task not in CHECKS:
        raise ValueError(
            f"Prompt task {task!r} has no built-in check; expected meta['task'] in {sorted(CHECKS)}."
        )
    return OneTurnEnv(CHECKS[task], format_reward)


def register_task(
    name: str, make_prompt: Callable[[random.Random], Prompt], check: Callable[[str, Any], Check]
) -> None:
    """Add a one-turn task under ``name`` (``--rl.task name``): ``make_prompt(rng)`` makes a
    prompt (with ``meta["task"] = name`` and the reference in ``answer``) from its own seeded
    generator, ``check(reply, answer)`` judges a reply (``Check(format_ok, correct)``)."""
    if name in TASKS:
        raise ValueError(f"task {name!r} is registered already")
    TASKS[name] = functools.partial(TaskSource, name, make_prompt)
    CHECKS[name] = check
