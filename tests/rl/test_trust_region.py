"""The trust region on a tiny random model (CPU): several optimizer steps per batch move the
policy away from the one that sampled it, the ratio's denominator stays the policy the step
started from (the trainer's own log-probs, not the generator's), the clip acts, and the second
minibatch's gradient equals the hand-derived gradient of the clipped PPO and GSPO objectives."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.rl.common import BASE, records
from torchloom.cli import main, resolve_job
from torchloom.rl.loop import RLRunner
from torchloom.rl.objectives import SampledLogProbs
from torchloom.train.loss import IGNORE_INDEX

FAST = ["--rl.prompts_per_step", "2", "--rl.group_size", "4", "--rl.max_refill_rounds", "0",
        "--training.max_norm", "1e9", "--optimizer.lr", "0.05"]  # fmt: skip


def runner(tmp_path: Path, *args: str) -> RLRunner:
    _, job = resolve_job([*BASE, "--output.dir", str(tmp_path), *FAST, *args])
    return RLRunner(job)


def test_minibatches_clip_and_the_first_update_starts_at_ratio_one(tmp_path: Path) -> None:
    """Outside batch-invariant mode the generator's log-probs differ from the trainer's in the
    last bits; the ratio's denominator is the trainer's own (recomputed before the step), so
    the first update's ratios are exactly 1; later updates move them, and the clip acts."""
    assert main(["rl", *BASE, "--output.dir", str(tmp_path), *FAST, "--training.steps", "3",
                 "--rl.minibatches", "2", "--rl.ppo_epochs", "2"]) == 0  # fmt: skip
    rows = records(tmp_path)
    print([(r["updates"], r["ratio_max_first"], r["ratio_min_first"], r["ratio_max"],
            r["clip_frac"], r["logprob_diff_max"]) for r in rows])  # fmt: skip
    trained = [r for r in rows if r["updates"] > 0]
    assert trained and all(r["updates"] == 4 for r in trained)
    for r in trained:
        assert r["ratio_max_first"] == 1.0 and r["ratio_min_first"] == 1.0
        assert r["logprob_diff_max"] > 0  # what the generator's log-probs would have put in
    assert max(r["clip_frac"] for r in trained) > 0
    assert max(r["ratio_max"] for r in trained) > 1.28


def _expected_gradient(model: torch.nn.Module, batches: list, cfg, ratio_level: str) -> dict:
    """The gradient of the step's objective on ``batches`` at ``model``'s weights, from the
    closed form: d loss / d lp_t = -w_t * IS_t * A * r * [not clipped] / N per token (token
    level), or -IS_t * A_i * s_i * [sequence not clipped] / (|y_i| N) (GSPO's sequence level,
    sequence normalization)."""
    low, high = cfg.clip_range()
    scorer = SampledLogProbs(cfg)
    model.zero_grad(set_to_none=True)
    total_units = sum(int(b.extras["norm_units"].sum()) for b in batches)
    for b in batches:
        lp = model(b.tokens, b.positions, None, objective=scorer, targets={"labels": b.labels})
        mask = b.labels != IGNORE_INDEX
        old, behavior = b.extras["old_logprobs"], b.extras["behavior_logprobs"]
        adv = b.extras["advantages"]
        is_w = torch.where(mask, (old - behavior).exp().clamp(cfg.is_low, cfg.is_high), 0.0)
        log_r = torch.where(mask, lp.detach() - old, 0.0)
        if ratio_level == "token":
            r = log_r.exp()
            clipped = ((adv > 0) & (r > 1 + high)) | ((adv < 0) & (r < 1 - low))
            coef = -b.extras["weights"] * is_w * adv * r * (~clipped) / total_units
        else:
            lengths = mask.sum(-1, keepdim=True).clamp(min=1)
            s = (log_r.sum(-1, keepdim=True) / lengths).exp()
            clipped = ((adv > 0) & (s > 1 + high)) | ((adv < 0) & (s < 1 - low))
            coef = -is_w * adv * s * (~clipped) / (lengths * total_units)
        (torch.where(mask, coef, 0.0) * lp).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_the_second_minibatchs_gradient_is_the_clipped_objectives(
    tmp_path: Path, ratio_level: str
) -> None:
    args = ["--training.steps", "1", "--rl.minibatches", "2", "--rl.ratio_level", ratio_level]
    if ratio_level == "sequence":  # wide enough that some sequences are clipped, some not
        args += ["--rl.clip_low", "0.02", "--rl.clip_high", "0.02"]
    rl = runner(tmp_path, *args)
    rl.start()
    seen: list[tuple[list, torch.nn.Module]] = []
    step = rl.train_step.__class__.__call__

    def recording(self, batches):
        seen.append((batches, copy.deepcopy(rl.model)))  # the weights this update starts from
        return step(self, batches)

    grads: list[dict] = []
    optimizer_step = rl.optimizer.step

    def record_grads(*a, **k):
        grads.append({n: p.grad.clone() for n, p in rl.model.named_parameters()
                      if p.grad is not None})  # fmt: skip
        return optimizer_step(*a, **k)

    rl.optimizer.step = record_grads
    rl.train_step.__class__.__call__ = recording
    try:
        batch = rl.rollouts(1)
        assert len({r.group for r in batch.rollouts}) == 2, "need two groups with signal"
        rl.update(batch)
    finally:
        rl.train_step.__class__.__call__ = step
    assert len(seen) == 2 and len(grads) == 2
    batches, model_at_second = seen[1]
    want = _expected_gradient(model_at_second, batches, rl.job.rl, ratio_level)
    worst = max((grads[1][n] - g).abs().max().item() / g.abs().max().clamp(min=1e-12).item()
                for n, g in want.items())  # fmt: skip
    moved = max((p - q).abs().max().item() for p, q in zip(
        model_at_second.parameters(), seen[0][1].parameters(), strict=True))  # fmt: skip
    print(f"{ratio_level}: weights moved {moved:.3e} before the second minibatch; worst relative "
          f"gradient error {worst:.2e}")  # fmt: skip
    assert moved > 0
    assert worst < 1e-4


def test_a_resumed_lagged_run_generates_from_the_restored_policy(tmp_path: Path) -> None:
    """max_offpolicy_steps 1: the generator's copy was made from the initial weights; after a
    resume it must hold the checkpoint's, bit for bit, and say that version."""
    args = ["--training.steps", "2", "--rl.max_offpolicy_steps", "1", "--checkpoint.interval",
            "2", "--optimizer.lr", "1e-3"]  # fmt: skip
    runner(tmp_path, *args).train()
    rl = runner(tmp_path, *args[:-4], "--training.steps", "3", "--checkpoint.interval", "2",
                "--checkpoint.resume", "true")  # fmt: skip
    initial = [p.detach().clone() for p in rl.gen_model.parameters()]
    assert rl.start() == 2
    restored = dict(rl.model.named_parameters())
    for name, p in rl.gen_model.named_parameters():
        assert torch.equal(p, restored[name]), name
    assert any(not torch.equal(a, b) for a, b in zip(initial, rl.gen_model.parameters(),
                                                      strict=True))  # fmt: skip
    assert rl.gen_version == rl.version == 2
