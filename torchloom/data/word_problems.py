"""Grade-school word problems and bare arithmetic, generated with worked solutions.

Each problem is a question, a short worked solution (one line per step, like ``3 * 12 = 36``,
then ``The answer is 36.``) and the exact non-negative integer answer. Word problems take 2 to
4 steps of ``+ - *`` and exact division over templates (shopping, boxes, ages, trips,
pizzas, savings, reading, teams, a bakery); bare arithmetic is a curriculum: level 0 is one
operation on small numbers, level 1 two operations, level 2 larger numbers. Results stay
mostly below 1000 so a small model can learn them.

Everything is drawn with ``random.Random``'s integer methods only, so a seed gives the same
problems on every machine. A fixed pool of held-out problems (``held_out_pool``) comes from
its own seed namespace; the pre-training corpus and the chat SFT set built here
(``builtin:word_problems`` and ``builtin:word_problems_chat``) never contain a held-out
question, and neither does the RL task's stream (torchloom/rl/word_problems.py).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from torchloom.data.cache import atomic_write_text

log = logging.getLogger(__name__)

# Bump when the problems, their wording or the files' layout change, so caches are rebuilt.
WORD_PROBLEMS_VERSION = 1
LEVELS = 3
HELD_OUT_POOL = 1000
"""Distinct held-out questions; training data and the RL stream never use any of them."""
MAX_ANSWER_SHARE = 0.015
CORPUS_PROBLEMS = 200_000
PROBLEMS_PER_DOCUMENT = 8
CHAT_CONVERSATIONS = 50_000
ARITHMETIC_SHARE = (1, 3)
"""One problem in three is bare arithmetic, the rest word problems (levels uniform)."""


class Problem(NamedTuple):
    question: str
    solution: str
    """Worked steps, one per line, then ``The answer is N.``"""
    answer: int


class _Work:
    """Records each step as ``a op b = c`` and returns c; refuses negatives and inexact division."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, a: int, op: str, b: int) -> int:
        if op == "/":
            assert b > 0 and a % b == 0, f"{a} / {b} is not exact"
            value = a // b
        else:
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert value >= 0, f"{a} {op} {b} is negative"
        self.lines.append(f"{a} {op} {b} = {value}")
        return value

    def problem(self, question: str, answer: int) -> Problem:
        return Problem(question, "\n".join([*self.lines, f"The answer is {answer}."]), answer)


# --- bare arithmetic ---------------------------------------------------------------------------


def arithmetic_problem(rng: random.Random, level: int) -> Problem:
    """``What is <expression>?``: level 0 one operation on numbers up to 50 (factors up to 12),
    level 1 two operations, level 2 one or two operations with an operand up to a few hundred."""
    work = _Work()
    large = level == 2
    op = rng.choice("+-*/")
    a, b = _operands(rng, op, large)
    x = work(a, op, b)
    expression = f"{a} {op} {b}"
    if level == 1 or (large and rng.randrange(2)):
        op2, c = _next_operand(rng, x)
        if op in "+-" and op2 in "*/":
            expression = f"({expression})"
        expression = f"{expression} {op2} {c}"
        x = work(x, op2, c)
    return work.problem(f"What is {expression}?", x)


def _operands(rng: random.Random, op: str, large: bool) -> tuple[int, int]:
    if op == "+":
        low, top = (10, 500) if large else (0, 51)
        return rng.randrange(low, top), rng.randrange(low, top)
    if op == "-":
        a = rng.randrange(100, 1000) if large else rng.randrange(1, 51)
        return a, rng.randrange(a + 1)
    if op == "*":
        return rng.randrange(10, 100) if large else rng.randrange(2, 13), rng.randrange(2, 10)
    divisor = rng.randrange(2, 10)
    return divisor * (rng.randrange(10, 100) if large else rng.randrange(1, 13)), divisor


