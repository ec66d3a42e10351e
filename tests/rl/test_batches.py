"""Rollouts to training rows, by hand: advantages follow each rollout's own group whatever the
order, DAPO's overlong shaping and filtering, the constant normalizer counting every turn, the
normalizer units, and dynamic sampling refilling the batch."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from torchloom.rl.batches import (
    advantages_by_rollout,
    informative,
    minibatch_groups,
    my_micro_batches,
    shaped_reward,
    to_batch,
)
from torchloom.rl.config import RLConfig
from torchloom.rl.rollout import Rollout, RolloutBatch
from torchloom.rl.sources import collect, group_plan
from torchloom.train.loss import IGNORE_INDEX


def rollout(group: int, reward: float, generated: int = 2, prompt: int = 2,
            finish: str = "stop") -> Rollout:  # fmt: skip
    tokens = list(range(1, prompt + generated + 1))
    mask = [False] * prompt + [True] * generated
    logprobs = [0.0] * prompt + [-0.5] * generated
    return Rollout(group, tokens, mask, logprobs, reward=reward, finish_reason=finish,
                   last_reply_len=generated)  # fmt: skip


def test_advantages_follow_each_rollouts_group_in_any_order() -> None:
    """Rollouts arrive interleaved (several generator ranks, refills): each one's advantage is
    (its reward - its group's mean) / its group's std."""
    cfg = RLConfig(group_size=4)
    rewards = {0: [1.0, 0.0, 0.0, 0.0], 7: [1.0, 1.0, 0.0, 0.5]}
    rollouts = [rollout(g, r) for g, rs in rewards.items() for r in rs]
    random.Random(3).shuffle(rollouts)
    got = advantages_by_rollout(rollouts, cfg)
    for r, advantage in zip(rollouts, got, strict=True):
        group = torch.tensor(rewards[r.group])
        want = (r.reward - group.mean()) / (group.std(correction=0) + 1e-6)
        assert abs(advantage - want.item()) < 1e-6, (r.group, r.reward, advantage, want)
    batch = to_batch(rollouts, got, cfg)
    assert batch.extras["advantages"][:, 0].tolist() == pytest.approx(got)


def test_overlong_shaping_and_filtering() -> None:
    cfg = RLConfig(max_new_tokens=10, overlong_buffer=4, overlong_penalty=0.5)
    # Replies of 6 tokens or fewer are not shaped; 8 is half-way into the buffer; 10 is cut.
    assert shaped_reward(rollout(0, 1.0, generated=6), cfg) == 1.0
    assert shaped_reward(rollout(0, 1.0, generated=8), cfg) == pytest.approx(0.75)
    assert shaped_reward(rollout(0, 1.0, generated=10, finish="length"), cfg) == pytest.approx(0.5)
    # Shaping makes otherwise equal rewards differ: the group carries signal.
    assert informative([rollout(0, 1.0, 6), rollout(0, 1.0, 10, finish="length")], cfg) == {0}
    filtered = RLConfig(max_new_tokens=10, overlong_filter=True)
    rows = [rollout(0, 1.0, 3), rollout(0, 0.0, 10, finish="length")]
    batch = to_batch(rows, [1.0, -1.0], filtered)
    assert (batch.labels[1] == IGNORE_INDEX).all()  # the cut rollout is out of the loss
    assert (batch.labels[0] != IGNORE_INDEX).sum() == 3
    # An environment that raised ends its episode with 'error': never trained on.
    failed = to_batch([rollout(0, 0.0, 3, finish="error"), rollout(0, 1.0, 3)], [-1, 1], cfg)
    assert (failed.labels[0] == IGNORE_INDEX).all() and (failed.labels[1] != IGNORE_INDEX).any()


@pytest.mark.parametrize("mode", ["token", "sequence", "constant"])
def test_weights_and_normalizer_units(mode: str) -> None:
    """token: every trained token weighs 1 and counts 1; sequence: 1/len, one unit per
    sequence; constant (Dr. GRPO): 1 / (max_new_tokens x max_turns), one unit per sequence."""
    cfg = RLConfig(loss_normalization=mode, max_new_tokens=5, max_turns=3)
    batch = to_batch([rollout(0, 1.0, generated=2), rollout(0, 0.0, generated=4)], [1, -1], cfg)
    mask = batch.labels != IGNORE_INDEX
    weights, units = batch.extras["weights"][mask].tolist(), batch.extras["norm_units"]
    if mode == "token":
        assert weights == [1.0] * 6 and units.sum() == 6
    elif mode == "sequence":
        assert weights == pytest.approx([0.5] * 2 + [0.25] * 4) and units.sum() == 2
    else:
        assert weights == pytest.approx([1 / 15] * 6) and units.sum() == 2


def test_gspo_brings_its_normalization_and_clip_range() -> None:
    cfg = RLConfig(ratio_level="sequence")
    assert cfg.normalization() == "sequence" and cfg.clip_range() == (3e-4, 4e-4)
    assert RLConfig().normalization() == "token" and RLConfig().clip_range() == (0.2, 0.28)
    set_by_hand = RLConfig(ratio_level="sequence", clip_low=0.1, loss_normalization="token")
    assert set_by_hand.normalization() == "token" and set_by_hand.clip_range() == (0.1, 4e-4)


def test_data_ranks_get_equal_counts_of_micro_batches() -> None:
    cfg = RLConfig(micro_batch_size=2)
    rows = [rollout(g, float(g % 2)) for g in range(5)]  # 3 micro-batches over 2 ranks
    first = my_micro_batches(rows, [0.0] * 5, cfg, dp_rank=0, dp_size=2)
    second = my_micro_batches(rows, [0.0] * 5, cfg, dp_rank=1, dp_size=2)
    assert len(first) == len(second) == 2
    idle = second[-1]
    assert (idle.labels == IGNORE_INDEX).all() and idle.extras["norm_units"].sum() == 0
    assert minibatch_groups([3, 4, 5, 6, 7], 2) == [[3, 4], [5, 6, 7]]


def test_dynamic_sampling_refills_until_the_batch_is_full() -> None:
    """Groups whose rewards are all equal are dropped and replaced by new groups, in rounds
    sized by the rate kept so far, until prompts_per_step groups carry signal."""
    cfg = RLConfig(prompts_per_step=8, group_size=2, max_refill_rounds=5)
    calls = []

    def generate(groups: list[int]) -> RolloutBatch:
        calls.append(list(groups))
        # Every third group has signal.
        rows = [rollout(g, float(i) if g % 3 == 0 else 1.0) for g in groups for i in range(2)]
        return RolloutBatch(rows, version=0, seconds=1.0)

    first, more = group_plan(cfg)
    batch = collect(generate, first, more, cfg)
    kept = sorted({r.group for r in batch.rollouts})
    print(f"rounds {calls}; kept {kept}; stats {batch.stats}")
    assert len(kept) == 8 and all(g % 3 == 0 for g in kept)
    assert calls[0] == list(range(8)) and calls[1][0] == 8  # refills continue after the first
    assert batch.stats["refill_rounds"] == len(calls) - 1 <= 5
    assert batch.stats["first_rollouts"] == 16 and batch.stats["rollouts"] == 2 * sum(
        map(len, calls)
    )
    assert batch.seconds == len(calls)


def test_without_refill_the_batch_shrinks_and_the_cap_holds() -> None:
    cfg = RLConfig(prompts_per_step=4, group_size=2, max_refill_rounds=0)

    def generate(groups: list[int]) -> RolloutBatch:
        rows = [rollout(g, float(i) if g == 1 else 0.0) for g in groups for i in range(2)]
        return RolloutBatch(rows, version=0, seconds=0.0)

    batch = collect(generate, *group_plan(cfg), cfg)
    assert sorted({r.group for r in batch.rollouts}) == [1]
    # Shares of several generator ranks interleave and never collide.
    plans = [group_plan(RLConfig(prompts_per_step=5), share, 2) for share in range(2)]
    assert plans[0][0] == [0, 2, 4] and plans[1][0] == [1, 3]
    refills = [list(itertools.islice(more, 3)) for _, more in plans]
    assert refills == [[6, 8, 10], [5, 7, 9]]


def test_refills_fill_the_batch_on_nearly_every_step() -> None:
    """With each group informative at random (half of them), two refill rounds fill the batch
    on at least 95% of 200 steps: each round is sized with a margin over the rate kept so far,
    so it rarely falls short (sized exactly, it falls short about half the time)."""
    cfg = RLConfig(prompts_per_step=32, group_size=2, max_refill_rounds=2)
    rng = random.Random(0)

    def generate(groups: list[int]) -> RolloutBatch:
        signal = {g: rng.random() < 0.5 for g in groups}
        rows = [rollout(g, float(i) if signal[g] else 1.0) for g in groups for i in range(2)]
        return RolloutBatch(rows, version=0, seconds=1.0)

    full, rounds = 0, []
    for _ in range(200):
        batch = collect(generate, *group_plan(cfg), cfg)
        full += len({r.group for r in batch.rollouts}) == cfg.prompts_per_step
        rounds.append(batch.stats["refill_rounds"])
    print(f"full on {full} of 200 steps; refill rounds per step {sum(rounds) / 200:.2f}")
    assert full >= 190


@pytest.mark.parametrize("rate", [0.04, 0.02, 0.01])
def test_refills_fill_the_batch_at_a_low_rate(rate: float) -> None:
    """Late in countdown 2-4% of groups carry signal (2% over the last tenth of the H200's
    whole run). A round is sized by that rate (up to 16 x prompts_per_step groups), so ten
    rounds fill the batch on at least 95% of 200 steps. With the rate floored at 1/8, rounds
    came out three times too small (~80% full at 4%); capped at 4 x prompts_per_step, ten
    rounds reach 656 groups, too few at 2% (the whole run's last ten updates: 4 full). At 1%
    (countdown's first updates) the first round often keeps nothing; its refill is then as
    large as the cap allows (a 4x one there: 173 of 200 full)."""
    cfg = RLConfig(prompts_per_step=16, group_size=2, max_refill_rounds=10)
    rng = random.Random(0)

    def generate(groups: list[int]) -> RolloutBatch:
        signal = {g: rng.random() < rate for g in groups}
        rows = [rollout(g, float(i) if signal[g] else 1.0) for g in groups for i in range(2)]
        return RolloutBatch(rows, version=0, seconds=1.0)

    full = sum(
        len({r.group for r in collect(generate, *group_plan(cfg), cfg).rollouts}) == 16
        for _ in range(200)
    )
    print(f"full on {full} of 200 steps")
    assert full >= 190
