"""The RL loop end to end on a tiny random model (CPU): metrics, bitwise trainer/generator
log-probs in batch-invariant mode, exact resume of a synchronous run, the lag bound of an
off-policy run under a slow trainer and a slow generator, and in-place weight sync (the task:
tests/rl/common.py)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from tests.rl.common import BASE, KEYS, records
from torchloom.cli import main, resolve_job
from torchloom.rl.loop import RLRunner


def trainer(tmp_path: Path, *args: str) -> RLRunner:
    _, job = resolve_job([*BASE, "--output.dir", str(tmp_path), *args])
    return RLRunner(job)


@pytest.mark.parametrize("sampling", [[], ["--rl.temperature", "0.7", "--rl.top_p", "0.9"]],
                         ids=["t1", "t0.7-p0.9"])  # fmt: skip
def test_batch_invariant_on_policy_log_probs_are_bitwise(tmp_path: Path, sampling: list) -> None:
    """Both sides score the distribution the tokens were drawn from (temperature and top-p
    applied), bit for bit."""
    assert main(["rl", *BASE, "--output.dir", str(tmp_path), "--training.steps", "2",
                 "--model.batch_invariant", "true", *sampling]) == 0  # fmt: skip
    rows = records(tmp_path)
    print([(r["step"], r["reward_mean"], r["logprob_diff_max"]) for r in rows])
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) >= KEYS, KEYS - set(r)
        assert r["logprob_diff_max"] == 0.0  # the trainer's forward = the generator's, bit for bit
        assert r["policy_lag"] == 0 and r["weight_sync_s"] == 0.0
        assert r["groups_kept"] > 0 and r["grad_norm"] > 0  # the policy was updated


def test_without_batch_invariance_the_difference_is_small_and_reported(tmp_path: Path) -> None:
    rl = trainer(tmp_path, "--training.steps", "1")
    before = [p.detach().clone() for p in rl.model.parameters()]
    rl.train()
    (row,) = records(tmp_path)
    print(f"logprob_diff_max {row['logprob_diff_max']:.2e}")
    assert 0.0 <= row["logprob_diff_max"] < 1e-4
    assert any(not torch.equal(a, p) for a, p in zip(before, rl.model.parameters(), strict=True))


def test_a_resumed_synchronous_run_continues_bitwise(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = ["--checkpoint.interval", "2"]
    trainer(whole, "--training.steps", "4", *args).train()
    trainer(split, "--training.steps", "2", *args).train()
    trainer(split, "--training.steps", "4", *args, "--checkpoint.resume", "true").train()
    keys = ("step", "reward_mean", "loss", "grad_norm", "response_len_mean", "clip_frac")
    expected = [{k: r[k] for k in keys} for r in records(whole)]
    got = [{k: r[k] for k in keys} for r in records(split)]
    print(expected)
    assert got == expected


@pytest.mark.parametrize("slow", ["trainer", "generator"])
def test_offpolicy_lag_stays_within_the_bound(tmp_path: Path, slow: str, monkeypatch) -> None:
    """max_offpolicy_steps 1: the generator makes batch s + 1 while the trainer trains on
    batch s, so after the first batch every rollout is one update old, never more, whether the
    trainer or the generator is the slow side."""
    rl = trainer(tmp_path, "--training.steps", "4", "--rl.max_offpolicy_steps", "1")
    name = "update" if slow == "trainer" else "rollouts"
    original = getattr(rl, name)

    def slowed(*args, **kwargs):
        time.sleep(0.4 + 0.2 * random.random())
        return original(*args, **kwargs)

    monkeypatch.setattr(rl, name, slowed)
    rl.train()
    lags = [r["policy_lag"] for r in records(tmp_path)]
    print(f"slow {slow}: policy lags {lags}")
    assert len(lags) == 4 and max(lags) <= 1
    assert lags == [0, 1, 1, 1]  # the first batch comes from the initial policy, unawaited
    assert all(r["weight_sync_s"] > 0 for r in records(tmp_path)[2:])  # pulled before batch 3


def test_lagged_evaluation_waits_for_the_generator_between_batches(
    tmp_path: Path, monkeypatch
) -> None:
    """A lagged run's mid-run evaluation and its generator thread never generate at the same
    time (on the H200 they disturbed each other: evaluations read up to 29 points low and the
    batch generated beside one had ~30-nat log-prob gaps)."""
    # A random model never counts letters right: every group's rewards are equal, and with
    # filter_zero_variance no step would update (a run that trains nothing fails at its end).
    rl = trainer(tmp_path, "--training.steps", "4", "--rl.max_offpolicy_steps", "1",
                 "--rl.task", "letters", "--eval.every", "1", "--eval.problems", "4",
                 "--rl.filter_zero_variance", "false")  # fmt: skip
    spans: dict[str, list[tuple[float, float]]] = {"rollouts": [], "evaluate": []}
    for name in spans:
        original = getattr(rl, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            time.sleep(0.2)  # widen the window an overlap would show in
            try:
                return _original(*args, **kwargs)
            finally:
                spans[_name].append((start, time.perf_counter()))

        monkeypatch.setattr(rl, name, timed)
    rl.train()
    overlaps = [(g, e) for g in spans["rollouts"] for e in spans["evaluate"][1:]
                if g[0] < e[1] and e[0] < g[1]]  # fmt: skip
    print(f"{len(spans['rollouts'])} batches, {len(spans['evaluate'])} evaluations")
    assert len(spans["evaluate"]) == 5 and len(spans["rollouts"]) == 4
    assert not overlaps, overlaps


def test_weight_sync_gives_the_generator_the_trainers_weights_in_place(tmp_path: Path) -> None:
    rl = trainer(tmp_path, "--training.steps", "1", "--rl.max_offpolicy_steps", "1")
    assert rl.gen_model is not rl.model
    storage = {n: p.data_ptr() for n, p in rl.gen_model.named_parameters()}
    with torch.no_grad():
        for p in rl.model.parameters():
            p.add_(torch.randn_like(p))
    rl.version = 1
    assert rl.sync_generator() > 0
    for (name, mine), theirs in zip(rl.gen_model.named_parameters(), rl.model.parameters(),
                                    strict=True):  # fmt: skip
        assert torch.equal(mine, theirs), name
        assert mine.data_ptr() == storage[name]  # copied into the same storage
    assert rl.gen_version == 1


def test_an_offpolicy_checkpoint_keeps_the_batches_generated_ahead(tmp_path: Path) -> None:
    """max_offpolicy_steps 1: the step-2 checkpoint holds the batch(es) generated for the next
    steps; a run resumed from it trains on exactly those (step 3 = the uninterrupted step 3)."""
    import shutil

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    args = ["--training.steps", "4", "--rl.max_offpolicy_steps", "1", "--checkpoint.interval", "2"]
    trainer(whole, *args).train()
    shutil.copytree(whole / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    rl = trainer(resumed, *args, "--checkpoint.resume", "true")
    rl.train()
    first = records(whole)[2]
    again = records(resumed)[0]
    print(f"uninterrupted step 3: {first['reward_mean']}, {first['loss']}; resumed: "
          f"{again['reward_mean']}, {again['loss']}")  # fmt: skip
    assert again["step"] == 3 and again["policy_lag"] == first["policy_lag"]
    keys = ("reward_mean", "response_len_mean", "loss", "grad_norm")
    assert [again[k] for k in keys] == [first[k] for k in keys]
    assert [r["step"] for r in records(resumed)] == [3, 4]


def test_held_out_evaluation_is_logged_and_plotted(tmp_path: Path) -> None:
    """--eval.every N: greedy pass@1 on the task's held-out set at step 0, every N updates and
    at the end; --eval.k: sampled pass@k at the start and the end; `torchloom plot --metric`
    draws it."""
    assert main(["rl", *BASE, "--output.dir", str(tmp_path), "--rl.task", "word_problems",
                 "--training.steps", "2", "--eval.every", "1", "--eval.problems", "6",
                 "--eval.k", "2", "--rl.filter_zero_variance", "false",
                 "--training.seq_len", "256"]) == 0  # fmt: skip
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(__import__("json").loads, lines) if "eval_pass@1" in r]
    print(evals)
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert [("eval_pass@2" in r) for r in evals] == [True, False, True]
    assert all(0.0 <= r["eval_pass@1"] <= 1.0 and r["time_eval_s"] > 0 for r in evals)
    assert main(["plot", str(tmp_path), "--metric", "eval_pass@1"]) == 0
    assert (tmp_path / "metrics-eval_pass_1.png").stat().st_size > 0
    assert main(["rl", *BASE, "--output.dir", str(tmp_path / "x"), "--eval.every", "1"]) == 2
    assert main(["rl", *BASE, "--output.dir", str(tmp_path / "y"), "--rl.task", "letters",
                 "--eval.every", "1", "--eval.problems", "49"]) == 2  # fmt: skip
