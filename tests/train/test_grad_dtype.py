"""`--optimizer.grad_dtype bf16`: the linear weights' gradients held in bf16 beside their fp32
parameters. Under bf16 compute a linear's weight gradient is a bf16 matmul's output, so with one
micro-batch a step the held gradient loses nothing: the run is bitwise the fp32-gradient run
(checked with the Triton AdamW in Triton's interpreter on the CPU, and the trainer's compiled
step on a GPU), in less memory. Further micro-batches add in bf16 (close, not equal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.models import build_model, resolve_model_config
from torchloom.train.dry_run import rank_memory
from torchloom.train.optim import TritonAdamW, clip_gradients, linear_weights

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


class _Net(nn.Module):
    """Embedding, a norm and linears (one with a bias, one tied head): every kind of weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.norm = nn.RMSNorm(24)
        self.up = nn.Linear(24, 40, bias=True)
        self.down = nn.Linear(40, 24, bias=False)
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(tokens))
        x = x + self.down(torch.relu(self.up(x)))
        return nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), tokens.flatten())


def _run(bf16_grads: bool, micro: int, steps: int = 3) -> tuple[list[torch.Tensor], list]:
    """``steps`` clipped AdamW steps of ``_Net`` under bf16 autocast on the CPU; returns the
    parameters and every step's (loss, grad norm)."""
    torch.manual_seed(0)
    net = _Net()
    groups = [{"params": list(net.parameters()), "weight_decay": 0.1}]
    optimizer = TritonAdamW(groups, **HYPER, bf16_grads=linear_weights(net) if bf16_grads else ())
    gen = torch.Generator().manual_seed(1)
    record = []
    for _ in range(steps):
        loss = torch.zeros(())
        for _ in range(micro):
            tokens = torch.randint(0, 50, (4, 16), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                micro_loss = net(tokens) / micro
            micro_loss.backward()
            loss += micro_loss.detach()
        if bf16_grads:
            for w in (net.up.weight, net.down.weight):
                assert w.grad is None and optimizer.gradient(w).dtype == torch.bfloat16
            for p in (net.embed.weight, net.norm.weight, net.up.bias):
                assert p.grad is not None and p.grad.dtype == torch.float32
        norm = clip_gradients(optimizer, net.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        assert optimizer.gradient(net.up.weight) is None, "zero_grad drops the held gradients"
        record.append((loss.item(), norm.item()))
    return [p.detach().clone() for p in net.parameters()], record


def check_bf16_gradients() -> list[str]:
    """One micro-batch: bitwise the fp32-gradient run. Two: within bf16's rounding of it."""
    lines = []
    base, base_record = _run(False, micro=1)
    held, held_record = _run(True, micro=1)
    assert held_record == base_record, (held_record, base_record)
    for a, b in zip(base, held, strict=True):
        assert torch.equal(a, b)
    lines.append(f"one micro-batch: 3 steps bitwise equal, (loss, norm) {held_record}")
    base, base_record = _run(False, micro=2)
    held, held_record = _run(True, micro=2)
    assert held_record[0][0] == base_record[0][0], "the first loss precedes any update"
    for a, b in zip(base, held, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2 * HYPER["lr"] * 3, rtol=0)
    worst = max((a - b).abs().max().item() for a, b in zip(base, held))
    lines.append(f"two micro-batches: max |param difference| after 3 steps {worst:.2e}")
    return lines


def test_bf16_gradients_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


def test_which_gradients_are_held() -> None:
    net = _Net()
    assert {id(w) for w in linear_weights(net)} == {id(net.up.weight), id(net.down.weight)}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--optimizer.grad_dtype", "bf16"], "needs --optimizer.implementation triton"),
        (["--optimizer.grad_dtype", "bf16", "--optimizer.implementation", "triton",
          "--parallel.tp", "2"], "is implemented for one GPU"),
        (["--optimizer.grad_dtype", "bf16", "--optimizer.implementation", "triton",
          "--parallel.pp", "2"], "pipeline stages are not verified"),
        (["--optimizer.grad_dtype", "bf16", "--optimizer.implementation", "triton",
          "--training.cuda_graph", "true"], "not verified with --optimizer.grad_dtype bf16"),
        (["--optimizer.grad_dtype", "bf16", "--optimizer.implementation", "triton",
          "--training.mixed_precision", "fp32"], "every one would be rounded"),
    ],
)  # fmt: skip
def test_refusals(flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_job(["--recipe", "debug", *flags])


def test_sharded_or_bf16_weights_are_refused_at_build() -> None:
    net = _Net().bfloat16()
    with pytest.raises(ConfigError, match="bf16 gradients of fp32 parameters"):
        TritonAdamW(net.parameters(), bf16_grads=linear_weights(net))


def test_dry_run_counts_the_held_gradients_in_half() -> None:
    rows = {}
    for dtype in ("fp32", "bf16"):
        _, job = resolve_job(["--recipe", "debug", "--optimizer.implementation", "triton",
                              "--optimizer.grad_dtype", dtype])  # fmt: skip
        with torch.device("meta"):
            model = build_model(resolve_model_config(job.model))
        rows[dtype] = rank_memory(0, model, job, None)
        held = sum(w.numel() for w in linear_weights(model))
    assert held > 0
    assert rows["fp32"].grads - rows["bf16"].grads == 2 * held
    assert rows["fp32"].optimizer == rows["bf16"].optimizer


_ONE_RUN = """
import json, sys, torch
from torchloom.cli import resolve_job
from torchloom.train.optim import linear_weights
from torchloom.train.trainer import Trainer
dtype, out = sys.argv[1], sys.argv[2]
_, job = resolve_job(
    ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
     "--data.val_fraction", "0", "--training.device", "cuda", "--training.steps", "6",
     "--output.dir", out, "--optimizer.implementation", "triton",
     "--optimizer.grad_dtype", dtype]
)
trainer = Trainer(job)
held = trainer.optimizer.optimizers[0].bf16_grads
assert (held is not None) == (dtype == "bf16"), held
linear = sum(p.numel() for p in linear_weights(trainer.model))
before_step = []  # allocated bytes as each optimizer step starts: every gradient is held then
step = trainer.optimizer.step
def counted_step(*args, **kwargs):
    before_step.append(torch.cuda.memory_allocated())
    return step(*args, **kwargs)
trainer.optimizer.step = counted_step
trainer.train()
print(json.dumps({"before_step": before_step, "linear_numel": linear}))
"""


@pytest.mark.gpu
def test_trainer_with_bf16_gradients_is_bitwise_the_fp32_run_on_gpu(tmp_path) -> None:
    """The debug recipe, compiled under bf16 autocast, 6 steps, each run in a process of its
    own: the same losses and gradient norms bit for bit, and, as each optimizer step starts
    (every gradient held), less allocated memory by at least half of what holding the linear
    weights' gradients in bf16 saves (2 bytes each). The run's peak is no measure at this
    size: it falls outside the window where gradients live (equal in both runs, s34)."""
    runs, reports = {}, {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        result = subprocess.run([sys.executable, "-c", _ONE_RUN, dtype, str(out)],
                                capture_output=True, text=True, timeout=600)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        reports[dtype] = json.loads(result.stdout.strip().splitlines()[-1])
        lines = (out / "metrics.jsonl").read_text().splitlines()
        runs[dtype] = [(r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]
    saving = 2 * reports["fp32"]["linear_numel"]
    print("fp32 / bf16 gradients:", runs, "reports", reports, "expected saving", saving)
    assert len(runs["fp32"]) == 6 and runs["bf16"] == runs["fp32"]
    fp32, bf16 = reports["fp32"]["before_step"], reports["bf16"]["before_step"]
    assert len(fp32) == len(bf16) == 6
    assert all(b <= f - saving // 2 for f, b in zip(fp32, bf16)), (fp32, bf16, saving)


if __name__ == "__main__":  # run by test_bf16_gradients_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print("\n".join(check_bf16_gradients()))
