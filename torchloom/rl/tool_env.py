"""A multi-turn environment with a Python tool: the model may run code before it answers.

Each reply is one of: a final answer (a line ``Answer: <value>``, which wins over code in the
same reply), which ends the episode with the reward function's score; or code in a ```python
block, which ``run_python`` (``torchloom.rl.sandbox``) runs and whose output is the next user
message. A reply with neither gets a reminder of the format. The episode ends without reward
when the ``max_turns``-th reply gives no answer.

``tool_prompts(seed)`` is a small built-in source of tasks that reward using the tool (big
products, sums of primes, digit sums of factorials, ...) with exact answers.

The environment refuses to start where the sandbox cannot make the filesystem private (no
mount namespace, no Landlock) unless ``unsafe_sandbox`` (``--rl.unsafe_sandbox true``) says to
run the model's code anyway.

Each run is its own subprocess, so the runs of a step's episodes, which the rollouts call from
a thread pool, overlap (tests/rl/test_sandbox.py runs it through ``generate_rollouts``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.rl.env import Prompt, Turn
from torchloom.rl.sandbox import UNISOLATED, SandboxResult, probe_isolation, run_python
from torchloom.rl.tasks import TaskSource

INSTRUCTIONS = (
    "You can run Python: put code in a ```python block and you will see what it prints. "
    "When you know the result, reply with a last line `Answer: <value>`."
)
_CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)
_ANSWER = re.compile(r"^[ \t]*Answer:[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def exact_match(answer: str, prompt: Prompt) -> float:
    """1.0 when the answer equals ``str(prompt.answer)`` (both stripped), else 0.0."""
    return float(answer.strip() == str(prompt.answer).strip())


def parse_answer(reply: str) -> str | None:
    """The value of the last ``Answer:`` line outside code blocks, or None."""
    answers = _ANSWER.findall(_CODE_BLOCK.sub("", reply))
    return answers[-1] if answers else None


def extract_code(reply: str) -> str | None:
    """The reply's ```python blocks joined in order, or None when it has none."""
    blocks = _CODE_BLOCK.findall(reply)
    return "\n".join(blocks) if blocks else None


def format_output(result: SandboxResult, timeout_s: float) -> str:
    """The tool's output as the model sees it: what the code printed, then what went wrong."""
    text = "\n".join(s.rstrip("\n") for s in (result.stdout, result.stderr) if s) or "(no output)"
    notes = []
    if result.truncated:
        notes.append("[output truncated]")
    if result.timed_out:
        notes.append(f"[stopped: ran longer than {timeout_s:g} s]")
    elif result.exit_code != 0 and result.killed_reason is None:  # output_limit: truncated
        notes.append(f"[exit code {result.exit_code}]")
    return "\n".join(["Output:", text, *notes])


class PythonToolEnv:
    """One episode of question, tool calls and answer (the ``Environment`` protocol)."""

    def __init__(
        self,
        *,
        max_turns: int = 4,
        reward_fn: Callable[[str, Prompt], float] = exact_match,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        max_output_chars: int = 2000,
        instructions: str = INSTRUCTIONS,
        unsafe_sandbox: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ConfigError(f"PythonToolEnv needs max_turns >= 1 (got {max_turns}).")
        if not (unsafe_sandbox or probe_isolation()):
            raise ConfigError(UNISOLATED)
        self.max_turns = max_turns
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.instructions = instructions
        self.unsafe_sandbox = unsafe_sandbox
        self._prompt: Prompt | None = None
        self._turns = 0
        self._tool_calls = 0

    def reset(self, prompt: Prompt) -> str:
        self._prompt, self._turns, self._tool_calls = prompt, 0, 0
        return f"{prompt.text}\n\n{self.instructions}"

    def step(self, reply: str) -> Turn:
        if self._prompt is None:
            raise RuntimeError("PythonToolEnv.step before reset: start each episode with reset.")
        self._turns += 1
        info: dict[str, Any] = {"turns": self._turns, "tool_calls": self._tool_calls}
        answer = parse_answer(reply)
        if answer is not None:
            reward = self.reward_fn(answer, self._prompt)
            return Turn(
                done=True, reward=reward, info={**info, "answer": answer, "format_ok": True}
            )
        code = extract_code(reply)
        if self._turns >= self.max_turns:  # no answer in the last reply: cut, no reward
            return Turn(done=True, reward=0.0, info={**info, "format_ok": code is not None})
        if code is None:
            return Turn(
                observation=f"Found neither a ```python block nor an answer. {self.instructions}",
                info={**info, "format_ok": False},
            )
        result = run_python(
            code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_chars=self.max_output_chars,
            unsafe_sandbox=self.unsafe_sandbox,
        )
        self._tool_calls += 1
        info.update(tool_calls=self._tool_calls, format_ok=True, tool_ok=result.ok)
        return Turn(observation=format_output(result, self.timeout_s), info=info)


def _product(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randrange(10**5, 10**6), rng.randrange(100, 10**4)
    return f"What is {a} * {b}?", a * b


def _prime_sum(rng: random.Random) -> tuple[str, int]:
    limit = rng.randrange(1_000, 20_000)
    sieve = bytearray([1]) * limit
    sieve[:2] = b"\x00\x00"
    for n in range(2, math.isqrt(limit - 1) + 1):
        if sieve[n]:
            sieve[n * n :: n] = bytes(len(range(n * n, limit, n)))
    return f"What is the sum of all primes below {limit}?", sum(n for n in range(limit) if sieve[n])


def _factorial_digit_sum(rng: random.Random) -> tuple[str, int]:
    n = rng.randrange(30, 150)
    return f"What is the sum of the digits of {n}! ({n} factorial)?", sum(
        map(int, str(math.factorial(n)))
    )


def _fibonacci_mod(rng: random.Random) -> tuple[str, int]:
    n, modulus = rng.randrange(100, 5_000), rng.randrange(1_000, 100_000)
    previous, current = 0, 1  # F(0), F(1)
    for _ in range(n - 1):
        previous, current = current, (previous + current) % modulus
    question = f"What is the {n}-th Fibonacci number modulo {modulus}, with F(1) = F(2) = 1?"
    return question, current


def tool_prompt(rng: random.Random) -> Prompt:
    """A question with an exact integer answer, tedious by hand and quick in Python: a big
    product, a sum of primes, a factorial's digit sum or a Fibonacci number modulo m."""
    task = rng.choice((_product, _prime_sum, _factorial_digit_sum, _fibonacci_mod))
    text, answer = task(rng)
    return Prompt(text, answer=answer, meta={"task": task.__name__.lstrip("_")})


def tool_prompts(seed: int = 0) -> TaskSource:
    """The endless, seeded, resumable stream of ``tool_prompt`` tasks (a ``PromptSource``)."""
    return TaskSource("python_tool", tool_prompt, seed=seed)
