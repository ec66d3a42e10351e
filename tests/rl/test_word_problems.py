"""The word_problems task: seeded and resumable streams, answers recomputed from the problems
themselves, the final-answer check on hand-written replies, a held-out set that training never
sees and that a constant answer cannot pass, and the builtin data sets built from it."""

from __future__ import annotations

import ast
import itertools
import json
import operator
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data import word_problems as wp
from torchloom.data.config import DataConfig
from torchloom.data.sources import iter_documents, resolve_chat_sources, resolve_sources
from torchloom.rl.tasks import TASKS, make_env
from torchloom.rl.word_problems import (
    arithmetic_problem,
    best_constant_accuracy,
    check_final_answer,
    held_out_problems,
    word_problem,
)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}  # fmt: skip
_SYMBOLS = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult, "/": ast.Div}
_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp) and type(node.op) in _OPS, ast.dump(node)
    return _OPS[type(node.op)](_value(node.left), _value(node.right))


def _all_problems(per_level: int = 40) -> list[wp.Problem]:
    problems = []
    for level in range(wp.LEVELS):
        for i in range(per_level):
            problems.append(arithmetic_problem(random.Random(f"a{level}:{i}"), level))
            problems.append(word_problem(random.Random(f"w{level}:{i}"), level))
            for template in wp.TEMPLATES:
                rng = random.Random(f"{template.__name__}{level}:{i}")
                problems.append(template(rng, level, wp._Work()))
    return problems


def test_a_stream_is_seeded_and_resumes_from_its_state() -> None:
    first = [p.text for p in itertools.islice(TASKS["word_problems"](seed=3), 30)]
    again = [p.text for p in itertools.islice(TASKS["word_problems"](seed=3), 30)]
    other = [p.text for p in itertools.islice(TASKS["word_problems"](seed=4), 30)]
    assert first == again and first != other
    source = TASKS["word_problems"](seed=3)
    list(itertools.islice(source, 12))
    resumed = TASKS["word_problems"](seed=0)
    resumed.load_state_dict(source.state_dict())
    assert [p.text for p in itertools.islice(resumed, 18)] == first[12:]


def test_arithmetic_answers_equal_the_question_s_expression() -> None:
    for level in range(wp.LEVELS):
        for i in range(300):
            problem = arithmetic_problem(random.Random(f"{level}:{i}"), level)
            expression = problem.question.removeprefix("What is ").removesuffix("?")
            value = _value(ast.parse(expression, mode="eval").body)
            assert value == problem.answer, (problem.question, value, problem.answer)
            steps = problem.solution.count("\n")
            assert steps in ((1,), (2,), (1, 2))[level], problem


def test_every_solution_step_is_exact_and_built_from_the_question() -> None:
    """Each step's arithmetic is right, its operands are numbers of the question or results of
    earlier steps, and the final line gives the last result as the answer."""
    answers = []
    for problem in _all_problems():
        *lines, last = problem.solution.split("\n")
        known = {int(n) for n in re.findall(r"\d+", problem.question)}
        assert 1 <= len(lines) <= 4 and last == f"The answer is {problem.answer}.", problem
        for line in lines:
            a, op, b, result = _STEP.fullmatch(line).groups()
            a, b, result = int(a), int(b), int(result)
            assert a in known and b in known, (problem.question, line, sorted(known))
            assert _OPS[_SYMBOLS[op]](Fraction(a), Fraction(b)) == result, line
            known.add(result)
        assert result == problem.answer >= 0, problem
        answers.append(problem.answer)
    big = sum(a >= 1000 for a in answers) / len(answers)
    print(f"{len(answers)} problems, largest answer {max(answers)}, share >= 1000: {big:.4f}")
    assert big < 0.01


def test_word_problems_recomputed_from_their_wording() -> None:
    for i in range(200):
        rng = random.Random(i)
        problem = wp._shopping(rng, 2, wp._Work())
        bought = re.findall(r"(\d+) \w+ for (\d+) dollars each", problem.question)
        paid = int(re.search(r"pays with (\d+) dollars", problem.question).group(1))
        assert problem.answer == paid - sum(int(n) * int(p) for n, p in bought), problem
        problem = wp._pizza(rng, 0, wp._Work())
        friends, pizzas, slices = map(int, re.findall(r"\d+", problem.question))
        assert problem.answer * friends == pizzas * slices, problem
        problem = wp._teams(rng, 1, wp._Work())
        students, size, balls, have = map(int, re.findall(r"\d+", problem.question))
        assert problem.answer == students // size * balls - have > 0, problem


@pytest.mark.parametrize(
    ("reply", "answer", "expected"),
    [
        ("3 * 12 = 36\nThe answer is 36.", 36, (True, True)),
        ("The answer is 35.", 36, (True, False)),
        ("The answer is 36, I think. Or 40.", 36, (True, True)),  # the stated answer wins
        ("the answer is 12. no wait. The answer is 36", 36, (True, True)),  # the last one
        ("3 * 12 = 36", 36, (False, True)),  # right, but not in the form
        ("3 * 12 = 35", 36, (False, False)),
        ("The answer is 3.5.", 36, (False, False)),
        ("The answer is -4.", -4, (True, True)),
        ("I do not know.", 36, (False, False)),
        ("", 0, (False, False)),
    ],
)
def test_the_check_reads_the_final_answer(reply: str, answer: int, expected: tuple) -> None:
    assert tuple(check_final_answer(reply, answer)) == expected


