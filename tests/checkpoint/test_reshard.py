"""A checkpoint saved with one parallel layout loads into another (DCP reshards): FSDP over 2
ranks -> 1 process, FSDP x TP over 4, PP over 2; the next steps' losses match."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "debug", "--metrics.tensorboard", "false", "--training.sample_tokens", "0",
          "--training.val_sequences", "8", "--checkpoint.save_final_model", "false",
          "--training.device", "cpu", "--training.steps", "4"]  # fmt: skip


def losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="module")
def saved_with_fsdp(tmp_path_factory, torchrun_train) -> Path:
    out = tmp_path_factory.mktemp("fsdp") / "run"
    torchrun_train(2, *COMMON, "--output.dir", str(out), "--parallel.dp_shard", "2",
                   "--checkpoint.interval", "2")  # fmt: skip
    return out


@pytest.mark.parametrize(
    "nproc, layout",
    [(1, []), (4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]), (2, ["--parallel.pp", "2"])],
    ids=["single", "fsdp2xtp2", "pp2"],
)
def test_fsdp_checkpoint_loads_into_another_layout(
    saved_with_fsdp, torchrun_train, tmp_path, nproc, layout
):
    out = tmp_path / "run"
    torchrun_train(nproc, *COMMON, "--output.dir", str(out), *layout, "--checkpoint.resume",
                   "true", "--checkpoint.load_step", "2", "--checkpoint.folder",
                   str(saved_with_fsdp / "checkpoints"))  # fmt: skip
    reference, resumed = losses(saved_with_fsdp), losses(out)
    diff = max(abs(resumed[s] - reference[s]) for s in (3, 4))
    print(f"{layout or 'one process'}: steps 3-4 {resumed}, max |diff| vs FSDP run {diff:.1e}")
    assert sorted(resumed) == [3, 4] and diff < 1e-5
