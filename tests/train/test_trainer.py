import json
import math
import re
import time

import pytest
import torch

from torchloom.checkpoint.model_io import load_model
from torchloom.cli import resolve_job
from torchloom.config import ConfigError, from_dict
from torchloom.train.job import JobConfig
from torchloom.train.metrics import StepWindow
from torchloom.train.plot import plot_metrics
from torchloom.train.trainer import Trainer, TrainingError

REQUIRED = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "mem_gib", "data_wait_s"}


def run(tmp_path, *overrides: str, name: str = "run"):
    _, job = resolve_job(
        ["--recipe", "debug", "--output.dir", str(tmp_path / name), "--metrics.tensorboard", "false",
         "--training.sample_tokens", "0", *overrides]
    )  # fmt: skip
    trainer = Trainer(job)
    return trainer, trainer.train()


def losses(output_dir) -> list[float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("debug_run")
    trainer, result = run(tmp, "--training.steps", "40", "--metrics.tensorboard", "true")
    return tmp / "run", trainer, result


def test_debug_recipe_learns_and_writes_its_outputs(debug_run):
    out, trainer, result = debug_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    for record in steps:
        assert record.keys() >= REQUIRED, REQUIRED - record.keys()
    assert steps[0]["mfu"] is None  # no known peak for a CPU: no invented number
    print(
        f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}, "
        f"val {result.val_loss_before:.3f} -> {result.val_loss_after:.3f}"
    )
    assert result.last_loss < result.first_loss - 1.5
    assert result.val_loss_after < result.val_loss_before - 1.5
    assert any(p.name.startswith("events") for p in (out / "tb").iterdir())
    saved = from_dict(JobConfig, json.loads((out / "config.json").read_text()))
    assert saved == trainer.job


def test_saved_model_reloads_with_identical_logits(debug_run):
    out, trainer, _ = debug_run
    model, family, config = load_model(out / "model")
    assert family == "llama3" and config == trainer.model_config
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    torch.testing.assert_close(model(tokens), trainer.model.eval()(tokens), rtol=0, atol=0)


def test_plot_writes_a_png(debug_run):
    png = plot_metrics(debug_run[0])
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_same_seed_same_losses_bitwise_and_accumulation_matches(tmp_path):
    a = losses(run(tmp_path, "--training.steps", "6", name="a")[1].model_dir.parent)
    b = losses(run(tmp_path, "--training.steps", "6", name="b")[1].model_dir.parent)
    assert a == b, [x - y for x, y in zip(a, b)]
    accum = run(tmp_path, "--training.steps", "6", "--training.micro_batch_size", "2", name="c")
    c = losses(accum[1].model_dir.parent)
    assert accum[0].train_loader.grad_accum_steps == 4
    diff = max(abs(x - y) for x, y in zip(a, c))
    print(f"max |loss(1 micro-batch) - loss(4 micro-batches)| = {diff:.2e}")
    assert diff < 1e-4


def test_existing_run_folder_is_refused_unless_overwrite(tmp_path):
    run(tmp_path, "--training.steps", "1")
    with pytest.raises(ConfigError, match="already holds a run.*--output.overwrite true"):
        run(tmp_path, "--training.steps", "1")
    run(tmp_path, "--training.steps", "2", "--output.overwrite", "true")
    assert len(losses(tmp_path / "run")) == 2


def test_nonfinite_loss_stops_or_skips(tmp_path):
    with pytest.raises(TrainingError, match="loss became .*--training.skip_nonfinite"):
        run(tmp_path, "--training.steps", "8", "--optimizer.lr", "1e30",
            "--lr_schedule.warmup_steps", "0", "--training.max_norm", "0")  # fmt: skip
    # Skipped, the 7 steps after the first still leave the weights step 1 broke: the run ends
    # with an error that says so, not with exit 0 and a nan validation loss.
    with pytest.raises(TrainingError, match=r"7 of 8 steps were skipped as non-finite"):
        run(tmp_path, "--training.steps", "8", "--optimizer.lr", "1e30",
            "--lr_schedule.warmup_steps", "0", "--training.max_norm", "0",
            "--training.skip_nonfinite", "true", name="skip")  # fmt: skip
    assert len(losses(tmp_path / "skip")) == 8  # every step ran and was logged


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nonfinite_loss_checked_late_names_its_step_and_is_never_saved(tmp_path, device):
    """Off logged steps the trainer checks each loss one step late (the host queues the next
    step first; on CUDA it waits on the step before's event). The error names the same step as
    a check on every step does, and a save due after the bad step checks first: no checkpoint
    holds it (step-1 is saved, step-2 is not)."""
    bad = ["--training.steps", "8", "--optimizer.lr", "1e30", "--lr_schedule.warmup_steps", "0",
           "--training.max_norm", "0", "--training.device", device]  # fmt: skip
    named = {}
    for interval, save in (("1", "0"), ("100", "0"), ("100", "3"), ("100", "1")):
        name = f"log{interval}_save{save}"
        with pytest.raises(TrainingError, match=r"loss became \S+ at step \d+\.") as error:
            run(tmp_path, *bad, "--metrics.log_interval", interval, "--checkpoint.interval", save,
                name=name)  # fmt: skip
        named[name] = int(re.search(r"at step (\d+)", str(error.value)).group(1))
        if save != "0":
            saved = [p.name for p in (tmp_path / name / "checkpoints").glob("step-*")]
            assert all(int(s.split("-")[1]) < named[name] for s in saved), (saved, named)
    assert set(named.values()) == {2}, named  # step 1 starts from finite weights
    assert (tmp_path / "log100_save1" / "checkpoints" / "step-1" / "COMPLETE.json").exists()


def test_step_window_averages_between_syncs(monkeypatch):
    clock = iter([10.0, 13.0, 20.0])  # begin, synced after 2 steps; begin again
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    window = StepWindow()
    window.begin()
    window.add_step(0.5)
    window.begin()  # already running: no new start
    window.add_step(0.1)
    window.synced()
    window.begin()  # a validation or save between: not counted
    assert window.take() == (1.5, 0.3)
    assert window.steps == 0 and window.seconds == 0.0


def test_vocab_mismatch_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer has 4096 tokens.*vocab_size"):
        run(tmp_path, "--model.overrides", '{"vocab_size": 1000}')


def test_chunked_loss_trains_like_full_logits(tmp_path):
    full = losses(run(tmp_path, "--training.steps", "6", name="full")[1].model_dir.parent)
    chunked = run(tmp_path, "--training.steps", "6", "--model.loss_impl", "chunked", name="c")
    diff = max(abs(a - b) for a, b in zip(full, losses(chunked[1].model_dir.parent)))
    print(f"max |loss(full logits) - loss(chunked head)| over 6 steps = {diff:.1e}")
    assert diff < 1e-5
    with pytest.raises(ConfigError, match="loss_impl chunked"):
        run(tmp_path, "--model.loss_impl", "chunked", "--parallel.pp", "2", name="pp")


def test_no_validation_split_writes_no_val_loss(tmp_path, capsys):
    """With --data.val_fraction 0 there is nothing to validate: no val_loss records (they
    were nan, which reads like divergence), neither in metrics.jsonl nor on the console."""
    _, result = run(tmp_path, "--training.steps", "2", "--training.val_interval", "1",
                    "--data.val_fraction", "0")  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert not any("val_loss" in r for r in records)
    assert "val_loss" not in capsys.readouterr().out
    assert math.isnan(result.val_loss_before) and math.isnan(result.val_loss_after)
