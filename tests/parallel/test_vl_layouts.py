"""Qwen3-VL (vision encoder + decoder, rows with images) and Kimi K2.5 (MoonViT + DeepSeek-V3)
under every parallel layout they take reproduce the single-process run (gloo, 2 and 4 processes); the layouts it cannot take yet
are refused in one line.

One launch per world size runs every layout (see vl_worker.py); the tests read its results.
"""

from pathlib import Path

import pytest
import torch

from tests.parallel.launcher import run_worker
from tests.parallel.test_layouts import check_row
from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.parallel import ParallelConfig, ParallelDims
from torchloom.train.builders import check_layout

WORKER = Path(__file__).with_name("vl_worker.py")
TWO_RANKS = ("fsdp", "tp", "ep", "pp", "pp_deepstack_split", "k25_tp", "k25_pp", "generation")
FOUR_RANKS = ("fsdp_tp", "fsdp_tp_ep", "k25_fsdp_tp_ep")


def launch(nproc: int, *names: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"RESULT": [], "REFUSED": []}
    for kind, payload in run_worker(WORKER, nproc, *names):
        if kind in out:
            out[kind].append(payload)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, *TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, *FOUR_RANKS)


def check(results: list[dict], layout: str) -> None:
    rows = [r for r in results if r["layout"] == layout]
    assert rows, f"the worker reported nothing for {layout}"
    for r in rows:
        check_row(r, layout, r["flavor"])
        if "tp" in layout:  # the encoder's matrices are split, not left whole
            assert r["encoder_split"] > 0, r


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp", "tp", "ep", "pp", "k25_tp", "k25_pp"])
def test_two_rank_layouts_match_single_process(two_ranks, layout):
    check(two_ranks["RESULT"], layout)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", FOUR_RANKS)
def test_four_rank_layouts_match_single_process(four_ranks, layout):
    check(four_ranks["RESULT"], layout)


@pytest.mark.distributed
def test_generation_plan_gives_single_process_logits(two_ranks):
    """Generation's tp 2 plan (replicated stream, encoders split) on rows with images."""
    rows = [r for r in two_ranks["RESULT"] if r["layout"] == "generation"]
    assert {r["flavor"] for r in rows} == {"debug", "kimi_k25/debug"}, rows
    for r in rows:
        print(f"generation {r['flavor']}: max |logit diff| {r['logits_diff']:.1e}")
        assert r["logits_diff"] <= 1e-5 * r["logits_scale"], r


@pytest.mark.distributed
def test_pipeline_refuses_deepstack_layers_past_the_first_stage(two_ranks):
    (report,) = [r for r in two_ranks["REFUSED"] if r["layout"] == "pp_deepstack_split"]
    message = report["message"]
    assert message is not None, "a DeepStack layer on the second stage was accepted"
    assert "\n" not in message and "DeepStack" in message and "pp_layers_per_stage" in message


def test_context_parallel_refuses_a_vision_encoder_in_one_line():
    config = resolve_model_config(ModelConfig(name="qwen3_vl", flavor="debug"))
    with torch.device("meta"):
        model = build_model(config)
    dims = ParallelDims(ParallelConfig(cp=2, dp_shard=1).resolve(2), 2, 0, "cpu")
    with pytest.raises(ConfigError) as error:
        check_layout(model, dims)
    message = str(error.value)
    assert "\n" not in message and "--parallel.cp 2" in message and "vision encoder" in message


def test_kimi_k25_refuses_what_its_plan_cannot_split_in_one_line():
    from dataclasses import replace

    from torchloom.models.kimi_k25 import tp_plan

    config = resolve_model_config(ModelConfig(name="kimi_k25", flavor="debug"))
    cases = [
        (replace(config, mtp_layers=1), 2, '"mtp_layers": 0'),
        (config, 4, "does not divide vision.num_heads (2)"),
    ]
    for case, tp, expected in cases:
        with torch.device("meta"):
            model = build_model(case)
        with pytest.raises(ConfigError) as error:
            tp_plan(model, tp)
        assert "\n" not in str(error.value) and expected in str(error.value), error.value
    with torch.device("meta"):
        model = build_model(config)
    generation = tp_plan(model, 2, False, sequence_parallel=False)  # no sequence cut
    assert (
        "residual_entry" not in generation
        and "vision_tower.layers.0.attention.q_proj" in generation
    )
