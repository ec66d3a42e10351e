"""Every parallel layout reproduces the single-process run (gloo, 2 and 4 processes).

Each torchrun launch costs 5-15 s, so one launch runs several layouts (see worker.py) and the
tests below read its results.
"""

from pathlib import Path

import pytest

from tests.parallel.launcher import run_worker

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("worker.py")
LOSS_TOL, PARAM_TOL = 1e-5, 1e-5
# Gradient norms are fp32 sums of ~10^5-10^6 squares; summing them in another order (per
# shard, then across ranks) moves the result by ~1e-5 relative. A real bug (a gradient
# counted twice, averaged instead of summed, or missing) moves it by far more.
NORM_RTOL = 5e-5


def launch(nproc: int, *names: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"RESULT": [], "MESH": [], "INIT": []}
    # Triton's interpreter for the Triton AdamW layout; no other layout launches a kernel.
    for kind, payload in run_worker(WORKER, nproc, *names, env={"TRITON_INTERPRET": "1"}):
        if kind in out:
            out[kind].append(payload)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, "init", "fsdp", "replicate", "tp", "tp_loss_parallel")


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, "init", "mesh", "hsdp", "fsdp_tp", "replicate_tp", "fsdp_tp_triton_adamw")


def check(results: list[dict], layout: str) -> None:
    rows = [r for r in results if r["layout"] == layout]
    assert {r["family"] for r in rows} == {"llama3", "qwen3"}, rows
    for r in rows:
        check_row(r, layout, r["family"])


def check_row(r: dict, layout: str, what: str) -> None:
    """One layout's result for ``what`` (a family or flavor) against one process, printed and
    held to the tolerances above (the workers of test_vl_layouts and test_muse_layouts too)."""
    worst = f"{r['worst_param']}, " if "worst_param" in r else ""
    print(
        f"{layout:>16} {what:>18}: max |loss diff| {r['loss_diff']:.1e}, "
        f"|grad-norm diff| {r['norm_diff']:.1e}, |param diff| {r['param_diff']:.1e} "
        f"({worst}{r['seconds']:.1f} s)"
    )
    assert not r["missing"], f"parameters differ in name: {r['missing']}"
    assert r["loss_diff"] <= LOSS_TOL, r
    assert r["norm_diff"] <= NORM_RTOL * max(r["norms"]), r
    assert r["param_diff"] <= PARAM_TOL, r


@pytest.mark.multiprocess_core  # the two-rank launch: make test's check of real gloo layouts
@pytest.mark.parametrize("layout", ["fsdp", "replicate", "tp", "tp_loss_parallel"])
def test_two_rank_layouts_match_single_process(two_ranks, layout):
    check(two_ranks["RESULT"], layout)


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp", "replicate_tp", "fsdp_tp_triton_adamw"])
def test_four_rank_layouts_match_single_process(four_ranks, layout):
    check(four_ranks["RESULT"], layout)


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_init_is_bitwise_the_same_on_every_layout(ranks, request):
    """Built on meta, parallelized, materialized, each shard initialized from the seed: the
    gathered weights equal one process's bit for bit (FSDP with uneven shards, TP, PP, 2-D)."""
    reports = request.getfixturevalue(ranks)["INIT"]
    assert reports, "the worker reported no init layout"
    for r in reports:
        print(f"init {r['layout']:>12} {r['family']:>6}: max |diff| {r['max_diff']:.1e}")
        assert not r["missing"], f"{r['layout']}: parameters differ in name: {r['missing']}"
        assert r["equal"], f"{r['layout']} {r['family']}: not bitwise, max |diff| {r['max_diff']}"


# Per layout, for ranks 0..3: the members of this rank's group on each axis / flattened name.
EXPECTED_GROUPS = {
    "hsdp": {  # dp_replicate x dp_shard = 2 x 2
        "dp_replicate": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp_shard": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "dp": [[0, 1, 2, 3]] * 4,
        "dp_cp": [[0, 1, 2, 3]] * 4,
        "tp": [None] * 4,
        "fsdp": [[[0, 1], [2, 3]]] * 4,
        "dp_rank": [0, 1, 2, 3],
    },
    "fsdp_tp": {  # dp_shard x tp = 2 x 2, tp innermost
        "tp": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "dp_shard": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp_cp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "fsdp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp_rank": [0, 0, 1, 1],
    },
    "replicate_cp": {  # dp_replicate x cp = 2 x 2: FSDP shards over cp, replicates across
        "dp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp_shard_cp": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "dp_cp": [[0, 1, 2, 3]] * 4,
        "fsdp": [[[0, 1], [2, 3]]] * 4,
        "dp_rank": [0, 0, 1, 1],
    },
    "pp_tp": {  # no data parallelism: no dp groups at all
        "pp": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "tp": [[0, 1], [0, 1], [2, 3], [2, 3]],
        "dp": [None] * 4,
        "fsdp": [None] * 4,
        "dp_size": [1] * 4,
    },
    "replicate_tp": {  # replication = HSDP over a one-rank shard group
        "dp_replicate": [[0, 2], [1, 3], [0, 2], [1, 3]],
        "dp_shard": [None] * 4,
        "fsdp": [[[0], [2]], [[1], [3]], [[0], [2]], [[1], [3]]],
        "dp_rank": [0, 0, 1, 1],
    },
}


@pytest.mark.parametrize("layout", sorted(EXPECTED_GROUPS))
def test_mesh_groups(four_ranks, layout):
    (report,) = [m for m in four_ranks["MESH"] if m["layout"] == layout]
    for name, expected in EXPECTED_GROUPS[layout].items():
        got = [rank[name] for rank in report["ranks"]]
        assert got == expected, f"{layout} {name}: got {got}, expected {expected}"
