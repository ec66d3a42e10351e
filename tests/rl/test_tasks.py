"""Built-in RL tasks: rewards on hand-written replies, the countdown checker's refusals, seeded
and resumable prompt streams, and questions worded exactly as the SFT chat set words them."""

from __future__ import annotations

import random
import re
from collections import Counter
from itertools import islice

import pytest

from torchloom.rl.env import Prompt
from torchloom.rl.tasks import TASKS, countdown_value, make_env

# The question templates of torchloom.data.chat_tasks (_add, _subtract, _sort_numbers).
ADD_TEMPLATES = ("What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.")
SUBTRACT_TEMPLATES = ("What is {a} minus {b}?", "Subtract {b} from {a}.")
SORT_TEMPLATES = ("Sort from smallest to largest: {n}", "Sort from largest to smallest: {n}")


def reward(prompt: Prompt, reply: str, format_reward: float = 0.0) -> tuple[float, dict]:
    env = make_env(prompt, format_reward=format_reward)
    assert env.reset(prompt) == prompt.text
    turn = env.step(reply)
    assert turn.done and turn.observation is None
    return turn.reward, turn.info


ADD = Prompt("What is 12 plus 30?", answer=42, meta={"task": "arithmetic"})


@pytest.mark.parametrize(
    ("reply", "expected", "format_ok"),
    [
        ("12 + 30 = 42", 1.0, True),  # the chat_tasks answer format
        ("42", 1.0, True),
        ("The answer is 42.", 1.0, True),
        ("12 + 30 = 43", 0.1, True),
        ("-42", 0.1, True),
        ("forty-two", 0.0, False),
        ("", 0.0, False),
        ("12 + 30 = 42.5", 0.0, False),
        ("42 is what you get from 12 + 30", 0.1, True),  # the last number counts
    ],
)
def test_arithmetic_rewards(reply: str, expected: float, format_ok: bool) -> None:
    got, info = reward(ADD, reply, format_reward=0.1)
    assert (got, info["format_ok"]) == (expected, format_ok), f"reply {reply!r}: {got}, {info}"
    assert info["correct"] == (expected == 1.0)


def test_arithmetic_negative_and_default_format_reward() -> None:
    negative = Prompt("?", answer=-18, meta={"task": "arithmetic"})
    assert reward(negative, "12 - 30 = -18")[0] == 1.0
    assert reward(negative, "12-30=-18")[0] == 1.0
    assert reward(negative, "12-30")[0] == 0.0  # "-" after a digit is subtraction: 30
    assert reward(ADD, "12 + 30 = 41") == (0.0, {"format_ok": True, "correct": False})


SORT = Prompt("Sort from largest to smallest: 3, 41, 7", answer=[41, 7, 3], meta={"task": "sort"})


@pytest.mark.parametrize(
    ("reply", "expected", "format_ok"),
    [
        ("41, 7, 3", 1.0, True),  # the chat_tasks answer format
        ("41,7,3", 1.0, True),
        ("Sorted: 41, 7, 3.", 1.0, True),
        ("3, 7, 41", 0.1, True),
        ("41, 7", 0.0, False),
        ("41, 7, 3, 3", 0.0, False),
        ("41, 7.5, 3", 0.0, False),
        ("no idea", 0.0, False),
    ],
)
def test_sort_rewards(reply: str, expected: float, format_ok: bool) -> None:
    got, info = reward(SORT, reply, format_reward=0.1)
    assert (got, info["format_ok"]) == (expected, format_ok), f"reply {reply!r}: {got}, {info}"


def test_sort_negative_numbers() -> None:
    prompt = Prompt("?", answer=[-5, 0, 2], meta={"task": "sort"})
    assert reward(prompt, "-5, 0, 2")[0] == 1.0
    assert reward(prompt, "5, 0, 2")[0] == 0.0


COUNTDOWN = Prompt("?", answer={"numbers": [1, 9, 9], "target": 72}, meta={"task": "countdown"})


@pytest.mark.parametrize(
    ("reply", "expected", "format_ok"),
    [
        ("9 * (9 - 1)", 1.0, True),
        ("(9 - 1) * 9 = 72", 1.0, True),
        ("Let me think.\n9*(9-1)", 1.0, True),
        ("9 * 9 - 1", 0.1, True),
        ("9 * 9", 0.1, True),  # not every number has to be used
        ("8 * 9", 0.0, False),  # 8 is not given
        ("9 * (9 - 1) * 1 * 1", 0.0, False),  # 1 used twice
        ("72", 0.0, False),
        ("9", 0.0, False),  # a given number alone combines nothing (the H200 run's hack)
        ("(9)", 0.0, False),
        ("", 0.0, False),
    ],
)
def test_countdown_rewards(reply: str, expected: float, format_ok: bool) -> None:
    got, info = reward(COUNTDOWN, reply, format_reward=0.1)
    assert (got, info["format_ok"]) == (expected, format_ok), f"reply {reply!r}: {got}, {info}"


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "abs(9)",
        "x * 9",
        "(9).real",
        "9 ** 1",
        "9 / 1",
        "9 // 1",
        "-9 + 9",
        "9 if 1 else 9",
        "[9]",
        "'9'",
        "9.0 + 1",
        "0x9",
        "9 9",
        "()",
        "(" * 300 + "9" + ")" * 300,
    ],
)
def test_countdown_refuses_non_arithmetic(expression: str) -> None:
    assert countdown_value(expression, [1, 9, 9]) is None, expression


