"""Pipeline parallelism reproduces the single-process run (gloo, 2 and 4 processes), and the
layouts it cannot run are refused up front with a message."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.parallel.launcher import run_worker
from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, resolve_model_config
from torchloom.parallel import ParallelConfig, ParallelDims
from torchloom.parallel.config import SCHEDULES
from torchloom.parallel.pipeline import (
    Pipeline,
    layers_per_stage,
    local_stage_ids,
    split_layers,
    zbv_runs_on,
)

WORKER = Path(__file__).with_name("pipeline_worker.py")
LOSS_TOL, PARAM_TOL = 1e-5, 1e-5
NORM_RTOL = 5e-5  # see test_layouts.py: another summation order moves the norm ~1e-5 relative


def launch(nproc: int, *names: str) -> dict[str, dict]:
    lines = run_worker(WORKER, nproc, *names)
    return {result["layout"]: result for kind, result in lines if kind == "RESULT"}


# torch 2.11 cannot run zbv on gloo (build_pipeline refuses it there): those layouts run on
# torch >= 2.13, which CI installs.
ZBV_SKIP = pytest.mark.skipif(not zbv_runs_on("cpu"), reason="zbv on gloo needs torch >= 2.13")


def runnable(*names: str) -> list[str]:
    return [n for n in names if "zbv" not in n or zbv_runs_on("cpu")]


def cases(*names: str) -> list:
    return [pytest.param(n, marks=ZBV_SKIP) if "zbv" in n else n for n in names]


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, *runnable(*SCHEDULES, "gpipe_nomask", "1f1b_weighted"))


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, *runnable("fsdp_pp", "tp_pp_zbv", "tp_pp"))


def check(results: dict[str, dict], layout: str) -> None:
    r = results[layout]
    print(
        f"{layout:>16}: max |loss diff| {r['loss_diff']:.1e}, |grad-norm diff| "
        f"{r['norm_diff']:.1e}, |val-loss-sum diff| {r['val_diff']:.1e}, "
        f"|param diff| {r['param_diff']:.1e} ({r['seconds']:.1f} s)"
    )
    assert not r["missing"], f"exported names differ from the single-process model: {r['missing']}"
    assert r["loss_diff"] <= LOSS_TOL, r
    assert r["norm_diff"] <= NORM_RTOL * 10, r  # norms are ~2-5
    assert r["val_diff"] <= 1e-5 * 500, r  # a sum of ~50 token losses of ~8.3
    assert r["param_diff"] <= PARAM_TOL, r


@pytest.mark.distributed
@pytest.mark.parametrize("layout", cases(*SCHEDULES, "gpipe_nomask"))
def test_every_schedule_matches_single_process(two_ranks, layout):
    check(two_ranks, layout)


@pytest.mark.distributed
def test_an_objective_reading_batch_extras_runs_on_the_last_stage(two_ranks):
    """The objective's extra field (a per-token weight) reaches the last stage cut into
    micro-batches with the labels: the same losses and weights as one process."""
    check(two_ranks, "1f1b_weighted")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", cases("fsdp_pp", "tp_pp_zbv", "tp_pp"))
def test_pp_composes_with_fsdp_and_tp(four_ranks, layout):
    check(four_ranks, layout)


def llama3(num_layers: int = 4):
    return resolve_model_config(
        ModelConfig(name="llama3", flavor="debug", overrides={"num_layers": num_layers})
    )


def test_split_counts_embedding_and_head_as_layers():
    assert split_layers(4, 2, 1.0, None) == [2, 2]
    assert split_layers(8, 2, 1.0, None) == [4, 4]
    assert split_layers(5, 3, 2.0, None) == [1, 3, 1]  # the end stages carry 2 + 1 "layers"
    assert split_layers(4, 4, 1.0, None) == [0, 2, 1, 1]  # stage 0: the embedding alone
    assert split_layers(8, 2, 0.0, [3, 5]) == [3, 5]
    assert local_stage_ids(0, 2, 2, "zbv") == [0, 3]  # V shape
    assert local_stage_ids(1, 2, 2, "interleaved_1f1b") == [1, 3]  # looped


@pytest.mark.parametrize(
    "model, config, message",
    [
        (
            resolve_model_config(ModelConfig(name="qwen3", flavor="debug")),
            ParallelConfig(pp=2),
            "tied embeddings",
        ),
        (llama3(8), ParallelConfig(pp=2, pp_layers_per_stage=[3, 4]), "summing to the model's 8"),
        (llama3(), ParallelConfig(pp=2, pp_schedule="dualpipe"), "offers: gpipe, 1f1b"),
        (llama3(), ParallelConfig(pp=2, pp_schedule="1f1b", pp_stages_per_rank=2), "one stage"),
        (llama3(2), ParallelConfig(pp=4, pp_schedule="looped_bfs"), "cannot fill 8 pipeline"),
        (llama3(), ParallelConfig(pp=2, dp_shard=2, pp_schedule="zbv"), "zero-bubble"),
    ],
    ids=["tied", "bad-split", "unknown-schedule", "stages-per-rank", "too-few-layers", "zb-fsdp"],
)
def test_impossible_layouts_are_refused(model, config, message):
    with pytest.raises(ConfigError, match=message) as error:
        layers_per_stage(model, config)
    print(error.value)


def test_microbatches_must_divide_the_batch():
    config = ParallelConfig(pp=2, dp_shard=1, pp_microbatches=3)
    dims = ParallelDims(config.resolve(2), 2, 0, "cpu")
    pipeline = Pipeline([], [], [], [0, 1], dims=dims, microbatches=3, objective=None)
    with pytest.raises(ConfigError) as error:
        pipeline.step(SimpleNamespace(tokens=torch.zeros(4, 8)), torch.ones(()))
    message = str(error.value)
    assert "batch of 4 sequences does not split into --parallel.pp_microbatches 3" in message
    assert "choose --parallel.pp_microbatches 2 or 4" in message
    print(error.value)
