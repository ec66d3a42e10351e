"""The trainer under torchrun (gloo, CPU): every layout gives the single-process losses."""

import json
import os
import subprocess
import sys

import pytest

from torchloom.cli import main

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "debug", "--training.steps", "4", "--metrics.tensorboard", "false",
          "--training.sample_tokens", "0", "--training.val_sequences", "8",
          "--training.device", "cpu"]  # fmt: skip


def losses(output_dir) -> list[float]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [r.get("loss", r.get("val_loss")) for r in records]


def torchrun(nproc: int, output_dir, *layout: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "torchloom", "train", *COMMON,
           "--output.dir", str(output_dir), *layout]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    output_dir = tmp_path_factory.mktemp("single")
    assert main(["train", *COMMON, "--output.dir", str(output_dir)]) == 0
    return losses(output_dir)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ["--parallel.dp_shard", "2"]),
        (2, ["--parallel.tp", "2", "--training.micro_batch_size", "4"]),
        (4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
        (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"]),
        (2, ["--parallel.cp", "2"]),
        (4, ["--parallel.cp", "2", "--parallel.dp_shard", "2"]),
    ],
    ids=["fsdp2", "tp2-accum", "fsdp2xtp2", "hsdp2x2", "cp2", "fsdp2xcp2"],
)
def test_layout_matches_single_process(tmp_path, reference, nproc, layout):
    torchrun(nproc, tmp_path / "parallel", *layout)
    parallel = losses(tmp_path / "parallel")
    diff = max(abs(a - b) for a, b in zip(reference, parallel))
    print(f"{layout}: losses {parallel}, max |diff| vs single process {diff:.2e}")
    assert len(reference) == len(parallel) == 6  # val before, 4 steps, val after
    assert diff < 1e-5
