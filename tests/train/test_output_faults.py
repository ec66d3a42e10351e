"""Training faults end with one line and the right exit code, and leave the user's files as they
were: an output folder that is a file or cannot be created, Ctrl-C (exit 130, with the command
that resumes, also as a save begins), --output.overwrite saying what it removes, option values
refused at config validation even while the option that uses them is off (and accepted with a
warning when valid), and values that used to pass validation and fail later with a traceback."""

import json
import os
import shlex
from pathlib import Path

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from torchloom.cli import main
from torchloom.train.step import TrainStep

# Warm-up 1: the debug recipe's 5 steps would outlast these short runs (a warning each time).
COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--checkpoint.save_final_model", "false",
          "--training.device", "cpu", "--lr_schedule.warmup_steps", "1"]  # fmt: skip


def train(output_dir: Path, *flags: str) -> int:
    return main(["train", *COMMON, "--output.dir", str(output_dir), *flags])


def losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    print(err)
    return err


def test_output_folder_that_is_a_file_or_cannot_be_created(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("the user's notes\n")
    assert train(file, "--training.steps", "1") == 2
    assert f"--output.dir {file} is a file, not a folder" in one_line(capsys.readouterr().err)
    assert train(file / "run", "--training.steps", "1") == 2
    message = f"Cannot create {file / 'run'}: {file} is a file, not a folder"
    assert message in one_line(capsys.readouterr().err)
    assert file.read_text() == "the user's notes\n"


def test_a_run_refused_before_training_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    assert train(out, "--training.steps", "1", "--data.sources", '["missing.txt"]') == 2
    assert "Data source 'missing.txt' does not exist" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "new").exists()


def test_a_run_failing_before_its_first_step_leaves_nothing_that_blocks_a_retry(tmp_path, capsys):
    """Checks that ran after the run wrote config.json and metrics.jsonl (a profiling folder
    that is a file, a memory snapshot on the CPU: now checked first; an empty source of a
    streaming mix, found at the first batch) left a folder that refused the corrected command
    without --output.overwrite. A folder the run did not make is kept."""
    out, notes = tmp_path / "run", tmp_path / "notes.txt"
    notes.write_text("notes\n")
    steps = ["--training.steps", "2", "--profiling.steps", "[2]"]
    assert train(out, *steps, "--profiling.folder", str(notes)) == 2
    assert f"--profiling.folder {notes} is a file, not a folder" in one_line(
        capsys.readouterr().err
    )
    assert not out.exists()
    assert train(out, *steps, "--profiling.memory_snapshot", "true") == 2
    assert "--profiling.memory_snapshot records the CUDA allocator" in one_line(
        capsys.readouterr().err
    )
    assert not out.exists()
    good, empty = tmp_path / "good.txt", tmp_path / "empty.txt"
    good.write_text("".join(f"document {i} has some words in it\n\n" for i in range(50)))
    empty.write_text("")
    streaming = ["--training.steps", "2", "--data.streaming", "true", "--data.val_fraction", "0"]
    mix = ["--data.mix", "[0.5, 0.5]"]
    assert train(out, *streaming, "--data.sources", json.dumps([str(good), str(empty)]), *mix) == 2
    assert "contains no documents" in capsys.readouterr().err.splitlines()[-1]
    assert not out.exists()
    out.mkdir()  # the user's own (empty) folder stays
    assert train(out, *streaming, "--data.sources", json.dumps([str(good), str(empty)]), *mix) == 2
    assert out.is_dir() and not any(out.iterdir())
    capsys.readouterr()
    assert train(out, *streaming, "--data.sources", json.dumps([str(good)])) == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_folder_that_is_not_writable(tmp_path, capsys):
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    assert train(folder, "--training.steps", "1") == 2
    assert "is not writable" in one_line(capsys.readouterr().err)


