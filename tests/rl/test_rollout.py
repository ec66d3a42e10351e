"""Multi-turn rollouts as a pipeline (torchloom/rl/rollout.py): environments answer in a thread
pool, an episode goes back to the generator as soon as its environment has answered, and each
turn continues the episode's cache slot. The rollouts do not depend on timing (bitwise in
batch-invariant mode), each turn prefills only its new tokens, every rollout says how it
ended, nothing is left in the generator, and a step takes about as long as its slowest episode
would alone (the workload: tests/rl/turns.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.rl.turns import (
    ByteChat,
    SleepToolEnv,
    alone_seconds,
    prefill_counts,
    rl_config,
    tiny_model,
    tool_prompts,
)
from torchloom.config.errors import ConfigError
from torchloom.generate.engine import Generator
from torchloom.rl.env import Prompt
from torchloom.rl.rollout import generate_rollouts

MAX_LEN = 256


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: a tiny model's many small ops, with two threads on a loaded 2-core
    machine, wait on each other for most of their time (runs varied ten-fold)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rollouts(generator, prompts, cfg, make_env=SleepToolEnv, tokenizer=None, **options):
    return generate_rollouts(
        generator, tokenizer or ByteChat(), prompts, make_env, cfg, seed=0, step=0, version=0,
        **options,
    )  # fmt: skip


def as_tuple(rollout) -> tuple:
    return (rollout.group, rollout.tokens, rollout.mask, rollout.logprobs, rollout.reward,
            rollout.turns, rollout.finish_reason)  # fmt: skip


def test_the_rollouts_do_not_depend_on_timing_and_prefill_only_new_tokens():
    """Batch-invariant llama3, 2 prompts x 4 episodes x 4 turns: the pipeline with the tools'
    delays, with no delays, turn by turn, and on 2 slots (kept slots evicted, so turns are
    prefilled whole) give the same rollouts bit for bit. The pipeline prefills each group's
    prompt once and then only each turn's new tokens, far fewer than whole contexts."""
    model = tiny_model(batch_invariant=True)
    cfg = rl_config(group_size=4, turns=4, max_new_tokens=12)
    prompts = tool_prompts(2, turns=4, tool_s=0.05, staggered=True)
    generator = Generator(model, max_batch=8, max_len=MAX_LEN)
    want = rollouts(generator, prompts, cfg).rollouts
    kept, whole = prefill_counts(want, cfg.group_size)
    print(f"prefilled {generator.prefill_tokens} tokens; whole contexts each turn: {whole}")
    assert generator.prefill_tokens == kept and kept < whole / 2
    assert generator.kept == [] and generator.idle
    assert sum(r.turns for r in want) > 2 * len(want)  # multi-turn, mostly
    runs = {
        "no delays": rollouts(Generator(model, 8, MAX_LEN), prompts, cfg,
                              lambda p: SleepToolEnv(p, scale=0.0)),
        "turn by turn": rollouts(Generator(model, 8, MAX_LEN), prompts, cfg, pipeline=False),
        "2 slots": rollouts(Generator(model, 2, MAX_LEN), prompts, cfg, env_workers=3),
    }  # fmt: skip
    for name, batch in runs.items():
        assert [as_tuple(r) for r in batch.rollouts] == [as_tuple(r) for r in want], name


