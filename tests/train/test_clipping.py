"""Gradient clipping as the Trainer applies it, checked against AdamW stepped by hand.

The debug recipe's gradient norms (about 0.5-0.7) stay below the default max_norm 1.0, so a
run with the default never clips; these runs set max_norm far below and far above the norm.
"""

import json

import pytest
import torch

from torchloom.cli import resolve_job
from torchloom.parallel import clip_coefficient
from torchloom.train.optim import TritonAdamW, clip_gradients
from torchloom.train.trainer import Trainer


def _clip_factor(norm: float, max_norm: float) -> float:
    """What clipping multiplies every gradient by (torch's clip_grad_norm_ convention)."""
    return min(1.0, max_norm / (norm + 1e-6))


def _train_and_replay(tmp_path, max_norm: float, steps: int = 2) -> None:
    """Train ``steps`` steps through the real Trainer while hooks record each parameter's
    gradient before clipping; replay the run with a fresh torch AdamW on copies of the initial
    weights fed gradients scaled by min(1, max_norm / norm); compare moments, weights and the
    logged norms."""
    _, job = resolve_job(
        ["--recipe", "debug", "--output.dir", str(tmp_path / "run"),
         "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
         "--training.steps", str(steps), "--training.max_norm", str(max_norm),
         "--training.val_sequences", "8", "--checkpoint.save_final_model", "false"]
    )  # fmt: skip
    trainer = Trainer(job)
    assert trainer.train_loader.grad_accum_steps == 1  # one backward per step: one hook call
    params = dict(trainer.model.named_parameters())
    initial = {name: p.detach().clone() for name, p in params.items()}
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    lrs: list[float] = []
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: grads[name].append(p.grad.detach().clone())
        )
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"])
    )
    trainer.train()

    # The reference: torch's AdamW, same groups and hyper-parameters, on copies of the weights.
    ref = {name: w.clone() for name, w in initial.items()}
    name_of = {id(p): name for name, p in params.items()}
    groups = [
        {**{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")},
         "params": [ref[name_of[id(p)]] for p in g["params"]]}
        for g in trainer.optimizer.param_groups
    ]  # fmt: skip
    ref_opt = torch.optim.AdamW(groups, foreach=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    logged = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert len(logged) == len(lrs) == steps, (logged, lrs)
    for step in range(steps):
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g[step].double()) for g in grads.values()])
        ).item()
        factor = _clip_factor(norm, max_norm)
        print(f"step {step + 1}: norm {norm:.6f} (logged {logged[step]:.6f}), clip x{factor:.4f}")
        # torch sums the norm in float32: 1.5e-5 off the float64 value here
        assert logged[step] == pytest.approx(norm, rel=1e-4), "the log must hold the pre-clip norm"
        for group in ref_opt.param_groups:
            group["lr"] = lrs[step]
        for name, w in ref.items():
            w.grad = grads[name][step] * factor
        ref_opt.step()

    worst_moment = worst_weight = 0.0
    for name, p in params.items():
        state, ref_state = trainer.optimizer.state[p], ref_opt.state[ref[name]]
        scale = ref_state["exp_avg"].abs().max().item() + 1e-30
        worst_moment = max(
            worst_moment, (state["exp_avg"] - ref_state["exp_avg"]).abs().max().item() / scale
        )
        worst_weight = max(worst_weight, (p.detach() - ref[name]).abs().max().item())
    moved = max((p.detach() - initial[n]).abs().max().item() for n, p in params.items())
    print(
        f"max |exp_avg - reference| / max|reference| = {worst_moment:.2e}; "
        f"max |weight - reference| = {worst_weight:.2e} (weights moved up to {moved:.2e})"
    )
    assert worst_moment < 1e-4, "the optimizer saw gradients scaled unlike min(1, max_norm/norm)"
    assert worst_weight < 1e-3 * moved


def test_trainer_clips_to_a_small_max_norm(tmp_path):
    _train_and_replay(tmp_path, max_norm=0.05)


def test_trainer_leaves_gradients_below_max_norm_alone(tmp_path):
    _train_and_replay(tmp_path, max_norm=10.0)


def _model_with_grads(scale: float) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_clip_gradients_scales_by_min_one_max_norm_over_norm(max_norm):
    model, before = _model_with_grads(1.0)
    opt = torch.optim.AdamW(model.parameters())
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before])).item()
    norm = clip_gradients(opt, model.parameters(), max_norm).item()
    factor = _clip_factor(expected, max_norm)
    worst = max(
        (p.grad - g * factor).abs().max().item() for p, g in zip(model.parameters(), before)
    )
    print(f"norm {norm:.6f} (expected {expected:.6f}), clip x{factor:.4g}: max error {worst:.2e}")
    assert norm == pytest.approx(expected, rel=1e-6)
    assert worst < 1e-6


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_triton_adamw_takes_the_clip_as_grad_scale(max_norm):
    """The Triton optimizer's convention, checked without its kernel (which needs a GPU):
    clip_gradients leaves the gradients alone and hands the factor over as grad_scale."""
    model, before = _model_with_grads(1.0)
    opt = TritonAdamW([{"params": list(model.parameters())}])
    norm = clip_gradients(opt, model.parameters(), max_norm)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before])).item()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    factor = _clip_factor(expected, max_norm)
    print(f"grad_scale {opt.grad_scale.item():.6g}, expected {factor:.6g}")
    assert norm.item() == pytest.approx(expected, rel=1e-6)
    assert opt.grad_scale.item() == pytest.approx(factor, rel=1e-6)
    assert clip_coefficient(norm, max_norm).item() == pytest.approx(factor, rel=1e-6)