def test_overwrite_says_what_it_removes(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--training.steps", "1") == 0
    capsys.readouterr()
    assert train(out, "--training.steps", "1", "--output.overwrite", "true") == 0
    assert f"--output.overwrite true: removing config.json, metrics.jsonl from {out}" in (
        capsys.readouterr().out
    )


def interrupt_at_step(monkeypatch, step: int) -> None:
    """Ctrl-C while training step ``step``."""
    original, calls = TrainStep.__call__, []

    def train_step(self, batches):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return original(self, batches)

    monkeypatch.setattr(TrainStep, "__call__", train_step)


def test_ctrl_c_says_where_it_stopped_and_how_to_resume(tmp_path, capsys, monkeypatch):
    reference = tmp_path / "reference"
    flags = ["--training.steps", "4", "--checkpoint.interval", "2"]
    assert train(reference, *flags) == 0
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        interrupt_at_step(patch, 3)
        capsys.readouterr()
        assert train(out, *flags) == 130
    err = one_line(capsys.readouterr().err)
    checkpoint = out / "checkpoints/step-2"
    assert f"Interrupted at step 2 of 4; the last complete checkpoint is {checkpoint}." in err
    command = shlex.split(err.split("Resume with: ")[1])
    assert command[:2] == ["torchloom", "train"] and command[-2:] == ["--checkpoint.resume", "true"]
    assert sorted(losses(out)) == [1, 2]  # what the interrupted run logged is still there
    assert main(command[1:]) == 0
    assert losses(out) == losses(reference)


def test_ctrl_c_before_any_checkpoint(tmp_path, capsys, monkeypatch):
    interrupt_at_step(monkeypatch, 2)
    assert train(tmp_path / "run", "--training.steps", "4", "--checkpoint.interval", "2") == 130
    err = one_line(capsys.readouterr().err)
    assert "Interrupted at step 1 of 4; there is no complete checkpoint to resume from." in err
    assert "Resume with" not in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parallel.pp_schedule", "foo"], "Unknown or unavailable --parallel.pp_schedule 'foo'"),
        (["--parallel.pp_stages_per_rank", "2"], "runs one stage per rank"),
        (["--parallel.pp_layers_per_stage", "[-1]"], "non-negative layer counts"),
        (["--parallel.pp_embedding_weight", "-1"], "pp_embedding_weight must be >= 0"),
        (["--compile.mode", "fastest"], "--compile.mode must be one of"),
        (["--compile.backend", "inductr"], "Unknown --compile.backend 'inductr'"),
        (["--compile.regions", "[]"], "--compile.regions is empty"),
        (["--training.val_interval", "-1"], "--training.val_interval must be >= 0"),
        (["--checkpoint.load_step", "2"], "applies only when resuming"),
        (["--metrics.peak_tflops", "-1"], "--metrics.peak_tflops must be a finite number >= 0"),
    ],
)
def test_option_values_are_checked_while_their_feature_is_off(capsys, flags, message):
    assert main(["train", "--recipe", "debug", *flags, "--print-config"]) == 2
    assert message in one_line(capsys.readouterr().err)


@pytest.mark.parametrize("mode, stopped", [("sync", 4), ("async", 5)])
def test_ctrl_c_as_a_save_begins_is_an_interruption(tmp_path, capsys, monkeypatch, mode, stopped):
    """Ctrl-C inside the writer of step 4's save (DCP wraps it in its own exception): exit 130
    with the resume line, not "Saving the checkpoint ... failed: KeyboardInterrupt"; step 4 has
    no marker yet, so step 2 is the one to resume from. (An async save's end is noticed after
    the next step.)"""
    out = tmp_path / "run"
    flags = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.mode", mode]
    original = dcp_filesystem._write_item

    def write_item(*args, **kwargs):
        if "step-4" in str(args):
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(dcp_filesystem, "_write_item", write_item)
        assert train(out, *flags) == 130
    err = one_line(capsys.readouterr().err)
    assert err.startswith(
        f"error: Interrupted at step {stopped} of 6; the last complete checkpoint is "
        f"{out / 'checkpoints/step-2'}. Resume with: torchloom train "
    ), err
    assert "failed" not in err