def test_the_environment_rewards_the_worked_solution() -> None:
    prompt = next(iter(TASKS["word_problems"](seed=0)))
    env = make_env(prompt, format_reward=0.1)
    env.reset(prompt)
    assert env.step(prompt.meta["solution"]).reward == 1.0
    env.reset(prompt)
    assert env.step(f"The answer is {prompt.answer + 1}.").reward == 0.1


def test_training_never_sees_a_held_out_question() -> None:
    pool = [p.text for p in held_out_problems(wp.HELD_OUT_POOL)]
    held_out = set(pool)
    assert (
        len(held_out) == wp.HELD_OUT_POOL and [p.text for p in held_out_problems(500)] == pool[:500]
    )
    # A generator whose first draw is held-out problem 0 is asked again.
    rng = random.Random("word_problems:held_out:0")
    assert wp.mixed_problem(random.Random("word_problems:held_out:0")).question in held_out
    assert wp.training_problem(rng).question not in held_out
    stream = [p.text for p in itertools.islice(TASKS["word_problems"](seed=0), 20_000)]
    corpus = "\n".join(wp.corpus_documents(4000))
    chats = [c[0]["content"] for c in wp.chat_conversations(4000, direct_share=0.5)]
    leaked = [q for q in held_out if q in stream or f"Question: {q}\n" in corpus or q in chats]
    # The stream would meet held-out questions (small arithmetic repeats) if it did not skip them.
    would_meet = sum(wp.mixed_problem(random.Random(f"word_problems:0:{i}")).question in held_out
                     for i in range(20_000))  # fmt: skip
    print(f"held-out questions met without the skip: {would_meet} in 20000; leaked: {leaked[:3]}")
    assert not leaked and would_meet > 0


def test_a_constant_answer_scores_under_two_percent_held_out() -> None:
    answer, accuracy = best_constant_accuracy(held_out_problems(500))
    print(f"best constant answer {answer}: {accuracy:.3f} of 500 held-out problems")
    assert accuracy < 0.02
    arithmetic = sum(p.text.startswith("What is ") for p in held_out_problems(500))
    assert 100 < arithmetic < 250, arithmetic  # both kinds are measured


def test_builtin_sources_generate_their_files_once(tmp_path: Path) -> None:
    DataConfig(sources=["builtin:word_problems"]).validate()
    DataConfig(format="chat", sources=["builtin:word_problems_chat"]).validate()
    with pytest.raises(ConfigError, match="holds chat data but --data.format is text"):
        DataConfig(sources=["builtin:word_problems_chat"]).validate()
    with pytest.raises(ConfigError, match="Did you mean 'builtin:word_problems'"):
        DataConfig(sources=["builtin:word_problem"]).validate()
    counts = {"CORPUS_PROBLEMS": 64, "CHAT_CONVERSATIONS": 10}
    with pytest.MonkeyPatch.context() as patch:
        for name, count in counts.items():
            patch.setattr(wp, name, count)
        (text,) = resolve_sources(["builtin:word_problems"], "text", tmp_path)
        (chat,) = resolve_chat_sources(["builtin:word_problems_chat"], tmp_path)
    documents = list(iter_documents([text]))
    assert len(documents) == 64 // wp.PROBLEMS_PER_DOCUMENT
    assert documents[0].startswith("Question: ") and "\nThe answer is " in documents[0]
    lines = chat.path.read_text().splitlines()
    (user, assistant) = json.loads(lines[0])["messages"]
    assert len(lines) == 10 and user["role"] == "user" and assistant["role"] == "assistant"
    assert assistant["content"].rsplit("\n", 1)[-1].startswith("The answer is ")
    assert resolve_sources(["builtin:word_problems"], "text", tmp_path)[0] == text  # cached


def test_the_mixed_chat_set_answers_half_directly() -> None:
    """builtin:word_problems_chat_mixed: the same questions as the worked set, and about half
    of the replies are the worked solution's last line alone, chosen by a seeded draw."""
    worked = wp.chat_conversations(2000)
    mixed = wp.chat_conversations(2000, direct_share=wp.MIXED_DIRECT_SHARE)
    assert [c[0] for c in mixed] == [c[0] for c in worked]
    direct = 0
    for (_, full), (_, reply) in zip(worked, mixed, strict=True):
        if reply != full:
            direct += 1
            assert reply["content"] == full["content"].rsplit("\n", 1)[-1]
            assert reply["content"].startswith("The answer is ")
    print(f"{direct} of 2000 replies direct")
    assert 900 < direct < 1100
    assert mixed == wp.chat_conversations(2000, direct_share=wp.MIXED_DIRECT_SHARE)
