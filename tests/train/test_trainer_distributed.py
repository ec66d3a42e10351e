"""The trainer under torchrun (gloo, CPU): every layout gives the single-process losses."""

import json

import pytest
from torch.distributed.tensor import DTensor

from torchloom.cli import main, resolve_job
from torchloom.parallel import destroy
from torchloom.train.trainer import Trainer

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "debug", "--training.steps", "4", "--metrics.tensorboard", "false",
          "--training.sample_tokens", "0", "--training.val_sequences", "8",
          "--training.device", "cpu"]  # fmt: skip


def losses(output_dir) -> list[float]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [r.get("loss", r.get("val_loss")) for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    output_dir = tmp_path_factory.mktemp("single")
    assert main(["train", *COMMON, "--output.dir", str(output_dir)]) == 0
    return losses(output_dir)


LAYOUTS = {
    "fsdp2": (2, "--parallel.dp_shard 2"),
    "fsdp2-chunked-loss": (2, "--parallel.dp_shard 2 --model.loss_impl chunked"),
    "tp2-accum": (2, "--parallel.tp 2 --training.micro_batch_size 4"),
    "fsdp2xtp2": (4, "--parallel.dp_shard 2 --parallel.tp 2"),
    "hsdp2x2": (4, "--parallel.dp_replicate 2 --parallel.dp_shard 2"),
    "cp2": (2, "--parallel.cp 2"),
    "fsdp2xcp2": (4, "--parallel.cp 2 --parallel.dp_shard 2"),
    "cp2xpp2": (4, "--parallel.cp 2 --parallel.pp 2"),
    # TP -> recomputation -> compile -> FSDP, the whole composition order.
    "fsdp2xtp2-remat-compile": (
        4,
        "--parallel.dp_shard 2 --parallel.tp 2 --remat.mode selective --compile.enabled true "
        "--compile.backend aot_eager",
    ),
    # The compiler's min-cut partitioner choosing what each block recomputes (the fastest 8B
    # setting on one GPU) composed with FSDP: inductor, as budget mode needs. This checks the
    # composition and its losses, not what the partitioner keeps at this size.
    "fsdp2-remat-budget": (
        2,
        "--parallel.dp_shard 2 --remat.mode budget --remat.memory_budget 0.5 "
        "--compile.enabled true",
    ),
    "fsdp2xtp2xpp2": (
        8,
        "--parallel.dp_shard 2 --parallel.tp 2 --parallel.pp 2 "
        "--parallel.pp_schedule interleaved_1f1b",
    ),
}
SLOW = {"fsdp2xtp2xpp2", "fsdp2-remat-budget"}  # 8 processes, inductor: ~40 s each


@pytest.mark.parametrize(
    "nproc, layout",
    [
        pytest.param(n, flags.split(), id=name, marks=[pytest.mark.slow] if name in SLOW else [])
        for name, (n, flags) in LAYOUTS.items()
    ],
)
def test_layout_matches_single_process(tmp_path, reference, torchrun_train, nproc, layout):
    torchrun_train(nproc, *COMMON, "--output.dir", str(tmp_path / "parallel"), *layout)
    parallel = losses(tmp_path / "parallel")
    diff = max(abs(a - b) for a, b in zip(reference, parallel))
    print(f"{layout}: losses {parallel}, max |diff| vs single process {diff:.2e}")
    assert len(reference) == len(parallel) == 6  # val before, 4 steps, val after
    assert diff < 1e-5


def test_fsdp_on_one_process_matches_plain_training(tmp_path, reference):
    """--parallel.fsdp_always shards over a one-rank group (no torchrun needed): same losses."""
    _, job = resolve_job([*COMMON, "--output.dir", str(tmp_path), "--parallel.fsdp_always", "true"])
    trainer = Trainer(job)
    try:
        assert isinstance(next(trainer.model.parameters()), DTensor)
        trainer.train()
    finally:
        destroy()
    diff = max(abs(a - b) for a, b in zip(reference, losses(tmp_path)))
    print(f"fsdp_always on one process: max |loss diff| vs plain {diff:.2e}")
    assert len(losses(tmp_path)) == 6 and diff < 1e-5
