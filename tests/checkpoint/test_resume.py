"""Training checkpoints: exact resume, every save mode, faults (SIGKILL during a save, damaged
files), fsspec storage, exclude_from_loading, keep_latest_k."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchloom.checkpoint.storage import MARKER, CheckpointStorage
from torchloom.cli import main

COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--checkpoint.save_final_model", "false",
          "--training.device", "cpu"]  # fmt: skip


def train(output_dir: Path, *flags: str) -> int:
    return main(["train", *COMMON, "--output.dir", str(output_dir), *flags])


def records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(output_dir) if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """8 steps, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("full") / "run"
    assert train(out, "--training.steps", "8", "--checkpoint.interval", "4") == 0
    return out


def resume_from_step_4(uninterrupted: Path, out: Path, *flags: str) -> dict[int, float]:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints/step-4", out / "checkpoints/step-4")
    assert train(out, "--training.steps", "8", "--checkpoint.resume", "true", *flags) == 0
    return losses(out)


@pytest.mark.parametrize("mode", ["sync", "async", "async_pinned"])
def test_resume_continues_bitwise(uninterrupted, tmp_path, mode):
    resumed = resume_from_step_4(
        uninterrupted, tmp_path / "run", "--checkpoint.interval", "2", "--checkpoint.mode", mode
    )
    full = losses(uninterrupted)
    print(f"{mode}: steps 5-8 uninterrupted {[full[s] for s in resumed]}, resumed "
          f"{list(resumed.values())}")  # fmt: skip
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == full[s] for s in resumed)  # bitwise
    saves = [r for r in records(tmp_path / "run") if "ckpt_write_s" in r]
    assert [r["step"] for r in saves] == [6, 8]
    for r in saves:
        print(f"{mode} step {r['step']}: blocking {r['ckpt_blocking_s']:.4f} s, "
              f"write {r['ckpt_write_s']:.4f} s")  # fmt: skip
        assert 0 < r["ckpt_blocking_s"] <= r["ckpt_write_s"] + 1e-3
    assert CheckpointStorage.for_path(tmp_path / "run/checkpoints").complete_steps() == [4, 6, 8]


