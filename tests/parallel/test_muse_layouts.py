"""Muse Glimmer (images) and Muse Spark (images and audio, latent MoE, residual gates) under
tensor parallelism with sequence parallelism reproduce the single-process run (gloo, 2 and 4
processes), the encoders split by heads and hidden units; generation's replicated-stream plan
gives the single-process logits; a degree the plan cannot split is refused in one line.

One launch per world size runs every layout (see muse_worker.py); the tests read its results.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.parallel.launcher import run_worker
from tests.parallel.test_layouts import LOSS_TOL, check_row
from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.muse_glimmer import muse_tp_plan

WORKER = Path(__file__).with_name("muse_worker.py")
FLAVORS = {"muse_glimmer/debug", "muse_spark/debug"}
# Small and fed straight from the patches (ReplicateParallel, as MoonViT's): the only encoder
# matrices left whole.
WHOLE = ["vision_tower.pos_embed", "vision_tower.patch_embed.weight"]


def launch(nproc: int, *names: str) -> list[dict]:
    return [payload for kind, payload in run_worker(WORKER, nproc, *names) if kind == "RESULT"]


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, "tp", "ep", "pp", "generation")


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, "fsdp_tp", "fsdp_tp_ep")


def check(results: list[dict], layout: str, flavors: set[str] = FLAVORS) -> None:
    rows = [r for r in results if r["layout"] == layout]
    assert {r["flavor"] for r in rows} == flavors, rows
    for r in rows:
        check_row(r, layout, r["flavor"])
        if "tp" in layout:
            assert r["whole_encoder_matrices"] == WHOLE, r["whole_encoder_matrices"]
            assert not r["off_tp_mesh"], f"not on the tp mesh: {r['off_tp_mesh']}"


@pytest.mark.distributed
def test_tp_matches_single_process(two_ranks):
    check(two_ranks, "tp")


@pytest.mark.distributed
def test_pp_matches_single_process(two_ranks):
    """Two pipeline stages, the encoders and the media scatter on the first."""
    check(two_ranks, "pp")


@pytest.mark.distributed
def test_fsdp_tp_matches_single_process(four_ranks):
    check(four_ranks, "fsdp_tp")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ep", "fsdp_tp_ep"])
def test_spark_expert_parallel_matches_single_process(two_ranks, four_ranks, layout):
    """The latent MoE's experts split over ranks (alone and with tp), its choice bias moving."""
    check(two_ranks + four_ranks, layout, {"muse_spark/debug"})
    (row,) = [r for r in two_ranks + four_ranks if r["layout"] == layout]
    assert row["expert_bias_max"] > 0  # the bias updates ran (they never did for latent MoE)


@pytest.mark.distributed
def test_generation_plan_gives_single_process_logits(two_ranks):
    rows = [r for r in two_ranks if r["layout"] == "generation"]
    assert {r["flavor"] for r in rows} == FLAVORS, rows
    for r in rows:
        print(f"generation {r['flavor']}: max |logit diff| {r['logits_diff']:.1e}")
        assert r["logits_diff"] <= LOSS_TOL * r["logits_scale"], r


@pytest.mark.parametrize("family", ["muse_glimmer", "muse_spark"])
def test_plan_refuses_what_it_cannot_split_in_one_line(family):
    config = resolve_model_config(ModelConfig(name=family, flavor="debug"))
    four_kv_heads = replace(config, num_kv_heads=4)
    cases = [(config, 3, "num_kv_heads=2"), (four_kv_heads, 4, "vision.num_heads (2)")]
    if family == "muse_spark":
        audio = replace(config.audio, hidden_sizes=(6, 32))
        vision = replace(config.vision, num_heads=4)
        odd_audio = replace(four_kv_heads, vision=vision, audio=audio)
        cases.append((odd_audio, 4, "audio.hidden_sizes[0] (6)"))
    for case, tp, expected in cases:
        with torch.device("meta"):
            model = build_model(case)
        with pytest.raises(ConfigError) as error:
            muse_tp_plan(model, tp)
        message = str(error.value)
        assert "\n" not in message and f"--parallel.tp {tp}" in message, message
        assert expected in message, message
    with torch.device("meta"):
        model = build_model(config)
    generation = muse_tp_plan(model, 2, False, sequence_parallel=False)  # no sequence cut
    assert "residual_entry" not in generation and "layers.0.mlp_post_norm" not in generation
    assert "vision_tower.layers.0.attention.q_proj" in generation
