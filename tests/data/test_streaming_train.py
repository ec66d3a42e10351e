"""Training on a streamed parquet mix: the loader state rides in the checkpoint, and a resumed
run's losses equal the uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.data.stream_files import texts, write_arrow, write_parquet
from torchloom.cli import main


def train(output_dir: Path, sources: list[Path], tokenizer: Path, *flags: str) -> list[dict]:
    args = ["train", "--recipe", "debug", "--data.tokenizer", str(tokenizer), "--metrics.tensorboard", "false",
            "--training.sample_tokens", "0", "--training.device", "cpu",
            "--data.streaming", "true", "--data.val_fraction", "0",
            "--data.sources", json.dumps([str(s) for s in sources]), "--data.mix", "[0.6, 0.4]",
            "--output.dir", str(output_dir), *flags]  # fmt: skip
    assert main(args) == 0
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_resumed_streaming_run_matches_uninterrupted(tmp_path: Path, tiny_tokenizer) -> None:
    sources = [write_parquet(tmp_path / "a.parquet", texts("alpha", 300), rows_per_group=20),
               write_arrow(tmp_path / "b.arrow", texts("beta", 200), stream=True)]  # fmt: skip
    tok = tiny_tokenizer.path
    full = train(tmp_path / "full", sources, tok, "--training.steps", "5",
                 "--checkpoint.interval", "2")  # fmt: skip
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full/checkpoints/step-2", out / "checkpoints/step-2")
    resumed = train(out, sources, tok, "--training.steps", "5", "--checkpoint.resume", "true")
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for ours, theirs in zip(resumed, full[2:], strict=True):
        assert ours["loss"] == theirs["loss"], (ours["loss"], theirs["loss"])  # bitwise
