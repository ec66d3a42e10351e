"""The Triton AdamW (clip folded in) and gradient-norm kernels against torch's.

The kernels run in Triton's interpreter on CPU (this file as a script with TRITON_INTERPRET=1)
and compiled on a GPU; there the trainer with --optimizer.implementation triton is also checked
against the fused AdamW it replaces.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.kernels.adamw import adamw_step_, squared_norm_partials
from torchloom.parallel import clip_coefficient, clip_grad_norm_, grad_norm
from torchloom.train.optim import OptimizerConfig, TritonAdamW, build_optimizer
from torchloom.train.trainer import Trainer

SHAPES = [(37,), (5, 129), (3000,), (2,)]  # 3000 spans two programs; odd sizes end mid-block
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(dtype: torch.dtype, device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0},
    ]


def check_against_torch(device: str) -> list[str]:
    """Five steps of TritonAdamW against torch's AdamW on the same gradients, which torch gets
    already multiplied by the clip coefficient TritonAdamW applies itself; a float and a tensor
    learning rate; then both optimizers continue from each other's state_dict.

    fp32 parameters match torch's to 1e-5. bf16 parameters round at every step (torch's AdamW
    rounds every intermediate to bf16; the kernel computes in fp32 and rounds once), so they
    are held against an fp32 run from the same start and, on CUDA, must stay no farther from it
    than torch's bf16 AdamW does (plus one unit in the last place)."""
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = _params(dtype, device), _params(dtype, device)
        exact = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
        fused = device == "cuda"
        mine = TritonAdamW(_groups(ours), **HYPER)
        ref = torch.optim.AdamW(_groups(theirs), **HYPER, fused=fused, foreach=not fused)
        ref_fp32 = torch.optim.AdamW(_groups(exact), **HYPER, foreach=True)
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            scale = torch.tensor([1.0, 0.37, 1.0, 0.05, 0.8][step], device=device)
            if step == 3:  # the CUDA-graph step's device learning rate
                for group in mine.param_groups:
                    group["lr"] = torch.tensor(HYPER["lr"], device=device)
            for a, b, c in zip(ours, theirs, exact, strict=True):
                grad = torch.randn(a.shape, generator=gen).to(device, dtype)
                a.grad, b.grad, c.grad = grad.clone(), (grad.float() * scale).to(dtype), grad.float() * scale  # fmt: skip
            mine.grad_scale = scale
            for optimizer in (mine, ref, ref_fp32):
                optimizer.step()
            assert mine.grad_scale is None, "step consumes the scale"
            for i, (a, b, c) in enumerate(zip(ours, theirs, exact, strict=True)):
                if dtype == torch.float32:
                    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"p{i} step {step}")
                    continue
                # Each step's rounding (2**-8 relative; the interpreter's casts truncate,
                # 2**-7) and the bf16 moments' error (a few % of each step's lr-sized update).
                tol = {"atol": (step + 1) * 0.05 * HYPER["lr"], "rtol": (step + 1) * 2**-7}
                torch.testing.assert_close(a.float(), c.detach(), **tol, msg=f"p{i} step {step}")
                if device == "cuda":  # and no farther from fp32 than torch's bf16 AdamW
                    err, torch_err = (a.float() - c).abs().max(), (b.float() - c).abs().max()
                    assert err <= 1.5 * torch_err + 2**-7 * c.abs().max(), (i, step, err, torch_err)
        worst = max((a.float() - c).abs().max().item() for a, c in zip(ours, exact))
        lines.append(f"adamw {dtype}: 5 steps, max |param - torch's fp32 AdamW's| {worst:.2e}")
        state = mine.state[ours[0]]
        assert state["step"].device == ours[0].device and state["step"].item() == 5
        # Checkpoints are interchangeable: each continues from the other's state (fp32 only:
        # the two bf16 runs have drifted apart by their roundings).
        if dtype == torch.float32:
            swapped_mine = TritonAdamW(_groups(ours), **HYPER)
            swapped_mine.load_state_dict(ref.state_dict())
            swapped_ref = torch.optim.AdamW(_groups(theirs), **HYPER, foreach=False)
            swapped_ref.load_state_dict(mine.state_dict())
            for a, b in zip(ours, theirs, strict=True):
                grad = torch.randn(a.shape, generator=gen).to(device, dtype)
                a.grad, b.grad = grad.clone(), grad.clone()
            swapped_mine.step()
            swapped_ref.step()
            assert swapped_mine.state[ours[0]]["step"].device == ours[0].device
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(2)
        tensors = [torch.randn(s, generator=gen).to(device, dtype) for s in [*SHAPES, (0,)]]
        partials = squared_norm_partials(tensors)
        want = sum(t.double().square().sum() for t in tensors)
        torch.testing.assert_close(partials.sum().double(), want.to(partials.device), rtol=1e-6, atol=0)  # fmt: skip
        assert torch.equal(squared_norm_partials(tensors), partials), "the same every run"
        lines.append(f"squared norm {dtype}: {partials.numel()} partials, matches fp64")
    return lines


