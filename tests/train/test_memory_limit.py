"""--training.memory_limit_gib: refusals (CPU); on a GPU the cap holds the allocator's reserve,
frees its cache instead of growing past it, and leaves a run's losses bitwise unchanged."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchloom.cli import main, resolve_job
from torchloom.config.errors import ConfigError
from torchloom.generate.engine import available_memory
from torchloom.train.builders import GiB, cap_device_memory, device_memory
from torchloom.train.trainer import Trainer

COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8"]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "must be a finite number of GiB >= 0"),
        ("nan", "must be a finite number of GiB >= 0"),
        ("inf", "must be a finite number of GiB >= 0"),
    ],
)
def test_values_that_are_not_a_size_are_refused(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_job([*COMMON, "--training.memory_limit_gib", value])


def test_refused_on_the_cpu(tmp_path) -> None:
    with pytest.raises(ConfigError, match="it does nothing with --training.device cpu"):
        resolve_job([*COMMON, "--training.memory_limit_gib", "4", "--training.device", "cpu"])
    cap_device_memory(torch.device("cpu"), 0.0)  # no cap asked: nothing to refuse
    with pytest.raises(ConfigError, match="caps the CUDA allocator, and this run is on the cpu"):
        cap_device_memory(torch.device("cpu"), 4.0)
    if torch.cuda.is_available():
        return
    # --training.device auto lands on the CPU here: refused before anything is built.
    _, job = resolve_job([*COMMON, "--training.memory_limit_gib", "4", "--output.dir",
                          str(tmp_path / "run")])  # fmt: skip
    with pytest.raises(ConfigError, match="caps the CUDA allocator"):
        Trainer(job)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.fixture
def uncapped():
    """Each GPU test leaves the allocator as it found it: no cap, no cache."""
    yield
    torch.cuda.synchronize()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_the_cap_frees_the_cache_instead_of_growing(uncapped) -> None:
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    with pytest.raises(ConfigError, match="is more than this GPU's"):
        cap_device_memory(device, 10_000.0)
    base = torch.cuda.memory_reserved(device)
    cap = base / GiB + 1.0
    cap_device_memory(device, cap)
    assert device_memory(device) == pytest.approx(cap * GiB, rel=1e-3)
    room = available_memory(device)
    assert room is not None and room <= cap * GiB - torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    first = torch.empty(int(0.6 * GiB), dtype=torch.uint8, device=device)
    del first  # its block stays in the allocator's cache
    # 0.6 cached + 0.7 new would pass the cap: the cache is handed back and the allocation retried.
    second = torch.empty(int(0.7 * GiB), dtype=torch.uint8, device=device)
    assert torch.cuda.max_memory_reserved(device) <= cap * GiB
    del second
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int(1.2 * GiB), dtype=torch.uint8, device=device)


def _run(tmp_path, name: str, *overrides: str) -> list[dict]:
    _, job = resolve_job(
        [*COMMON, "--output.dir", str(tmp_path / name), "--training.device", "cuda",
         "--training.deterministic", "true", "--training.steps", "6", *overrides]
    )  # fmt: skip
    Trainer(job).train()
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.gpu
def test_a_capped_run_trains_the_same_steps_within_its_cap(tmp_path, uncapped) -> None:
    free = _run(tmp_path, "free")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the peaks are the process's, earlier tests' included
    capped = _run(tmp_path, "capped", "--training.memory_limit_gib", "3")
    assert torch.cuda.get_per_process_memory_fraction() < 1.0

    def numbers(records: list[dict]) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records]

    assert numbers(capped) == numbers(free)
    steps = [r for r in capped if "tps" in r]
    assert steps and all(math.isfinite(r["mem_reserved_gib"]) for r in steps)
    assert max(r["mem_reserved_gib"] for r in steps) <= 3.0
    assert all(r["mem_gib"] <= r["mem_reserved_gib"] for r in steps)


def test_rl_refuses_the_cap_off_a_gpu_before_training_anything(tmp_path, monkeypatch, capsys):
    """rl_debug trains its starting models first when they are missing: the cap's refusal comes
    before that (it used to follow minutes of prerequisite training)."""
    if torch.cuda.is_available():
        return
    monkeypatch.chdir(tmp_path)
    args = ["rl", "--recipe", "rl_debug", "--training.memory_limit_gib", "4",
            "--output.dir", str(tmp_path / "rl")]  # fmt: skip
    assert main(args) == 2
    assert "caps the CUDA allocator" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no prerequisite model, no run folder


@pytest.mark.parametrize(("cap", "verdict"), [("100", "fits under it"), ("0.001", "does NOT fit")])
def test_the_dry_run_sets_the_largest_rank_against_the_cap(capsys, cap: str, verdict: str):
    """A dry run plans a GPU job anywhere (no allocator to cap here): it says whether the largest
    rank's parameters, gradients, optimizer state and activations fit under the cap."""
    assert (
        main(["train", "--recipe", "debug", "--training.memory_limit_gib", cap, "--dry-run"]) == 0
    )
    out = capsys.readouterr().out
    assert f"--training.memory_limit_gib {cap}: the largest rank's" in out and verdict in out, out
