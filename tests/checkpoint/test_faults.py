"""Resume faults end with one line and a non-zero exit, and leave the user's files as they were:
validation on resume, a finished run without checkpoints, a damaged marker, another model or
data settings, a missing step, too few steps, a torn metrics line, a renamed step folder, a
full disk or a per-file size limit during a save, another run's checkpoint folder, a restarted
step count, a checkpoint folder that is a file; and `generate` or `convert` given a step that is
incomplete or damaged, or a run's output folder."""

import errno
import json
import re
import resource
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from torchloom.checkpoint.convert import open_model_source
from torchloom.checkpoint.storage import MARKER, CheckpointStorage
from torchloom.cli import main

# Warm-up 1: the debug recipe's 5 steps would outlast these short runs (a warning each time).
COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--checkpoint.save_final_model", "false",
          "--training.device", "cpu", "--lr_schedule.warmup_steps", "1"]  # fmt: skip
RESUME = ["--checkpoint.resume", "true"]


def train(output_dir: Path, *flags: str) -> int:
    return main(["train", *COMMON, "--output.dir", str(output_dir), *flags])


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes, to compare before and after."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def summary(output_dir: Path) -> list[tuple]:
    """What metrics.jsonl says, step by step, without the timings."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r.get("loss"), r.get("val_loss"), "ckpt_write_s" in r)
            for r in map(json.loads, lines)]  # fmt: skip


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    print(err)
    return err


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """4 steps, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert train(out, "--training.steps", "4", "--checkpoint.interval", "2") == 0
    return out