def test_clipping_in_place_is_the_coefficient_times_the_gradient() -> None:
    """clip_grad_norm_ == grad_norm, then every gradient times clip_coefficient (what the Triton
    AdamW applies instead), bitwise; no clipping below the threshold."""
    params = _params(torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = grad_norm(params)
    assert torch.equal(norm, torch.nn.utils.get_total_norm(grads))
    coefficient = clip_coefficient(norm, 1.0)
    assert torch.equal(clip_grad_norm_(params, 1.0), norm)
    for p, g in zip(params, grads, strict=True):
        assert torch.equal(p.grad, g * coefficient)
    assert clip_coefficient(norm, float("inf")).item() == 1.0
    assert clip_coefficient(norm, 2 * norm.item()).item() == 1.0


def test_non_contiguous_parameters_get_one_clear_error() -> None:
    param = torch.zeros(4, 6).t()  # a transposed view
    state = [torch.zeros_like(param) for _ in range(3)]
    with pytest.raises(ValueError, match="contiguous .* Use --optimizer.implementation fused"):
        adamw_step_([param], *([s] for s in state), [torch.ones(())], lr=1e-3, beta1=0.9,
                    beta2=0.95, eps=1e-8, weight_decay=0.0)  # fmt: skip


def test_triton_adamw_is_refused_off_the_gpu() -> None:
    with pytest.raises(ConfigError, match="runs Triton kernels on a CUDA GPU"):
        build_optimizer(
            torch.nn.Linear(4, 4), OptimizerConfig(implementation="triton"), torch.device("cpu")
        )


def test_triton_adamw_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_triton_adamw_matches_torch_on_gpu() -> None:
    print("\n".join(check_against_torch("cuda")))
    params = _params(torch.bfloat16, "cuda")
    for p in params:
        p.grad = torch.randn_like(p)
    ours = grad_norm(params, triton_kernel=True)  # the Triton partials on CUDA
    torch.testing.assert_close(
        ours, torch.nn.utils.get_total_norm([p.grad.float() for p in params]), rtol=1e-6, atol=0
    )


@pytest.mark.gpu
def test_trainer_with_triton_adamw_tracks_fused(tmp_path) -> None:
    """The debug recipe for 12 steps: the Triton AdamW (clip folded in) against torch's fused
    AdamW after an in-place clip. The norms are clipped at 0.05, so every step clips."""
    runs = {}
    for impl in ("fused", "triton"):
        _, job = resolve_job(
            ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens",
             "0", "--training.val_sequences", "8", "--training.device", "cuda",
             "--training.steps", "12", "--training.max_norm", "0.05", "--output.dir",
             str(tmp_path / impl), "--optimizer.implementation", impl]
        )  # fmt: skip
        trainer = Trainer(job)
        assert isinstance(trainer.optimizer.optimizers[0], TritonAdamW) == (impl == "triton")
        trainer.train()
        lines = (tmp_path / impl / "metrics.jsonl").read_text().splitlines()
        runs[impl] = [r for r in map(json.loads, lines) if "loss" in r]
    fused, triton = runs["fused"], runs["triton"]
    assert len(fused) == len(triton) == 12
    for a, b in zip(fused, triton, strict=True):
        assert a["grad_norm"] > 0.05, "every step clips"
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2), (a, b)
    print("losses fused / triton:", [(a["loss"], b["loss"]) for a, b in zip(fused, triton)])


if __name__ == "__main__":  # run by test_triton_adamw_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print("\n".join(check_against_torch("cpu")))
