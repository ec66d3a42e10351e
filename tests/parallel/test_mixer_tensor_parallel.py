"""Token mixers split by heads under tensor parallelism (2 gloo ranks): training steps of
all-dense deepseek_v3 models (multi-head latent attention) and of the hybrid linear-attention
families (Gated DeltaNet, KDA) equal one process, parameters after each step included, and
layout-invariant init covers their parameters under tp (and deepseek_v3's under FSDP)
(tests/parallel/mixer_tp_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.launcher import run_worker

pytestmark = pytest.mark.distributed  # torchrun launches (slow: make test-slow)

WORKER = Path(__file__).with_name("mixer_tp_worker.py")
# As tests/parallel/test_layouts.py: fp32 sums in another order, nothing more. Parameters: a
# few times Adam's amplification of rounding (its first step divides by |grad| + 1e-6, and an
# embedding row of kimi_linear's debug model gets a gradient near that: it moved up to 1.2e-5).
# A split gone wrong moves weights by a good part of lr (1e-3).
LOSS_TOL, PARAM_TOL, NORM_RTOL = 1e-5, 3e-5, 5e-5


@pytest.fixture(scope="module")
def reports() -> list[tuple[str, dict]]:
    return run_worker(WORKER, 2, "init", "tp_loss_parallel")


def test_tensor_parallel_steps_match_one_process(reports) -> None:
    results = [r for kind, r in reports if kind == "RESULT"]
    assert len(results) == 5
    for r in results:
        print(f"{r['layout']:>16} {r['family']}: |loss diff| {r['loss_diff']:.1e}, |grad-norm "
              f"diff| {r['norm_diff']:.1e}, |param diff| {r['param_diff']:.1e}")  # fmt: skip
        assert not r["missing"], r
        assert r["loss_diff"] <= LOSS_TOL, r
        assert r["norm_diff"] <= NORM_RTOL * max(r["norms"]), r
        assert r["param_diff"] <= PARAM_TOL, (r["param_diff"], r["worst_param"])


def test_init_is_the_same_on_tp_and_fsdp_ranks(reports) -> None:
    """Split over tp ranks (all-dense MLA models, the hybrid families) and sharded by FSDP
    (deepseek_v3's debug flavor: MoE layers and the MTP depth), the weights of seed 0 are one
    process's, bitwise."""
    inits = [r for kind, r in reports if kind == "INIT"]
    assert len(inits) == 6 and all(r["equal"] and not r["missing"] for r in inits), inits
