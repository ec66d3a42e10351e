"""`torchloom train --parallel.pp 2` under torchrun (gloo, CPU) gives the single-process losses
and exports the same model (names, shapes, values)."""

import json

import pytest
from safetensors.torch import load_file

from torchloom.cli import main

pytestmark = pytest.mark.distributed

COMMON = ["--recipe", "debug", "--training.steps", "4", "--metrics.tensorboard", "false",
          "--training.sample_tokens", "0", "--training.val_sequences", "8",
          "--training.device", "cpu", "--model.overrides", '{"num_layers": 4}']  # fmt: skip

INTERLEAVED = ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b"]


def losses(output_dir) -> list[float]:
    records = map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
    return [r.get("loss", r.get("val_loss")) for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("single")
    assert main(["train", *COMMON, "--output.dir", str(output_dir)]) == 0
    return output_dir


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, ["--parallel.pp", "2"]),
        (2, [*INTERLEAVED, "--training.micro_batch_size", "4"]),
        (4, [*INTERLEAVED, "--parallel.dp_shard", "2"]),
    ],
    ids=["pp2-1f1b", "pp2-interleaved-accum", "fsdp2xpp2-interleaved"],
)
def test_pipeline_trainer_matches_single_process(
    tmp_path, reference, torchrun_train, nproc, layout
):
    torchrun_train(nproc, *COMMON, "--output.dir", str(tmp_path), *layout)
    single, parallel = losses(reference), losses(tmp_path)
    diff = max(abs(a - b) for a, b in zip(single, parallel))
    expected = load_file(reference / "model" / "model.safetensors")
    exported = load_file(tmp_path / "model" / "model.safetensors")
    assert sorted(exported) == sorted(expected), sorted(set(exported) ^ set(expected))
    shapes = {k: (exported[k].shape, v.shape) for k, v in expected.items()}
    assert all(a == b for a, b in shapes.values()), shapes
    param_diff = max((exported[k] - v).abs().max().item() for k, v in expected.items())
    print(f"{layout}: losses {parallel}, max |loss diff| {diff:.2e}, |param diff| {param_diff:.2e}")
    assert len(single) == len(parallel) == 6  # val before, 4 steps, val after
    assert diff < 1e-5
    # 4 Adam steps at lr up to 2e-3 amplify fp32 rounding noise: 2.49e-5 on an AMD host's BLAS
    # (the same before and after the RL rework), under 2e-5 on Intel.
    assert param_diff < 4e-5
