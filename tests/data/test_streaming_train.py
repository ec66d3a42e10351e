"""Training on a streamed parquet + arrow mix: the loader state rides in the checkpoint, a
resumed run's losses equal the uninterrupted run's bit for bit, and a 2-rank run resumes on 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.data.stream_files import texts, write_arrow, write_parquet
from torchloom.cli import main


def flags(output_dir: Path, sources: list[Path], tokenizer: Path) -> list[str]:
    return ["--recipe", "debug", "--data.tokenizer", str(tokenizer),
            "--metrics.tensorboard", "false",
            "--training.sample_tokens", "0", "--training.device", "cpu",
            "--data.streaming", "true", "--data.val_fraction", "0",
            "--data.sources", json.dumps([str(s) for s in sources]), "--data.mix", "[0.6, 0.4]",
            "--output.dir", str(output_dir)]  # fmt: skip


def records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def train(output_dir: Path, sources: list[Path], tokenizer: Path, *more: str) -> list[dict]:
    assert main(["train", *flags(output_dir, sources, tokenizer), *more]) == 0
    return records(output_dir)


def resume_from(step_dir: Path, out: Path) -> Path:
    """A fresh output folder holding only ``step_dir``, to resume from."""
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(step_dir, out / "checkpoints" / step_dir.name)
    return out


def test_resumed_streaming_run_matches_uninterrupted(tmp_path: Path, tiny_tokenizer) -> None:
    sources = [write_parquet(tmp_path / "a.parquet", texts("alpha", 300), rows_per_group=20),
               write_arrow(tmp_path / "b.arrow", texts("beta", 200), stream=True)]  # fmt: skip
    tok = tiny_tokenizer.path
    full = train(tmp_path / "full", sources, tok, "--training.steps", "5",
                 "--checkpoint.interval", "2")  # fmt: skip
    out = resume_from(tmp_path / "full/checkpoints/step-2", tmp_path / "resumed")
    resumed = train(out, sources, tok, "--training.steps", "5", "--checkpoint.resume", "true")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for ours, theirs in zip(resumed, full[2:], strict=True):
        assert ours["loss"] == theirs["loss"], (ours["loss"], theirs["loss"])  # bitwise


@pytest.mark.distributed
def test_two_rank_streaming_run_resumes_on_two_and_on_one(tmp_path, tiny_tokenizer, torchrun_train):
    """FSDP over 2 gloo ranks; from its step-2 checkpoint, 2 ranks continue bitwise and 1 rank
    continues on the same data (losses equal up to the summation order of 2 ranks vs 1)."""
    sources = [write_parquet(tmp_path / "a.parquet", texts("alpha", 300), rows_per_group=20),
               write_arrow(tmp_path / "b.arrow", texts("beta", 200), stream=True)]  # fmt: skip
    tok, layout = tiny_tokenizer.path, ["--parallel.dp_shard", "2"]
    steps = ["--training.steps", "4"]
    full_dir = tmp_path / "full"
    torchrun_train(2, *flags(full_dir, sources, tok), *steps, *layout,
                   "--checkpoint.interval", "2")  # fmt: skip
    full = records(full_dir)
    two = resume_from(full_dir / "checkpoints/step-2", tmp_path / "two")
    torchrun_train(2, *flags(two, sources, tok), *steps, *layout, "--checkpoint.resume", "true")
    one = resume_from(full_dir / "checkpoints/step-2", tmp_path / "one")
    assert main(["train", *flags(one, sources, tok), *steps, "--checkpoint.resume", "true"]) == 0
    for name, resumed in (("2 ranks", records(two)), ("1 rank", records(one))):
        assert [r["step"] for r in resumed] == [3, 4], name
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, full[2:], strict=True)]
        print(f"{name}: |loss diff| vs the uninterrupted 2-rank run {diffs}")
        assert max(diffs) == 0 if name == "2 ranks" else max(diffs) < 1e-5, (name, diffs)


def test_resuming_with_the_other_loader_names_the_setting(tmp_path, tiny_tokenizer, capsys):
    """A streamed run's checkpoint resumed by the cached loader (its state has other keys):
    one line naming the part, the setting and the way to resume without it, which works."""
    sources = [write_parquet(tmp_path / "a.parquet", texts("alpha", 300), rows_per_group=20),
               write_arrow(tmp_path / "b.arrow", texts("beta", 200), stream=True)]  # fmt: skip
    tok = tiny_tokenizer.path
    train(tmp_path / "run", sources, tok, "--training.steps", "2", "--checkpoint.interval", "2")
    capsys.readouterr()
    cached = [*flags(tmp_path / "run", sources, tok), "--data.streaming", "false",
              "--data.mix", "[]", "--training.steps", "3", "--checkpoint.resume", "true"]  # fmt: skip
    assert main(["train", *cached]) != 0
    err = capsys.readouterr().err
    assert "The checkpoint's dataloader state has another shape than this run's" in err, err
    assert "--data.streaming" in err and "exclude_from_loading '[\"dataloader\"]'" in err, err
    skip = ["--checkpoint.exclude_from_loading", '["dataloader"]']
    assert main(["train", *cached, *skip]) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "validation loss nan" not in out, out