def test_countdown_value() -> None:
    assert countdown_value("9 * (9 - 1)", [1, 9, 9]) == 72
    assert countdown_value(" 1 + 9 ", [9, 1]) == 10
    assert countdown_value("9 + 9 + 9", [1, 9, 9]) is None


def test_countdown_prompts_are_reachable() -> None:
    # Brute force over left folds of ordered subsets: the generator builds targets that way.
    def reachable(numbers: list[int]) -> set[int]:
        values = set(numbers)
        for i, n in enumerate(numbers):
            rest = numbers[:i] + numbers[i + 1 :]
            for v in reachable(rest) if rest else ():
                values |= {v + n, v - n, v * n}
        return values

    for prompt in islice(TASKS["countdown"](seed=3), 30):
        numbers, target = prompt.answer["numbers"], prompt.answer["target"]
        assert target in reachable(numbers), f"{target} unreachable from {numbers}"
        assert target > 0


@pytest.mark.parametrize("task", sorted(TASKS))
def test_same_seed_same_prompts(task: str) -> None:
    first = list(islice(TASKS[task](seed=5), 20))
    assert first == list(islice(TASKS[task](seed=5), 20))
    assert first != list(islice(TASKS[task](seed=6), 20))


def test_prompts_are_pinned() -> None:
    # Only random.Random's integer methods and a str seed: these hold on every machine.
    texts = [p.text for p in islice(TASKS["arithmetic"](seed=0), 3)]
    assert texts == ["Subtract 14 from 15.", "What is 97 minus 88?", "Add 52 and 87."]
    assert next(iter(TASKS["sort"](seed=0))).answer == [5, 14, 32, 38, 48, 87]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_resume(task: str) -> None:
    uninterrupted = iter(TASKS[task](seed=1))
    source = TASKS[task](seed=1)
    list(islice(source, 7))
    list(islice(uninterrupted, 7))
    resumed = TASKS[task](seed=0)
    resumed.load_state_dict(source.state_dict())
    assert list(islice(resumed, 10)) == list(islice(uninterrupted, 10))


def test_mixed_has_both_tasks_and_envs_for_them() -> None:
    prompts = list(islice(TASKS["mixed"](seed=0), 40))
    assert {p.meta["task"] for p in prompts} == {"arithmetic", "sort"}
    for prompt in prompts:
        assert make_env(prompt).max_turns == 1


def test_make_env_unknown_task() -> None:
    with pytest.raises(ValueError, match="no built-in check"):
        make_env(Prompt("?", meta={"task": "chess"}))


def _template_regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template)
    for name, group in (("a", r"(?P<a>\d+)"), ("b", r"(?P<b>\d+)"), ("n", r"(?P<n>\d+(, \d+)*)")):
        pattern = pattern.replace(re.escape("{" + name + "}"), group)
    return re.compile(pattern)


def test_arithmetic_worded_as_chat_tasks() -> None:
    signed = [(_template_regex(t), +1) for t in ADD_TEMPLATES]
    signed += [(_template_regex(t), -1) for t in SUBTRACT_TEMPLATES]
    seen = set()
    for prompt in islice(TASKS["arithmetic"](seed=0), 200):
        matches = [(m, sign) for regex, sign in signed if (m := regex.fullmatch(prompt.text))]
        assert len(matches) == 1, f"{prompt.text!r} matches {len(matches)} chat_tasks templates"
        ((match, sign),) = matches
        a, b = int(match["a"]), int(match["b"])
        assert a < 100 and b < 100
        assert prompt.answer == a + sign * b >= 0, prompt
        seen.add(match.re.pattern)
    assert len(seen) == len(ADD_TEMPLATES) + len(SUBTRACT_TEMPLATES)


def test_sort_worded_as_chat_tasks() -> None:
    ascending, descending = (_template_regex(t) for t in SORT_TEMPLATES)
    for prompt in islice(TASKS["sort"](seed=0), 100):
        match = ascending.fullmatch(prompt.text) or descending.fullmatch(prompt.text)
        assert match, f"{prompt.text!r} matches no chat_tasks sort template"
        numbers = [int(n) for n in match["n"].split(", ")]
        assert 3 <= len(numbers) <= 6
        descending_order = match.re is descending
        assert prompt.answer == sorted(numbers, reverse=descending_order), prompt


def test_letters_task_is_worded_as_the_sft_set_and_checks_the_count() -> None:
    from torchloom.rl.tasks import letters_prompt

    prompt = letters_prompt(random.Random(3))
    word = prompt.text.split('"')[1]
    assert prompt.text == f'How many letters are in the word "{word}"?'
    assert prompt.answer == len(word) and prompt.meta["task"] == "letters"
    env = make_env(prompt)
    env.reset(prompt)
    assert env.step(f'The word "{word}" has {len(word)} letters.').reward == 1.0
    env.reset(prompt)
    assert env.step(f'The word "{word}" has {len(word) + 1} letters.').reward == 0.0


def test_countdown_draws_two_to_four_numbers() -> None:
    # The two-number rung keeps a small model's groups informative (benchmarks/RESULTS.md).
    sizes = Counter(len(p.answer["numbers"]) for p in islice(TASKS["countdown"](seed=0), 300))
    assert set(sizes) == {2, 3, 4} and min(sizes.values()) > 60, sizes