def test_resume_keeps_earlier_metrics_and_keep_latest_k(uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    (out / "checkpoints/step-8/COMPLETE.json").unlink()  # as if killed while saving step 8
    with open(out / "metrics.jsonl", "a") as f:  # a step the killed run logged after step 4
        f.write(json.dumps({"step": 5, "loss": 123.0}) + "\n")
    flags = ["--training.steps", "8", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k",
             "1", "--checkpoint.resume", "true", "--checkpoint.load_step", "4"]  # fmt: skip
    assert train(out, *flags) == 0
    assert losses(out) == losses(uninterrupted)  # step 5's stale record is gone, 1-4 kept
    assert CheckpointStorage.for_path(out / "checkpoints").steps_on_disk() == [8]


def test_damaged_checkpoint_names_the_file_or_falls_back(uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    victim = sorted((out / "checkpoints/step-8").glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    flags = ["--training.steps", "10", "--checkpoint.resume", "true"]
    assert train(out, *flags) == 1
    error = capsys.readouterr().err
    print(error)
    assert victim.name in error and "--checkpoint.fallback true" in error
    assert train(out, *flags, "--checkpoint.fallback", "true") == 0
    assert "step 8 is damaged" in capsys.readouterr().out
    assert losses(out) == {**losses(uninterrupted), **losses(out)}  # 5-8 redone identically
    assert sorted(losses(out)) == list(range(1, 11))


def test_fsspec_memory_storage_and_exclude_from_loading(uninterrupted, tmp_path):
    url = f"memory://torchloom-test-{os.getpid()}/ckpt"
    first = tmp_path / "a"
    assert train(first, "--training.steps", "4", "--checkpoint.interval", "4",
                 "--checkpoint.folder", url) == 0  # fmt: skip
    assert CheckpointStorage.for_path(url).complete_steps() == [4]
    second = tmp_path / "b"
    assert train(second, "--training.steps", "8", "--checkpoint.folder", url,
                 "--checkpoint.resume", "true") == 0  # fmt: skip
    full = losses(uninterrupted)
    assert all(losses(second)[s] == full[s] for s in (5, 6, 7, 8))
    # Weights and step restored, data position not: steps 5.. read the first batches again.
    third = tmp_path / "c"
    assert train(third, "--training.steps", "5", "--checkpoint.folder", url,
                 "--checkpoint.resume", "true", "--checkpoint.exclude_from_loading",
                 '["dataloader"]') == 0  # fmt: skip
    assert sorted(losses(third)) == [5] and losses(third)[5] != full[5]


def test_sigkill_during_a_save_resumes_from_the_last_complete_one(uninterrupted, tmp_path):
    """Kill -9 the run while a step folder exists without its marker, then resume."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    cmd = [sys.executable, "-m", "torchloom", "train", *COMMON, "--output.dir", str(out),
           "--training.steps", "8", "--checkpoint.interval", "1",
           "--checkpoint.writer_threads", "1"]  # fmt: skip
    storage = CheckpointStorage.for_path(ckpt)
    for attempt in range(1, 11):  # noqa: B007 (reported below)
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        caught = None
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            marked = {d.name: (d / MARKER).exists() for d in ckpt.glob("step-*")}
            if not all(marked.values()) and any(marked.values()):
                # mid-save, with an earlier complete checkpoint
                proc.send_signal(signal.SIGKILL)
                caught = next(name for name, done in marked.items() if not done)
                break
            time.sleep(0.0005)
        proc.wait()
        if caught and storage.incomplete_steps():  # else the save finished before the kill
            break
    assert caught, "never caught the run in the middle of a save"
    print(f"killed during {caught} (attempt {attempt}); complete: {storage.complete_steps()}, "
          f"incomplete: {storage.incomplete_steps()}")  # fmt: skip
    assert storage.incomplete_steps() and storage.complete_steps()
    last_complete = storage.latest_complete()
    assert train(out, "--training.steps", "8", "--checkpoint.interval", "1",
                 "--checkpoint.resume", "true") == 0  # fmt: skip
    assert losses(out) == losses(uninterrupted)
    assert storage.incomplete_steps() == [] and storage.latest_complete() == 8
    assert last_complete < 8


def test_checkpoint_step_exports_to_hf_on_demand(uninterrupted, tmp_path):
    """convert --from <checkpoint step> --to-hf: transformers loads it with the run's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchloom.checkpoint.model_io import load_model

    hf_dir = tmp_path / "hf"
    step = uninterrupted / "checkpoints/step-8"
    assert main(["convert", "--from", str(step), "--to-hf", str(hf_dir)]) == 0
    # The run's step-8 weights, through the saved final model of a 8-step run with the same seed.
    final = tmp_path / "final"
    assert main(["train", *COMMON[:-4], "--output.dir", str(final), "--training.steps", "8"]) == 0
    model, _, _ = load_model(final / "model")
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        diff = (reference(tokens).logits - model(tokens)).abs().max().item()
    print(f"HF export of checkpoint step 8 vs the run's final model: max |logit diff| {diff:.1e}")
    assert diff < 1e-4


def test_resuming_an_older_step_replaces_the_newer_checkpoints(uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)  # complete steps 4 and 8
    assert train(out, "--training.steps", "8", "--checkpoint.interval", "4",
                 "--checkpoint.resume", "true", "--checkpoint.load_step", "4") == 0  # fmt: skip
    assert losses(out) == losses(uninterrupted)
    assert CheckpointStorage.for_path(out / "checkpoints").complete_steps() == [4, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["auto", "triton"])
def test_async_pinned_on_the_gpu_resumes_bitwise(tmp_path, optimizer):
    """Pinned staging (PinnedStager) saves at steps 2, 4, 6, 8 reusing its host buffers; the
    run resumed from step 4 repeats steps 5-8 bitwise (deterministic kernels), with torch's
    fused AdamW and with the Triton one (whose step counts live on the GPU). The fused run's
    checkpoint also resumes under the Triton AdamW: the same state, other roundings."""
    gpu = ["--training.device", "cuda", "--training.deterministic", "true",
           "--checkpoint.mode", "async_pinned", "--checkpoint.interval", "2",
           "--optimizer.implementation", optimizer]  # fmt: skip
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert main(["train", *COMMON, *gpu, "--output.dir", str(full), "--training.steps", "8"]) == 0
    saves = [r for r in records(full) if "ckpt_write_s" in r]
    assert [r["step"] for r in saves] == [2, 4, 6, 8]
    print("blocking s:", [r["ckpt_blocking_s"] for r in saves])
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints/step-4", resumed / "checkpoints/step-4")
    flags = [*COMMON, *gpu, "--output.dir", str(resumed), "--training.steps", "8"]
    assert main(["train", *flags, "--checkpoint.resume", "true"]) == 0
    expected, got = losses(full), losses(resumed)
    print(f"uninterrupted {[expected[s] for s in got]}, resumed {list(got.values())}")
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == expected[s] for s in got)
    if optimizer == "auto":
        switched = tmp_path / "switched"
        (switched / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "checkpoints/step-4", switched / "checkpoints/step-4")
        flags = [*COMMON, *gpu[:-1], "triton", "--output.dir", str(switched),
                 "--training.steps", "8", "--checkpoint.resume", "true"]  # fmt: skip
        assert main(["train", *flags]) == 0
        got = losses(switched)
        print(f"resumed with the Triton AdamW {list(got.values())}")
        assert sorted(got) == [5, 6, 7, 8]
        assert all(got[s] == pytest.approx(expected[s], rel=1e-4) for s in got)