def test_ctrl_c_before_the_first_marker_is_the_same_case(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the first save's marker is being written: exit 130, nothing to resume."""
    from torchloom.checkpoint.storage import CheckpointStorage

    def mark_complete(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(CheckpointStorage, "mark_complete", mark_complete)
    assert train(tmp_path / "run", "--training.steps", "4", "--checkpoint.interval", "2") == 130
    assert one_line(capsys.readouterr().err) == (
        "error: Interrupted at step 2 of 4; there is no complete checkpoint to resume from.\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--training.max_norm", "nan"],
         "--training.max_norm must be a finite number >= 0 (0 disables clipping); got nan."),
        (["--training.max_norm", "inf"],
         "--training.max_norm must be a finite number >= 0 (0 disables clipping); got inf."),
        (["--training.seed", "-1"], "--training.seed must be in [0, 2**63); got -1."),
        (["--training.steps", "99999999999999999999"],
         "--training.steps must be below 2**31; got 99999999999999999999."),
        (["--training.global_batch_tokens", "-128"], "--training.global_batch_tokens must be >= 0 "
         "(0: use --training.global_batch_size); got -128."),
        (["--training.global_batch_tokens", "1024", "--training.global_batch_size", "4"],
         "--training.global_batch_size 4 and --training.global_batch_tokens 1024 (= 8 sequences "
         "of 128 tokens) disagree; give one of the two."),
        (["--training.device", "gpu"],
         "--training.device must be one of auto, cpu, cuda; got 'gpu'. Did you mean 'cuda'?"),
        (["--training.sample_prompt", "", "--training.sample_tokens", "4"],
         "--training.sample_prompt is empty, so the 4-token sample would have nothing to "
         "continue; give a prompt, e.g. --training.sample_prompt The, or --training.sample_tokens "
         "0 for no sample."),
        (["--profiling.steps", "[5, 6]", "--training.steps", "5"],
         "--profiling.steps [5, 6] lies beyond --training.steps 5, so the trace would never be "
         "written; pick steps within 1..5."),
        (["--training.mixed_precision", "fp32", "--parallel.mixed_precision_param", "bf16"],
         "--training.mixed_precision fp32 contradicts --parallel.mixed_precision_param bf16 (the "
         "dtype FSDP computes in); set both to fp32, or leave mixed_precision_param at auto to "
         "follow training.mixed_precision."),
        (["--recipe", "qwen3_tiny"], "--recipe is given twice (debug, qwen3_tiny); give it once."),
        (["--model.overrides", '{"init_std": Infinity}'],
         "model init_std must be a finite number, got inf."),
        (["--optimizer.lr", "nan"], "--optimizer.lr must be a positive number; got nan."),
        (["--optimizer.eps", "-1"],
         "--optimizer.eps must be a number > 0 (1e-8 is usual); got -1.0."),
        (["--optimizer.eps", "0"],
         "--optimizer.eps must be a number > 0 (1e-8 is usual); got 0.0."),
        (["--optimizer.weight_decay", "-0.1"],
         "--optimizer.weight_decay must be a number >= 0 (0: no decay); got -0.1."),
        (["--model.loss_impl", "magic"], "Unknown --model.loss_impl 'magic'. Available: full, "
         "chunked."),
        (["--output.dir", ""], "--output.dir is empty; name the run's folder, e.g. --output.dir "
         "outputs/run (. for the current folder)."),
        # Sweep 29: NaN printed "mfu nan%" every step; an empty folder put step-N/ beside model/;
        # --dry-run was skipped without a word; the list's error lacked the option and example.
        (["--metrics.peak_tflops", "nan"],
         "--metrics.peak_tflops must be a finite number >= 0 (0 looks the device up); got nan."),
        (["--checkpoint.folder", ""], "--checkpoint.folder is empty: checkpoints would land in "
         "the output folder's root beside the model; give a folder (default: checkpoints)."),
        (["--dry-run"], "--print-config prints the resolved config and exits, --dry-run checks "
         "the layout and memory; give one of them."),
        (["--data.mix", '["a", "b"]'], "--data.mix expects list[float], got '[\"a\", \"b\"]'. "
         "Example: --data.mix '[0.6, 0.4]'"),
        (["--dry-runn"], "Unknown option --dry-runn. Did you mean '--dry-run'? Run with --help to "
         "list every option."),
        (["--world-sise", "2"], "Unknown option --world-sise. Did you mean '--world-size'? Run "
         "with --help to list every option."),
    ],
)  # fmt: skip
def test_values_that_failed_later_are_refused_at_once(capsys, flags, message):
    assert main(["train", "--recipe", "debug", *flags, "--print-config"]) == 2
    assert one_line(capsys.readouterr().err) == f"error: {message}\n"


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "cache.txt"
    file.write_text("not a folder\n")
    assert train(tmp_path / "run", "--training.steps", "1", "--data.cache_dir", str(file)) == 2
    assert one_line(capsys.readouterr().err) == (
        f"error: --data.cache_dir {file} is a file, not a folder; point --data.cache_dir at a "
        "folder.\n"
    )
    assert file.read_text() == "not a folder\n"


