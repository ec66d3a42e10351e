"""Multi-head latent attention under tensor parallelism (2 gloo ranks): training steps of
all-dense deepseek_v3 models equal one process, and layout-invariant init covers the family's
parameters under tp and FSDP (tests/parallel/mla_tp_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import run_worker  # tests/parallel is on sys.path (rootdir-relative imports)

WORKER = Path(__file__).with_name("mla_tp_worker.py")
# As tests/parallel/test_layouts.py: fp32 sums in another order, nothing more.
LOSS_TOL, PARAM_TOL, NORM_RTOL = 1e-5, 1e-5, 5e-5


@pytest.fixture(scope="module")
def reports() -> list[tuple[str, dict]]:
    return run_worker(WORKER, 2, "init", "tp_loss_parallel")


def test_tensor_parallel_steps_match_one_process(reports) -> None:
    results = [r for kind, r in reports if kind == "RESULT"]
    assert len(results) == 2
    for r in results:
        print(f"{r['layout']:>16} {r['family']}: |loss diff| {r['loss_diff']:.1e}, |grad-norm "
              f"diff| {r['norm_diff']:.1e}, |param diff| {r['param_diff']:.1e}")  # fmt: skip
        assert not r["missing"], r
        assert r["loss_diff"] <= LOSS_TOL, r
        assert r["norm_diff"] <= NORM_RTOL * max(r["norms"]), r
        assert r["param_diff"] <= PARAM_TOL, r


def test_init_is_the_same_on_tp_and_fsdp_ranks(reports) -> None:
    """Split over tp ranks (all-dense models) and sharded by FSDP (the debug flavor: MoE
    layers and the MTP depth), the weights of seed 0 are one process's, bitwise."""
    inits = [r for kind, r in reports if kind == "INIT"]
    assert len(inits) == 3 and all(r["equal"] and not r["missing"] for r in inits), inits
