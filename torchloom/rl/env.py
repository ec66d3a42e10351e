"""What an RL experiment is made of, as a user writes it: a prompt dataset, an environment
(multi-turn: the model's reply in, the next observation / tool result / done out) and a reward.

A rollout starts from one ``Prompt``. ``Environment.reset(prompt)`` returns the first user
message; the model replies; ``Environment.step(reply)`` returns a ``Turn``: either the next
user message (an observation, a tool's output) or ``done=True`` with the episode's reward. The
loop renders the conversation with the tokenizer's chat template, so an environment deals in
text only. A one-turn task is an environment whose first ``step`` is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


@dataclass
class Prompt:
    """One task instance: the first user message and what the reward needs to check it."""

    text: str
    answer: Any = None
    """The reference (the expected result, a list to sort, ...), opaque to the loop."""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """What the environment says after a reply."""

    observation: str | None = None
    """The next user message (a tool result, feedback); None when done."""
    done: bool = False
    reward: float = 0.0
    """The episode's reward, read when done."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to log (e.g. ``format_ok``)."""


class Check(NamedTuple):
    """A reply's verdict on a one-turn task: it has the expected form, and its value is right."""

    format_ok: bool
    correct: bool


class Environment(Protocol):
    """One episode at a time per instance; the loop makes one instance per rollout
    (``make_env``), so instances may keep state. ``reset`` and ``step`` run in a thread pool
    (torchloom/rl/rollout.py): an instance is called by one thread at a time, but different
    instances run at once, so what they share must be thread-safe."""

    max_turns: int
    """Replies the model may give before the episode is cut (reward as ``step`` last said)."""

    def reset(self, prompt: Prompt) -> str:
        """The first user message of the episode for ``prompt``."""
        ...

    def step(self, reply: str) -> Turn:
        """Take the model's reply; the next message, or done with the reward."""
        ...


class PromptSource(Protocol):
    """An endless, seeded, resumable stream of prompts."""

    def __iter__(self) -> Iterator[Prompt]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