def _next_operand(rng: random.Random, x: int) -> tuple[str, int]:
    """A second operation on ``x`` with a small operand, keeping the result in [0, 1000)."""
    divisors = [d for d in range(2, 10) if x % d == 0 and x // d >= 5]
    choices = ["+"] + (["-"] if x > 0 else []) + (["*"] if x < 100 else [])
    choices += ["/"] if divisors else []
    op = rng.choice(choices)
    if op == "/":
        return op, rng.choice(divisors)
    if op == "*":
        return op, rng.randrange(2, 10)
    return op, rng.randrange(1, min(x, 20) + 1) if op == "-" else rng.randrange(1, 21)


# --- word problems ------------------------------------------------------------------------------

_SHE = ("Ava", "Chloe", "Emma", "Grace", "Isla", "Kira", "Maya", "Olga", "Quinn", "Sofia", "Uma",
        "Wendy", "Zoe")  # fmt: skip
_HE = ("Ben", "David", "Farid", "Hiro", "Jamal", "Liam", "Noah", "Pedro", "Ravi", "Tom", "Victor",
       "Yusuf")  # fmt: skip
_PEOPLE = tuple((name, "she") for name in _SHE) + tuple((name, "he") for name in _HE)
_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells", "cards", "stamps",
           "beads", "candies", "crayons", "buttons", "oranges", "eggs", "toy cars")  # fmt: skip
_GOODS = ("notebooks", "pens", "books", "toys", "cups", "plates", "hats", "shirts", "balls",
          "kites", "lamps", "mugs")  # fmt: skip
_VEHICLES = ("car", "train", "bus", "truck", "boat", "cyclist")
_PURCHASES = ("bike", "game", "jacket", "radio", "watch", "skateboard", "guitar", "tent")
_BAKED = ("muffins", "cupcakes", "rolls", "cookies", "bagels", "pies")


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_PEOPLE)


def _up_to(rng: random.Random, level: int, tops: tuple[int, int, int], low: int = 2) -> int:
    """A number in [low, tops[level]]: the level sets how large the problem's numbers get."""
    return rng.randrange(low, tops[level] + 1)


def _shopping(rng: random.Random, level: int, work: _Work) -> Problem:
    name, pronoun = _person(rng)
    goods = rng.sample(_GOODS, 2)
    n, price = _up_to(rng, level, (5, 9, 12)), _up_to(rng, level, (5, 12, 25), low=1)
    total = work(n, "*", price)
    text = f"{name} buys {n} {goods[0]} for {price} dollars each"
    if level > 0 and rng.randrange(2):
        m, price2 = _up_to(rng, level, (5, 9, 12)), _up_to(rng, level, (5, 12, 25), low=1)
        total = work(total, "+", work(m, "*", price2))
        text += f" and {m} {goods[1]} for {price2} dollars each"
    paid = rng.choice([bill for bill in (10, 20, 50, 100, 200, 500, 1000) if bill > total][:2])
    change = work(paid, "-", total)
    question = (f"{text}. {pronoun.capitalize()} pays with {paid} dollars. How much change "
                f"does {pronoun} get back?")  # fmt: skip
    return work.problem(question, change)


