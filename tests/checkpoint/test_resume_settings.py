"""A resume takes the optimizer's moments and the schedule's position from the checkpoint, but
the settings from this run's flags: a changed --optimizer.lr or weight decay applies from the
first resumed step (the resumed line names it), and a longer --training.steps puts that step on
the new schedule, at a fresh run's rate. Unchanged flags change nothing (the bitwise resume
tests in test_resume.py)."""

from __future__ import annotations

import json

from torchloom.cli import main

RUN = ["train", "--recipe", "debug", "--training.device", "cpu", "--training.global_batch_size",
       "2", "--training.val_sequences", "2", "--training.sample_tokens", "0",
       "--lr_schedule.warmup_steps", "0", "--checkpoint.interval", "1",
       "--metrics.tensorboard", "false"]  # fmt: skip


def rates(folder) -> dict[int, float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}


def test_a_resume_applies_this_runs_optimizer_and_schedule(tmp_path, capsys) -> None:
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    assert main([*RUN, "--training.steps", "2", "--output.dir", str(run)]) == 0
    assert main([*RUN, "--training.steps", "6", "--output.dir", str(fresh)]) == 0
    capsys.readouterr()
    # Two steps saved on a 2-step schedule, continued on a 6-step one: step 3 runs at the
    # 6-step schedule's rate, as in a run planned for 6 steps from the start.
    assert main([*RUN, "--training.steps", "6", "--output.dir", str(run),
                 "--checkpoint.resume", "true"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "with this run's settings: the schedule's rate" in out, out
    assert rates(run)[3] == rates(fresh)[3]
    # A new peak rate and weight decay: named, and in force from the first resumed step.
    assert main([*RUN, "--training.steps", "8", "--output.dir", str(run), "--checkpoint.resume",
                 "true", "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.5"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "--optimizer.lr 0.003 -> 0.01" in out and "weight_decay 0.1 -> 0.5" in out, out
    resumed = rates(run)[7]
    assert main([*RUN, "--training.steps", "8", "--output.dir", str(fresh),
                 "--output.overwrite", "true", "--optimizer.lr", "0.01"]) == 0  # fmt: skip
    assert resumed == rates(fresh)[7]
