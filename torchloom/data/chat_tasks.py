"""The builtin chat set: short synthetic conversations about simple, checkable tasks.

No chat data ships offline, so torchloom generates its own on first use: arithmetic, word and
number lists to reverse or sort, letters to count, phrases to shout. Every answer follows from
its question by a fixed rule, so a small model can visibly learn them. Generation is seeded and
uses only ``random.Random``'s integer methods, so every machine writes the same file.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

from torchloom.data.cache import atomic_write_text

log = logging.getLogger(__name__)

# Bump when the tasks or their wording change, so old cached sets are not reused.
CHAT_TASKS_VERSION = 1
NUM_CONVERSATIONS = 3000
SEED = 2024

WORDS = (
    "apple",
    "bird",
    "boat",
    "bread",
    "chair",
    "cloud",
    "dog",
    "door",
    "field",
    "fish",
    "garden",
    "glass",
    "green",
    "hat",
    "hill",
    "horse",
    "house",
    "lamp",
    "leaf",
    "light",
    "milk",
    "moon",
    "night",
    "paper",
    "pencil",
    "rain",
    "river",
    "road",
    "rock",
    "salt",
    "sand",
    "ship",
    "snow",
    "stone",
    "star",
    "street",
    "sun",
    "table",
    "tree",
    "water",
    "window",
    "winter",
    "yellow",
    "summer",
    "orange",
    "purple",
    "silver",
    "basket",
    "candle",
    "forest",
    "island",
    "kitten",
    "letter",
    "mirror",
    "pocket",
    "rabbit",
    "ticket",
    "tiger",
    "violin",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly.",
    "Answer every question exactly and briefly.",
    "You solve small puzzles with words and numbers.",
)
Task = tuple[str, str, int | None]
"""(question, answer, numeric result a follow-up question can build on, or None)."""


def builtin_chat_path(cache_dir: Path) -> Path:
    """Where the builtin chat set lives in ``cache_dir`` (it may not exist yet)."""
    return cache_dir / "builtin" / f"chat_tasks-v{CHAT_TASKS_VERSION}.jsonl"


def ensure_builtin_chat(cache_dir: Path) -> Path:
    """Path of the builtin chat JSONL (field ``messages``), generating it on first use."""
    path = builtin_chat_path(cache_dir)
    if not path.exists():
        conversations = generate_chat_tasks(NUM_CONVERSATIONS, SEED)
        atomic_write_text(path, "".join(json.dumps({"messages": c}) + "\n" for c in conversations))
        log.info("Generated %s: %d conversations", path, len(conversations))
    return path


def generate_chat_tasks(count: int, seed: int) -> list[list[dict[str, str]]]:
    """``count`` conversations: a third open with a system message, a quarter have two turns."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        messages = []
        if rng.randrange(3) == 0:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        question, answer, result = rng.choice(TASKS)(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        if rng.randrange(4) == 0:
            if result is not None and rng.randrange(2) == 0:
                question, answer, result = _add_to_result(rng, result)
            else:
                question, answer, result = rng.choice(TASKS)(rng)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        conversations.append(messages)
    return conversations


def _add(rng: random.Random) -> Task:
    a, b = rng.randrange(100), rng.randrange(100)
    question = rng.choice(("What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."))
    return question.format(a=a, b=b), f"{a} + {b} = {a + b}", a + b


def _subtract(rng: random.Random) -> Task:
    a = rng.randrange(100)
    b = rng.randrange(a + 1)
    question = rng.choice(("What is {a} minus {b}?", "Subtract {b} from {a}."))
    return question.format(a=a, b=b), f"{a} - {b} = {a - b}", a - b


def _add_to_result(rng: random.Random, result: int) -> Task:
    c = rng.randrange(1, 20)
    question = rng.choice(("Now add {c} to that.", "And if you add {c} to the result?"))
    return question.format(c=c), f"{result} + {c} = {result + c}", result + c


def _words(rng: random.Random, low: int, high: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randrange(low, high + 1))]


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randrange(100) for _ in range(rng.randrange(3, 7))]


def _reverse_words(rng: random.Random) -> Task:
    words = _words(rng, 3, 5)
    question = rng.choice(("Reverse this list: {w}", "Write these words in reverse order: {w}"))
    return question.format(w=", ".join(words)), ", ".join(reversed(words)), None


def _sort_numbers(rng: random.Random) -> Task:
    numbers = _numbers(rng)
    listed = ", ".join(map(str, numbers))
    if rng.randrange(2):
        return (
            f"Sort from smallest to largest: {listed}",
            ", ".join(map(str, sorted(numbers))),
            None,
        )
    descending = sorted(numbers, reverse=True)
    return f"Sort from largest to smallest: {listed}", ", ".join(map(str, descending)), None


def _largest(rng: random.Random) -> Task:
    numbers = _numbers(rng)
    listed = ", ".join(map(str, numbers))
    return f"Which number is the largest: {listed}?", str(max(numbers)), max(numbers)


def count_letters_task(word: str) -> Task:
    question = f'How many letters are in the word "{word}"?'
    return question, f'The word "{word}" has {len(word)} letters.', len(word)


def _count_letters(rng: random.Random) -> Task:
    return count_letters_task(rng.choice(WORDS))


def _count_letter(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    letter = rng.choice(word)
    count = word.count(letter)
    times = "time" if count == 1 else "times"
    question = f'How many times does the letter "{letter}" appear in "{word}"?'
    return question, f'"{letter}" appears {count} {times} in "{word}".', count


def _spell(rng: random.Random) -> Task:
    word = rng.choice(WORDS)
    return f'Spell "{word}" letter by letter.', "-".join(word), None


def _upper_case(rng: random.Random) -> Task:
    phrase = " ".join(_words(rng, 2, 4))
    question = rng.choice(("Repeat in upper case: {p}", "Say this in capital letters: {p}"))
    return question.format(p=phrase), phrase.upper(), None


def _first_and_last(rng: random.Random) -> Task:
    words = _words(rng, 3, 5)
    question = f"What are the first and last words of: {' '.join(words)}?"
    return question, f"The first word is {words[0]} and the last word is {words[-1]}.", None


TASKS: tuple[Callable[[random.Random], Task], ...] = (
    _add,
    _subtract,
    _reverse_words,
    _sort_numbers,
    _largest,
    _count_letters,
    _count_letter,
    _spell,
    _upper_case,
    _first_and_last,
)