def test_each_rollout_says_how_it_ended():
    """'stop': the environment said done; 'length': the last reply was cut at max_new_tokens
    (``truncated``), or the context had no room for another turn; 'turns': max_turns replies
    and the environment not done; 'error': the environment raised (reward 0, the error in
    info). Other episodes go on regardless, and no slot stays kept."""
    model = tiny_model()
    tokenizer = ByteChat()
    stops = set(tokenizer.stop_ids())
    prompts = [Prompt(f"p{i}", meta={"delays": [0.0] * 3}) for i in range(4)]
    fail = {"p1"}

    def make_env(prompt):
        return SleepToolEnv(prompt, fail_at=1 if prompt.text in fail else None)

    generator = Generator(model, max_batch=8, max_len=MAX_LEN)
    cfg = rl_config(group_size=4, turns=3, max_new_tokens=4)  # the env wants 4 replies
    reasons = set()
    for rollout in rollouts(generator, prompts, cfg, make_env).rollouts:
        reasons.add(rollout.finish_reason)
        last = rollout.tokens[-1]
        if rollout.finish_reason == "error":
            assert prompts[rollout.group].text in fail and rollout.reward == 0.0
            assert "tool failed at call 1" in rollout.info["error"] and rollout.turns == 2
        elif rollout.finish_reason == "length":
            assert rollout.truncated and last not in stops and rollout.mask[-1]
        else:
            assert rollout.finish_reason == "turns" and rollout.turns == 3 and last in stops
            assert not rollout.truncated
    assert reasons == {"error", "length", "turns"}
    assert generator.kept == [] and generator.idle
    # Done by the environment: 2 replies ("stop"), unless a reply was cut.
    short = [Prompt(f"q{i}", meta={"delays": [0.0]}) for i in range(2)]
    done = rollouts(generator, short, cfg).rollouts
    assert {r.finish_reason for r in done} == {"stop", "length"}
    assert all(r.turns == 2 for r in done if r.finish_reason == "stop")
    # No room left for another turn: 'length', without the environment's unanswered message.
    cramped = Generator(model, max_batch=8, max_len=50)
    for rollout in rollouts(cramped, short, cfg).rollouts:
        if rollout.finish_reason == "length" and rollout.info.get("context_full"):
            assert rollout.mask[-1] and rollout.tokens[-1] in stops
            break
    else:
        pytest.fail("no episode ran out of context")


class _BreaksAtTurn2(ByteChat):
    """A chat template that drops the assistant's reply from the second turn on."""

    def apply_chat_template(self, messages, add_generation_prompt=False):
        kept = [m for m in messages if m["role"] != "assistant"]
        return super().apply_chat_template(kept, add_generation_prompt)


def test_a_failing_step_leaves_nothing_in_the_generator():
    """An exception in the middle of the step (here a template that cannot be extended token
    by token) reaches the caller; the requests in flight and the kept slots are released."""
    model = tiny_model()
    generator = Generator(model, max_batch=8, max_len=MAX_LEN)
    cfg = rl_config(group_size=4, turns=3, max_new_tokens=8)
    with pytest.raises(ConfigError, match="does not render the conversation"):
        rollouts(generator, tool_prompts(2, 3, 0.05, True), cfg, tokenizer=_BreaksAtTurn2())
    assert generator.kept == [] and generator.idle
    assert len(rollouts(generator, tool_prompts(2, 3, 0.0, True), cfg).rollouts) == 8


def test_a_step_takes_about_as_long_as_its_slowest_episode_alone():
    """16 episodes x 4 turns whose tool calls sleep: one call of 1 s per episode, at a
    different turn for different episodes, the others 0.1 s. Turn by turn, every turn would
    wait for a 1 s tool (3.2 s of tools per step); pipelined, the step takes at most 1.5x its
    slowest episode alone (its generation alone plus its 1.2 s of tools)."""
    model = tiny_model()
    cfg = rl_config(group_size=4, turns=4, max_new_tokens=16)
    prompts = tool_prompts(4, turns=4, tool_s=1.0, staggered=True)
    generator = Generator(model, max_batch=16, max_len=MAX_LEN)
    start = time.perf_counter()
    batch = rollouts(generator, prompts, cfg)
    wall = time.perf_counter() - start
    alone = alone_seconds(model, prompts, cfg, batch.rollouts, MAX_LEN)
    tools = sum(r.info.get("tool_s", 0.0) for r in batch.rollouts)
    _, whole = prefill_counts(batch.rollouts, cfg.group_size)
    print(f"step {wall:.2f} s; slowest episode alone {max(alone):.2f} s; tools {tools:.1f} s "
          f"in all; prefilled {generator.prefill_tokens} tokens (whole contexts: {whole})")  # fmt: skip
    assert wall <= 1.5 * max(alone)