def _boxes(rng: random.Random, level: int, work: _Work) -> Problem:
    name, pronoun = _person(rng)
    thing = rng.choice(_THINGS)
    boxes, per_box = _up_to(rng, level, (5, 9, 12)), _up_to(rng, level, (30, 40, 60), low=10)
    total = work(boxes, "*", per_box)
    friends = rng.randrange(2, min(6, total - 1) + 1)
    each = rng.randrange(max(1, total // (2 * friends)), (total - 1) // friends + 1)
    given = total - friends * each  # at least 1, and what is left shares out exactly
    rest = work(total, "-", given)
    question = (f"{name} has {boxes} boxes with {per_box} {thing} in each box. "
                f"{pronoun.capitalize()} gives away {given} {thing} and shares the rest equally "
                f"among {friends} friends. How many {thing} does each friend get?")  # fmt: skip
    return work.problem(question, work(rest, "/", friends))


def _ages(rng: random.Random, level: int, work: _Work) -> Problem:
    (a, _), (b, _), (c, _) = rng.sample(_PEOPLE, 3)
    x, y = _up_to(rng, level, (12, 20, 30), low=4), _up_to(rng, level, (8, 12, 20))
    if y < x and rng.randrange(2):
        b_age, relation = work(x, "-", y), "younger"
    else:
        b_age, relation = work(x, "+", y), "older"
    text = f"{a} is {x} years old. {b} is {y} years {relation} than {a}."
    if level == 0:
        return work.problem(f"{text} How old are {a} and {b} together?", work(x, "+", b_age))
    k = rng.randrange(2, 4)
    c_age = work(b_age, "*", k)
    text += f" {c} is {k} times as old as {b}."
    if level == 1:
        return work.problem(f"{text} How old is {c}?", c_age)
    together = work(work(x, "+", b_age), "+", c_age)
    return work.problem(f"{text} How old are the three of them together?", together)


def _trip(rng: random.Random, level: int, work: _Work) -> Problem:
    vehicle = rng.choice(_VEHICLES)
    per_liter = rng.choice((5, 10)) if level == 2 else 5
    speed, hours = per_liter * _up_to(rng, level, (6, 12, 8), low=1), _up_to(rng, level, (4, 6, 5))
    first = work(speed, "*", hours)
    text = f"A {vehicle} travels at {speed} km per hour for {hours} hours"
    if level == 0:
        more = _up_to(rng, level, (40, 40, 40), low=5)
        text += f" and then {more} km more"
        distance = work(first, "+", more)
    else:
        speed2 = per_liter * _up_to(rng, level, (6, 12, 8), low=1)
        hours2 = _up_to(rng, level, (4, 6, 5))
        distance = work(first, "+", work(speed2, "*", hours2))
        text += f" and then at {speed2} km per hour for {hours2} hours"
    if level < 2:
        return work.problem(f"{text}. How many km does it travel in total?", distance)
    question = (f"{text}. It uses 1 liter of fuel for every {per_liter} km. How many liters of "
                "fuel does it use?")  # fmt: skip
    return work.problem(question, work(distance, "/", per_liter))


def _steady_trip(rng: random.Random, level: int, work: _Work) -> Problem:
    vehicle = rng.choice(_VEHICLES)
    speed, hours = 5 * _up_to(rng, level, (6, 12, 16), low=1), _up_to(rng, level, (4, 6, 8))
    later = _up_to(rng, level, (5, 8, 10))
    text = f"A {vehicle} travels {speed * hours} km in {hours} hours at a steady speed."
    per_hour = work(speed * hours, "/", hours)
    if level == 0:
        question = f"{text} How many km does it travel in {later} hours?"
        return work.problem(question, work(per_hour, "*", later))
    done = _up_to(rng, level, (50, 100, 200), low=5)
    question = (f"{text} It has already traveled {done} km today. How many km will it have "
                f"traveled today after {later} more hours?")  # fmt: skip
    return work.problem(question, work(done, "+", work(per_hour, "*", later)))


def _pizza(rng: random.Random, level: int, work: _Work) -> Problem:
    friends, slices = rng.randrange(2, 9), rng.choice((4, 6, 8, 10, 12))
    pizzas = friends // math.gcd(slices, friends) * _up_to(rng, level, (3, 3, 4), low=1)
    total = work(pizzas, "*", slices)
    text = f"{friends} friends order {pizzas} pizzas. Each pizza is cut into {slices} slices."
    if level == 0:
        question = f"{text} They share the slices equally. How many slices does each friend get?"
        return work.problem(question, work(total, "/", friends))
    eaten = rng.randrange(1, max(1, total // friends // 2) + 1)  # most slices are left
    question = f"{text} Each friend eats {eaten} slices. How many slices are left over?"
    return work.problem(question, work(total, "-", work(friends, "*", eaten)))


def _savings(rng: random.Random, level: int, work: _Work) -> Problem:
    name, pronoun = _person(rng)
    weekly, weeks = _up_to(rng, level, (10, 20, 30), low=3), _up_to(rng, level, (6, 10, 12))
    total = work(weekly, "*", weeks)
    saves = f"saves {weekly} dollars every week for {weeks} weeks."
    text = f"{name} {saves}"
    if level > 0:
        start = _up_to(rng, level, (20, 50, 100), low=5)
        text = f"{name} has {start} dollars. {pronoun.capitalize()} {saves}"
        total = work(total, "+", start)
    if level == 2:
        gift = _up_to(rng, level, (20, 50, 60), low=5)
        text += f" {pronoun.capitalize()} also gets {gift} dollars as a gift."
        total = work(total, "+", gift)
    cost = rng.randrange(1, total)
    question = (f"{text} Then {pronoun} buys a {rng.choice(_PURCHASES)} for {cost} dollars. "
                f"How many dollars does {pronoun} have left?")  # fmt: skip
    return work.problem(question, work(total, "-", cost))


def _reading(rng: random.Random, level: int, work: _Work) -> Problem:
    name, pronoun = _person(rng)
    per_day, days = _up_to(rng, level, (10, 25, 40), low=3), _up_to(rng, level, (5, 7, 10))
    read = work(per_day, "*", days)
    text = f"{pronoun.capitalize()} reads {per_day} pages every day for {days} days."
    if level > 0:
        extra = _up_to(rng, level, (10, 30, 60), low=3)
        text += f" The next day {pronoun} reads {extra} more pages."
        read = work(read, "+", extra)
    pages = read + rng.randrange(1, (30, 100, 200)[level])
    question = (
        f"A book has {pages} pages. {name} starts reading it. {text} How many pages are left?"
    )
    return work.problem(question, work(pages, "-", read))


def _teams(rng: random.Random, level: int, work: _Work) -> Problem:
    size, teams = rng.randrange(2, 7), _up_to(rng, level, (8, 10, 12))
    balls = _up_to(rng, level, (6, 8, 10), low=3)
    students = size * teams
    count = work(students, "/", size)
    needed = work(count, "*", balls)
    text = (f"There are {students} students in a class. The teacher puts them in teams of "
            f"{size}. Each team gets {balls} balls.")  # fmt: skip
    if level == 0:
        return work.problem(f"{text} How many balls are needed?", needed)
    have = rng.randrange(1, needed // 2 + 1)
    question = f"{text} The gym has {have} balls. How many more balls does the teacher need?"
    return work.problem(question, work(needed, "-", have))


def _bakery(rng: random.Random, level: int, work: _Work) -> Problem:
    baked = rng.choice(_BAKED)
    per_box, boxes = rng.randrange(2, 13), _up_to(rng, level, (12, 20, 30), low=3)
    price = _up_to(rng, level, (8, 12, 15), low=3)
    made = per_box * boxes
    text = f"A bakery bakes {made} {baked} and packs them in boxes of {per_box}."
    packed = work(made, "/", per_box)
    if level > 0:
        unsold = rng.randrange(1, packed)
        text += f" It sells all the boxes but {unsold}."
        packed = work(packed, "-", unsold)
    question = f"{text} Each box sells for {price} dollars. How many dollars does the bakery get?"
    return work.problem(question, work(packed, "*", price))


TEMPLATES: tuple[Callable[[random.Random, int, _Work], Problem], ...] = (
    _shopping, _boxes, _ages, _trip, _steady_trip, _pizza, _savings, _reading, _teams, _bakery,
)  # fmt: skip


def word_problem(rng: random.Random, level: int) -> Problem:
    """A word problem from a random template; ``level`` (0-2) sets its numbers and steps."""
    return rng.choice(TEMPLATES)(rng, level, _Work())


def mixed_problem(rng: random.Random) -> Problem:
    """Bare arithmetic (``ARITHMETIC_SHARE``) or a word problem, at a random level."""
    share, out_of = ARITHMETIC_SHARE
    make = arithmetic_problem if rng.randrange(out_of) < share else word_problem
    return make(rng, rng.randrange(LEVELS))


# --- held out, training, files ----------------------------------------------------------------


@functools.cache
def held_out_pool() -> tuple[Problem, ...]:
    """``HELD_OUT_POOL`` problems with distinct questions, candidate i drawn from its own seed.

    Small answers (6, 8, 12, ...) are a little more common than 1.5% in ``mixed_problem``'s
    stream; a candidate is passed over when its answer would make up more than
    ``MAX_ANSWER_SHARE`` of the pool so far, so that on any prefix of the pool (the first 500
    problems, say) always answering one number scores at most about 1.5%.
    """
    problems: dict[str, Problem] = {}
    answers: Counter[int] = Counter()
    index = 0
    while len(problems) < HELD_OUT_POOL:
        problem = mixed_problem(random.Random(f"word_problems:held_out:{index}"))
        index += 1
        room = max(2, int(MAX_ANSWER_SHARE * (len(problems) + 1)))
        if problem.question in problems or answers[problem.answer] >= room:
            continue
        problems[problem.question] = problem
        answers[problem.answer] += 1
    return tuple(problems.values())


@functools.cache
def held_out_questions() -> frozenset[str]:
    return frozenset(p.question for p in held_out_pool())


def training_problem(rng: random.Random) -> Problem:
    """``mixed_problem``, drawn again from the same ``rng`` while its question is held out."""
    held_out = held_out_questions()
    while (problem := mixed_problem(rng)).question in held_out:
        pass
    return problem


def corpus_documents(count: int, seed: str = "word_problems:corpus") -> list[str]:
    """Pre-training documents of ``PROBLEMS_PER_DOCUMENT`` problems with worked solutions."""
    rng = random.Random(seed)
    documents = []
    for start in range(0, count, PROBLEMS_PER_DOCUMENT):
        problems = [training_problem(rng) for _ in range(min(PROBLEMS_PER_DOCUMENT, count - start))]
        documents.append(
            "\n\n".join(f"Question: {p.question}\nAnswer:\n{p.solution}" for p in problems)
        )
    return documents


def chat_conversations(
    count: int, seed: str = "word_problems:chat", direct_share: float = 0.0
) -> list[list[dict[str, str]]]:
    """Chats of one exchange: the question, then the worked solution; or, for a
    ``direct_share`` of them drawn at random, only its last line (``The answer is N.``)."""
    rng, direct = random.Random(seed), random.Random(f"{seed}:direct")
    chats = []
    for problem in (training_problem(rng) for _ in range(count)):
        reply = problem.solution
        if direct.random() < direct_share:
            reply = reply.rsplit("\n", 1)[-1]
        chats.append([{"role": "user", "content": problem.question},
                      {"role": "assistant", "content": reply}])  # fmt: skip
    return chats


def ensure_word_problem_corpus(cache_dir: Path) -> Path:
    """Path of the ``builtin:word_problems`` JSONL (field ``text``), generated on first use."""
    path = cache_dir / "builtin" / f"word_problems-v{WORD_PROBLEMS_VERSION}.jsonl"
    if not path.exists():
        documents = corpus_documents(CORPUS_PROBLEMS)
        atomic_write_text(path, "".join(json.dumps({"text": d}) + "\n" for d in documents))
        log.info("Generated %s: %d problems", path, CORPUS_PROBLEMS)
    return path


def ensure_word_problem_chat(cache_dir: Path, direct_share: float = 0.0) -> Path:
    """Path of the ``builtin:word_problems_chat`` JSONL (field ``messages``), generated on
    first use; with ``direct_share`` (``builtin:word_problems_chat_mixed``) that share of the
    replies states only the answer."""
    name = "word_problems_chat" if not direct_share else f"word_problems_chat_direct{direct_share}"
    path = cache_dir / "builtin" / f"{name}-v{WORD_PROBLEMS_VERSION}.jsonl"
    if not path.exists():
        chats = chat_conversations(CHAT_CONVERSATIONS, direct_share=direct_share)
        atomic_write_text(path, "".join(json.dumps({"messages": c}) + "\n" for c in chats))
        log.info("Generated %s: %d conversations", path, len(chats))
    return path


MIXED_DIRECT_SHARE = 0.5
"""The share of ``builtin:word_problems_chat_mixed``'s replies that give only the answer."""


def ensure_word_problem_chat_mixed(cache_dir: Path) -> Path:
    """``builtin:word_problems_chat_mixed``: the same chats, half of them answered directly.

    Instruct data often mixes worked and bare answers. A small model imitates both, but it
    cannot do a multi-step problem without writing the steps, so its direct answers are mostly
    wrong: the SFT model is right only sometimes (pass@k well above pass@1), and RL has a real
    skill to learn (work the problem out every time)."""
    return ensure_word_problem_chat(cache_dir, MIXED_DIRECT_SHARE)