@pytest.fixture
def run(saved, tmp_path) -> Path:
    """A copy of the saved run to resume."""
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def test_resume_validates_first_and_drops_a_torn_metrics_line(saved, run, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a kill in the middle of a write
    flags = ["--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.load_step", "2",
             "--checkpoint.keep_latest_k", "1"]  # fmt: skip
    assert train(run, *flags, *RESUME) == 0
    out, err = capsys.readouterr()
    print(out, err)
    assert f"skipping line 9 of {run / 'metrics.jsonl'}" in err
    assert f"removed checkpoint {run / 'checkpoints/step-4'}: newer than the loaded step 2" in out
    assert f"removed checkpoint {run / 'checkpoints/step-2'}: --checkpoint.keep_latest_k 1" in out
    val_2 = [line for line in out.splitlines() if line.startswith("step 2  val_loss")]
    assert val_2 and "validation loss nan" not in out
    assert summary(run) == summary(saved)  # as the uninterrupted run wrote it: no duplicates
    # Resumed at its last step: nothing to train, nothing written.
    before = snapshot(run)
    assert train(run, "--training.steps", "4", *RESUME) == 0
    assert "Nothing to train" in capsys.readouterr().out
    assert snapshot(run) == before


def test_resume_at_the_last_step_says_so_and_touches_nothing(tmp_path, capsys):
    """`--training.steps 2 --checkpoint.resume true` on a run whose newest checkpoint is step 2:
    one line, exit 0, and config.json (bytes and mtime), metrics and exports as they were."""
    out = tmp_path / "run"
    tiny = ["train", "--recipe", "llama3_tiny", "--output.dir", str(out), "--training.steps", "2",
            "--training.global_batch_size", "4", "--training.seq_len", "64",
            "--training.val_sequences", "4", "--training.sample_tokens", "0",
            "--metrics.tensorboard", "false", "--training.device", "cpu",
            "--checkpoint.interval", "2"]  # fmt: skip
    assert main(tiny) == 0  # the recipe exports an HF folder
    assert (out / "hf" / "config.json").is_file() and (out / "checkpoints" / "step-2").is_dir()
    before = snapshot(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    # Flags that would change config.json (export_hf) must not reach it either.
    assert main([*tiny, *RESUME, "--checkpoint.export_hf", "false"]) == 0
    printed = capsys.readouterr().out
    print(printed)
    assert printed == (
        f"Nothing to train: the checkpoint to resume ({out / 'checkpoints' / 'step-2'}) is "
        "already at --training.steps 2; raise --training.steps to train further.\n"
    )
    assert snapshot(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes
    assert json.loads((out / "config.json").read_text())["checkpoint"]["export_hf"] is True


def test_plot_skips_a_torn_metrics_line(run, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"warning: skipping line 9 of {run / 'metrics.jsonl'}" in err and err.count("\n") == 1


def test_plot_draws_the_curves_there_are_and_skips_non_numbers(tmp_path, capsys):
    """Records without tps (a hand-written or older file) and a loss that is a string or null:
    the numeric curves are drawn; with none, one line."""
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": "abc"}, {"step": 3, "loss": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": "abc"}\n')
    assert main(["plot", str(tmp_path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert "holds no numeric loss, val_loss or tps to plot" in err and "--metric NAME" in err


def test_plot_that_cannot_read_or_write_is_one_line(tmp_path, capsys):
    """A metrics.jsonl that is a folder, and a PNG path taken by a folder (as an unwritable
    folder would, both were tracebacks): one line each, naming the path and the fix."""
    (tmp_path / "metrics.jsonl").mkdir()
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl is a folder, not a run's metrics file" in one_line(
        capsys.readouterr().err
    )
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "metrics.png").mkdir()
    assert main(["plot", str(tmp_path)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"Cannot write {tmp_path / 'metrics.png'}" in err and "writable folder" in err
    (tmp_path / "metrics-loss.png").mkdir()
    assert main(["plot", str(tmp_path), "--metric", "loss"]) == 2
    assert "Cannot write" in one_line(capsys.readouterr().err)


def test_resume_into_a_finished_run_without_checkpoints_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--training.steps", "1", "--checkpoint.save_final_model", "true") == 0
    before = snapshot(out)
    capsys.readouterr()
    assert train(out, "--training.steps", "2", *RESUME) == 2
    err = one_line(capsys.readouterr().err)
    assert "found no complete checkpoint in" in err and "--output.overwrite true" in err
    assert "config.json, metrics.jsonl, model" in err
    assert snapshot(out) == before
    # A new folder has nothing to lose: resume starts afresh there, as documented.
    assert train(tmp_path / "new", "--training.steps", "1", *RESUME) == 0


def test_resume_without_train_state_into_the_same_folder_is_refused(run, capsys):
    """Excluding train_state restarts the step count: refused before metrics.jsonl or a
    checkpoint is touched, not at the first save of a step that exists."""
    before = snapshot(run)
    exclude = ["--checkpoint.exclude_from_loading", '["train_state"]']
    assert train(run, "--training.steps", "4", "--checkpoint.interval", "2", *RESUME, *exclude) == 2
    err = one_line(capsys.readouterr().err)
    assert "train_state restarts the step count at 1" in err and "up to step 4" in err
    assert "new --output.dir" in err
    assert snapshot(run) == before


def test_garbage_marker_is_damage_not_an_interrupted_save(run, capsys):
    (run / "checkpoints/step-4" / MARKER).write_text("garbage")
    before = snapshot(run)
    assert train(run, "--training.steps", "4", *RESUME) == 1
    err = one_line(capsys.readouterr().err)
    assert f"step-4/{MARKER} is not a valid marker" in err and "--checkpoint.fallback true" in err
    assert snapshot(run) == before  # the damaged step's data are still there
    assert train(run, "--training.steps", "4", *RESUME, "--checkpoint.fallback", "true") == 0
    out = capsys.readouterr().out
    assert f"checkpoint step 4 is damaged ({MARKER} is not a valid marker" in out
    assert f"removed checkpoint {run / 'checkpoints/step-4'}: newer than the loaded step 2" in out


@pytest.mark.parametrize(
    "flags, code, message",
    [
        (["--model.overrides", '{"num_layers": 3}'], 1, "num_layers is 2 there and 3 here"),
        (["--training.seq_len", "64"], 2, "seq_len was 128 in the checkpoint and is 64 now"),
        (["--training.global_batch_size", "4"], 2, "global_batch_size was 8 in the checkpoint"),
        (["--checkpoint.load_step", "3"], 2, "load_step 3 has no complete checkpoint"),
        (["--training.steps", "3"], 2, "is at step 4, past --training.steps 3: there is nothing"),
    ],
    ids=["model", "seq_len", "batch", "missing-step", "too-few-steps"],
)
def test_refused_resume_changes_nothing(run, capsys, flags, code, message):
    before = snapshot(run)
    steps = [] if "--training.steps" in flags else ["--training.steps", "6"]
    assert train(run, *steps, *RESUME, *flags) == code
    assert message in one_line(capsys.readouterr().err)
    assert snapshot(run) == before  # config.json too: it is written once the run starts


def test_step_folder_under_another_name_converts(saved, tmp_path):
    copy = tmp_path / "mycopy"
    shutil.copytree(saved / "checkpoints/step-4", copy)
    source = open_model_source(copy)  # what `generate --checkpoint` reads
    assert source.family == "llama3" and len(list(source.tensors)) > 0
    assert main(["convert", "--from", str(copy), "--to-hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf/config.json").is_file()


def test_generate_and_convert_name_a_step_they_cannot_read(run, tmp_path, capsys):
    """An interrupted save, a damaged file and a run's output folder, given to `generate
    --checkpoint` or `convert --from`: one line naming what it is and a folder to pass instead
    (with the command's own flag, not train's), and nothing written."""
    step_2, step_4 = run / "checkpoints/step-2", run / "checkpoints/step-4"
    generate = ["generate", "--prompt", "hi", "--device", "cpu", "--checkpoint"]
    out = tmp_path / "hf"

    def refused(code: int, args: list[str], expected: str) -> None:
        before = snapshot(run)
        assert main(args) == code
        err = one_line(capsys.readouterr().err)
        assert expected in err and "--checkpoint.fallback" not in err, err
        assert snapshot(run) == before and not out.exists()

    (step_4 / "__0_1.distcp").unlink()
    damaged = f"Checkpoint file {step_4}/__0_1.distcp is missing; use an older step folder, e.g."
    refused(1, [*generate, str(step_4)], f"{damaged} --checkpoint {step_2}.")
    refused(
        1, ["convert", "--from", str(step_4), "--to-hf", str(out)], f"{damaged} --from {step_2}."
    )
    altered = step_2 / "__0_0.distcp"
    altered.write_bytes(bytes(altered.stat().st_size))  # same size: only reading finds out
    refused(1, [*generate, str(step_2)], f"from the checkpoint {step_2} failed (")
    (step_4 / MARKER).unlink()
    refused(1, ["convert", "--from", str(step_4), "--to-hf", str(out)],
            f"{step_4} is an incomplete checkpoint (no {MARKER}: an interrupted save); use an "
            f"older step folder, e.g. --from {step_2}.")  # fmt: skip
    refused(
        2,
        [*generate, str(run)],
        f"{run} is a training run's output folder; pass a checkpoint step (--checkpoint {step_2}).",
    )  # fmt: skip (no model/: not saved)


def test_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    flags = ["--training.steps", "2", "--checkpoint.interval", "1"]
    assert train(tmp_path / "run", *flags, "--checkpoint.folder", str(tmp_path / "afile")) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--checkpoint.folder {tmp_path / 'afile'} is a file, not a folder" in err
    assert (tmp_path / "afile").read_text() == "mine"
    assert not (tmp_path / "run/metrics.jsonl").exists()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_during_a_save_is_one_line(run, capsys, monkeypatch, mode):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    saved_steps = snapshot(run / "checkpoints")
    with monkeypatch.context() as patch:
        patch.setattr(dcp_filesystem, "_write_item", full_disk)  # every writer thread's write
        flags = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.mode", mode]
        assert train(run, *flags, *RESUME) == 1
    err = one_line(capsys.readouterr().err)  # not one traceback per writer thread
    assert f"step 6 to {run / 'checkpoints/step-6'} failed: [Errno 28] No space left" in err
    assert "Free space there" in err
    storage = CheckpointStorage.for_path(run / "checkpoints")
    assert storage.interrupted_steps() == [6]
    assert {k: v for k, v in snapshot(run / "checkpoints").items() if "step-6" not in k} == (
        saved_steps
    )
    if mode == "sync":  # the next start removes the interrupted save, saying so
        assert train(run, *flags, *RESUME) == 0
        out = capsys.readouterr().out
        assert f"removed checkpoint {run / 'checkpoints/step-6'}: an interrupted save" in out
        assert storage.complete_steps() == [2, 4, 6]


def test_file_size_limit_during_a_save_names_the_file(run, capsys):
    """RLIMIT_FSIZE (ulimit -f) stops a checkpoint file mid-write; torch says only "[enforce fail
    at inline_container.cc]". The message names the file and the limit instead."""
    limit = 100_000  # bytes: below every checkpoint file, above config.json and metrics.jsonl
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        code = train(run, "--training.steps", "6", "--checkpoint.interval", "2", *RESUME)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 1
    err = one_line(capsys.readouterr().err)
    step_dir = run / "checkpoints/step-6"
    expected = (
        rf"error: Saving the checkpoint of step 6 to {re.escape(str(step_dir))} failed: "
        rf"__0_\d\.distcp reached this process's file-size limit of {limit} bytes \(ulimit -f\)\. "
        r"Raise that limit \(or --checkpoint\.writer_threads: more threads write more, smaller "
        r"files\), then run again with --checkpoint\.resume true to continue from the last "
        r"complete checkpoint\.\n"
    )
    assert re.fullmatch(expected, err), err
    assert CheckpointStorage.for_path(run / "checkpoints").interrupted_steps() == [6]


def test_another_runs_checkpoint_folder_is_refused_at_start(saved, tmp_path, capsys):
    before = snapshot(saved / "checkpoints")
    flags = ["--training.steps", "2", "--checkpoint.interval", "2",
             "--checkpoint.folder", str(saved / "checkpoints")]  # fmt: skip
    assert train(tmp_path / "other", *flags) == 1
    err = one_line(capsys.readouterr().err)
    assert "already holds checkpoints of another run (steps 2, 4)" in err
    assert "--checkpoint.resume true" in err
    assert snapshot(saved / "checkpoints") == before
    assert not (tmp_path / "other/metrics.jsonl").exists()


def test_a_damaged_only_step_says_how_to_start_afresh(run, capsys):
    """No older step to load: the hints of a damaged step (load_step, fallback) cannot help, so
    the error says how to start again instead; with fallback, the same."""
    shutil.rmtree(run / "checkpoints/step-2")
    (run / "checkpoints/step-4/.metadata").unlink()
    flags = ["--training.steps", "6", "--checkpoint.interval", "2", *RESUME]
    for extra in ([], ["--checkpoint.fallback", "true"]):
        assert train(run, *flags, *extra) == 1
        err = one_line(capsys.readouterr().err)
        assert "--checkpoint.load_step" not in err
        assert "afresh with --output.overwrite true and no --checkpoint.resume" in err, err


def test_a_save_error_raised_while_unwinding_from_ctrl_c_is_the_interrupt() -> None:
    """Ctrl-C inside a write can surface as the writer's own error (torch's zip writer:
    "unexpected pos"), with the KeyboardInterrupt as its context: that is the interruption
    (exit 130 and the resume line), not a failed save to fix."""
    from torchloom.checkpoint.manager import _interrupted

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from None
    except RuntimeError as err:
        unwound = err
    assert unwound.__cause__ is None and _interrupted(unwound)
    assert not _interrupted(RuntimeError("disk full"))
