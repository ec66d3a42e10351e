"""Held-out evaluation: the unbiased pass@k estimator against hand-computed values, the metrics
of scripted replies, EvalConfig's checks, and a run through the generator on a tiny random
llama3 (the keys, and the same replies every time)."""

from __future__ import annotations

import pytest

from torchloom.config.errors import ConfigError
from torchloom.data.cache import resolve_cache_dir
from torchloom.data.tokenizer import load_tokenizer
from torchloom.generate.engine import Completion, Generator, Request
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.rl.env import Check, Prompt
from torchloom.rl.evaluate import EvalConfig, evaluate, pass_at_k
from torchloom.rl.word_problems import check_final_answer, held_out_problems


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 0, 1, 0.0),
        (5, 1, 1, 1 / 5),
        (5, 5, 3, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2) / C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5) / C(10,5)
        (8, 1, 8, 1.0),  # k = n: solved once is solved
        (8, 0, 8, 0.0),
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2) / C(4,2)
    ],
)
def test_pass_at_k_matches_hand_computed_values(n: int, c: int, k: int, expected: float) -> None:
    got = pass_at_k(n, c, k)
    assert got == pytest.approx(expected, abs=1e-12), (n, c, k, got, expected)


def test_pass_at_k_refuses_impossible_counts() -> None:
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, c, k)


class _ScriptedTokenizer:
    """Prompts become one token (their index); a reply token decodes to its scripted text."""

    def __init__(self, prompts: list[Prompt], replies: list[str]) -> None:
        self.index = {p.text: i for i, p in enumerate(prompts)}
        self.replies = replies

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        assert add_generation_prompt and [m["role"] for m in messages] == ["user"]
        return messages[0]["content"]

    def encode_chat(self, text: str) -> list[int]:
        return [self.index[text]]

    def stop_ids(self, chat: bool = False) -> tuple[int, ...]:
        return (-1,)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.replies[ids[0]]


class _ScriptedGenerator:
    """Greedy: reply ``greedy[prompt]``; sample j of a prompt: reply ``sampled[prompt][j]``."""

    def __init__(self, greedy: list[int], sampled: list[list[int]]) -> None:
        self.greedy, self.sampled = greedy, sampled
        self.requests: list[Request] = []

    def generate(self, requests: list[Request]) -> list[Completion]:
        self.requests += requests
        out, seen = [], {}
        for r in requests:
            (prompt,) = r.prompt_ids
            j = seen[prompt] = seen.get(prompt, -1) + 1
            reply = self.greedy[prompt] if r.params.temperature == 0 else self.sampled[prompt][j]
            out.append(Completion(tokens=[reply], finish_reason="stop"))
        return out


def test_metrics_of_scripted_replies() -> None:
    prompts = [Prompt(f"q{i}", answer=i) for i in range(4)]
    replies = ["The answer is 0.", "The answer is 1.", "1", "The answer is 3.", "nothing"]
    # Greedy: prompt 0 right, 1 right, 2 wrong (formatted), 3 wrong (no form).
    greedy = [0, 1, 3, 4]
    # Samples (k = 3): prompt 0 right 3/3, prompt 1 right 0/3, 2 right 0/3, 3 right 1/3.
    sampled = [[0, 0, 0], [0, 4, 3], [4, 4, 4], [4, 3, 2]]
    generator = _ScriptedGenerator(greedy, sampled)
    tokenizer = _ScriptedTokenizer(prompts, replies)
    metrics = evaluate(generator, tokenizer, prompts, check_final_answer, max_new_tokens=5, k=3,
                       temperature=0.7, seed=11)  # fmt: skip
    print(metrics)
    assert metrics == {"pass@1": 2 / 4, "format@1": 3 / 4, "pass@3": 2 / 4,
                       "pass@1_sampled": 4 / 12}  # fmt: skip
    samples = [r.params for r in generator.requests if r.params.temperature > 0]
    assert len({p.seed for p in samples}) == 12 and {p.temperature for p in samples} == {0.7}
    assert all(r.params.max_new_tokens == 5 and r.params.stop_ids == (-1,)
               for r in generator.requests)  # fmt: skip
    assert set(evaluate(generator, tokenizer, prompts, check_final_answer, max_new_tokens=5)) == {
        "pass@1", "format@1"}  # fmt: skip


def test_eval_config_checks_its_values() -> None:
    EvalConfig().validate()
    EvalConfig(every=10, problems=1000, k=0, max_new_tokens=64, temperature=0.6).validate()
    for field, value, message in [
        ("every", -1, "--eval.every must be 0"),
        ("k", -2, "--eval.k must be 0"),
        ("max_new_tokens", -1, "--eval.max_new_tokens must be 0"),
        ("problems", 0, "--eval.problems must be between 1 and 1000"),
        ("problems", 1001, "--eval.problems must be between 1 and 1000"),
        ("temperature", 0.0, "--eval.temperature must be above 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EvalConfig(**{field: value}).validate()


def test_evaluate_through_the_generator_is_reproducible() -> None:
    """A tiny random llama3 answers 6 held-out problems greedily and 3 times sampled; a second
    evaluation gives the same replies (its own seeds per sample), so the same numbers."""
    tokenizer = load_tokenizer("builtin:stdlib_bpe", resolve_cache_dir(), 4096)
    model = build_model(resolve_model_config(ModelConfig(name="llama3", flavor="debug")))
    model.init_weights(0)
    prompts = held_out_problems(6)
    runs = []
    for _ in range(2):
        replies: list[str] = []

        def record(reply: str, answer: int, replies: list[str] = replies) -> Check:
            replies.append(reply)
            return check_final_answer(reply, answer)

        generator = Generator(model.eval(), max_batch=8, max_len=256)
        metrics = evaluate(generator, tokenizer, prompts, record, max_new_tokens=12, k=3, seed=5)
        runs.append((metrics, replies))
    print(runs[0])
    (metrics, replies), (metrics_again, replies_again) = runs
    assert set(metrics) == {"pass@1", "format@1", "pass@3", "pass@1_sampled"}
    assert all(0.0 <= v <= 1.0 for v in metrics.values())
    assert len(replies) == 6 + 6 * 3 and replies == replies_again and metrics == metrics_again
    assert len(set(replies[6:])) > 1  # sampling with different seeds gives different replies
