"""Mixture-of-experts layers under parallel layouts reproduce the single-process run (gloo,
2 and 4 processes): expert parallelism borrowed from FSDP's or context parallelism's ranks,
with tensor parallelism, replication and pipeline stages; the all-to-all dispatcher against
the local one.

Two torchrun launches (see moe_worker.py), each running several layouts.
"""

from pathlib import Path

import pytest

from tests.parallel.launcher import run_worker
from tests.parallel.test_layouts import LOSS_TOL, NORM_RTOL, PARAM_TOL

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("moe_worker.py")
TWO = ("fsdp_ep", "cp_ep", "tp", "pp")
FOUR = ("fsdp_tp_ep", "hsdp_ep", "fsdp4_ep2", "pp_fsdp_ep")


def launch(nproc: int, *names: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"RESULT": [], "DISPATCH": []}
    for kind, payload in run_worker(WORKER, nproc, *names):
        out.setdefault(kind, []).append(payload)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, "dispatch", *TWO)


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, "dispatch", *FOUR)


def check(results: list[dict], layout: str) -> None:
    rows = [r for r in results if r["layout"] == layout]
    assert {r["family"] for r in rows} == {"batch", "sequence"}, rows
    for r in rows:
        print(
            f"{layout:>11} {r['family']:>8}: max |loss diff| {r['loss_diff']:.1e}, |grad-norm "
            f"diff| {r['norm_diff']:.1e}, |load diff| {r['load_diff']:.0f}, |param diff| "
            f"{r['param_diff']:.1e}, expert bias equal {r['bias_equal']} ({r['seconds']:.1f} s)"
        )
        assert not r["missing"], f"parameters differ in name: {r['missing']}"
        assert r["loss_diff"] <= LOSS_TOL * max(r["losses"]), r
        assert r["norm_diff"] <= NORM_RTOL * max(r["norms"]), r
        assert r["param_diff"] <= PARAM_TOL, r
        assert r["load_diff"] == 0 and r["bias_equal"], r  # every token counted once
        # (one expert per rank and top-1: every load is equal and the bias has no reason to move)
        assert r["bias_moved"] or layout == "fsdp4_ep2", r


@pytest.mark.parametrize("layout", TWO)
def test_two_rank_layouts_match_single_process(two_ranks, layout):
    check(two_ranks["RESULT"], layout)


@pytest.mark.parametrize("layout", FOUR)
def test_four_rank_layouts_match_single_process(four_ranks, layout):
    check(four_ranks["RESULT"], layout)


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_all_to_all_dispatch_matches_local_dispatch(ranks, request):
    """Outputs and gradients of one MoE layer whose experts are split over the ranks (tokens
    sent by all-to-all, a different number from each rank) equal the whole layer's."""
    (report,) = request.getfixturevalue(ranks)["DISPATCH"]
    print(f"{ranks}: " + ", ".join(f"{k} {v:.1e}" for k, v in report.items()))
    assert report["output"] <= 1e-6 and report["input_grad"] <= 1e-6, report
    assert report["expert_grad"] <= 1e-6 and report["router_grad"] <= 1e-5, report