@pytest.mark.parametrize(
    "flags, warning",
    [
        (["--compile.regions", '["Attention"]'],
         "--compile.regions [\"Attention\"] has no effect until --compile.enabled true."),
        (["--parallel.pp_microbatches", "3"],
         "--parallel.pp_microbatches 3 has no effect until --parallel.pp > 1."),
        (["--parallel.pp_schedule", "gpipe"],
         "--parallel.pp_schedule gpipe has no effect until --parallel.pp > 1."),
        (["--training.steps", "3", "--lr_schedule.warmup_steps", "11"],
         "--lr_schedule.warmup_steps 11 exceeds --training.steps 3: the learning rate ends the "
         "run at 25% of --optimizer.lr, never reaching it; lower warmup_steps to reach the peak."),
        (["--remat.every_k", "3"], "--remat.every_k 3 has no effect until --remat.mode every_k."),
        (["--remat.memory_budget", "0.3"],
         "--remat.memory_budget 0.3 has no effect until --remat.mode budget."),
        (["--remat.save_ops", '["mm"]'],
         '--remat.save_ops ["mm"] has no effect until --remat.mode selective.'),
        (["--checkpoint.keep_latest_k", "2"],
         "--checkpoint.keep_latest_k 2 has no effect until --checkpoint.interval > 0."),
        (["--checkpoint.mode", "async"],
         "--checkpoint.mode async has no effect until --checkpoint.interval > 0."),
        (["--checkpoint.fallback", "true"],
         "--checkpoint.fallback true has no effect until --checkpoint.resume true."),
        (["--checkpoint.exclude_from_loading", '["optimizer"]'],
         '--checkpoint.exclude_from_loading ["optimizer"] has no effect until '
         "--checkpoint.resume true."),
        (["--lr_schedule.decay_fraction", "0.5"],
         "--lr_schedule.decay_fraction 0.5 has no effect until --lr_schedule.decay wsd."),
        (["--lr_schedule.decay", "constant", "--lr_schedule.min_lr_ratio", "0.5"],
         "--lr_schedule.min_lr_ratio 0.5 has no effect until --lr_schedule.decay is cosine, "
         "linear or wsd."),
        (["--profiling.record_shapes", "false"],
         "--profiling.record_shapes false has no effect until --profiling.steps names steps to "
         "trace."),
        (["--parallel.loss_parallel", "false"],
         "--parallel.loss_parallel false has no effect until --parallel.tp > 1."),
        (["--training.val_interval", "3", "--training.val_interval", "1"],
         "--training.val_interval is given twice (3, then 1); the last one is used."),
        (["--model.overrides", '{"num_layers": 3}', "--model.overrides", '{"dim": 128}'],
         '--model.overrides is given twice ({"num_layers": 3}, then {"dim": 128}); the last one '
         "is used, not merged with the first."),
    ],
)  # fmt: skip
def test_valid_options_that_do_nothing_are_accepted_with_a_warning(capsys, flags, warning):
    """The rule for an option of a feature that is off (with
    test_option_values_are_checked_while_their_feature_is_off): a bad value is refused, a
    good one is accepted with one warning line."""
    assert main(["train", "--recipe", "debug", *flags, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {warning}\n"
    json.loads(captured.out)  # stdout stays the config alone


def test_inputs_a_command_cannot_use_name_the_fix(tmp_path, capsys, monkeypatch):
    """Sweep 29: a dry run asking for CUDA on a machine without one; rl given train's
    --dry-run (echoed as --dry_run); a load_step that is not there (exit 1, as if a checkpoint
    were damaged); a source named twice (accepted without a word)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["train", "--recipe", "debug", "--dry-run", "--training.device", "cuda"]) == 2
    assert "a dry run needs none: drop --training.device" in one_line(capsys.readouterr().err)
    assert main(["rl", "--recipe", "rl_debug", "--dry-run"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "error: --dry-run is an option of `torchloom train`; `torchloom rl` has no dry run. Try "
        "a short run instead (--training.steps 1).\n"
    )
    resume = ["--checkpoint.resume", "true", "--checkpoint.load_step", "5"]
    assert train(tmp_path / "run", "--training.steps", "1", *resume) == 2
    assert "--checkpoint.load_step 5 has no complete checkpoint in" in one_line(
        capsys.readouterr().err
    )
    sources = json.dumps(["a.txt", "b.txt", "a.txt"])
    assert main(["train", "--recipe", "debug", "--data.sources", sources, "--print-config"]) == 0
    assert capsys.readouterr().err == (
        "warning: --data.sources names a.txt more than once: its documents are read once per "
        "mention. Give each source once (with its weight in --data.mix) unless that is meant.\n"
    )
