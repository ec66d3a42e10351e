"""Context parallelism: sequence sharding, and cp layouts against one process (gloo)."""

from pathlib import Path

import pytest
import torch

from tests.parallel.launcher import run_worker
from tests.parallel.test_layouts import LOSS_TOL, NORM_RTOL, PARAM_TOL, check
from torchloom.config.errors import ConfigError
from torchloom.data.packing import Batch
from torchloom.parallel.context_parallel import (
    global_token_index,
    shard_sequence,
    unshard_sequence,
)

WORKER = Path(__file__).with_name("cp_worker.py")
LOGITS_TOL = 1e-5


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_then_unshard_is_exact(cp):
    T = 4 * cp * 2
    tokens = torch.arange(2 * T).view(2, T)
    doc_ids = (torch.arange(T) >= T // 3).long().expand(2, T)
    mask = torch.rand(2, T, 3) > 0.5  # a per-token extra with a trailing dim
    batch = Batch(
        tokens, tokens + 1000, tokens % 7, doc_ids, {"mask": mask}, {"reward": tokens[:, 0]}
    )
    shards = [batch.map_tokens(lambda t, r=r: shard_sequence(t, r, cp)) for r in range(cp)]
    for name in ("tokens", "labels", "positions", "doc_ids"):
        full = unshard_sequence([getattr(s, name) for s in shards])
        assert torch.equal(full, getattr(batch, name)), name
    assert torch.equal(unshard_sequence([s.extras["mask"] for s in shards]), mask)
    assert all(torch.equal(s.row_extras["reward"], tokens[:, 0]) for s in shards)
    # Load balance: every rank holds chunks r and 2cp-1-r, so the causal work (sum of query
    # indices + 1) is the same on every rank.
    work = {int((global_token_index(r, cp, T // cp) + 1).sum()) for r in range(cp)}
    assert len(work) == 1, work


def test_shard_keeps_global_values():
    batch = Batch(*(torch.arange(8).view(1, 8) for _ in range(3)), None)
    local = batch.map_tokens(
        lambda t: shard_sequence(t, 1, 2)
    )  # chunks 1 and 2 of [0,1 | 2,3 | 4,5 | 6,7]
    assert local.tokens.tolist() == [[2, 3, 4, 5]]
    assert local.positions.tolist() == [[2, 3, 4, 5]] and local.doc_ids is None


def test_indivisible_sequence_names_the_numbers():
    batch = Batch(*(torch.zeros(1, 10, dtype=torch.long) for _ in range(3)), None)
    with pytest.raises(ConfigError, match="seq_len 10 .* 2 x --parallel.cp = 4"):
        shard_sequence(batch.tokens, 0, 2)


def launch(nproc: int, *names: str) -> list[dict]:
    """Run cp_worker.py on ``nproc`` processes; its RESULT lines."""
    return [result for kind, result in run_worker(WORKER, nproc, *names) if kind == "RESULT"]


def check_cp(results: list[dict], layout: str) -> None:
    for r in (r for r in results if r["layout"] == layout):
        print(f"{layout:>16} {r['family']:>6}: max |logit diff| {r['logits_diff']:.1e}")
        assert r["logits_diff"] <= LOGITS_TOL, r
    check(results, layout)


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, "cp", "cp_masks")


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, "cp_fsdp", "cp_tp", "cp_replicate")


@pytest.mark.distributed
def test_cp_matches_single_process(two_ranks):
    check_cp(two_ranks, "cp")


@pytest.mark.distributed
def test_cp_honours_window_and_chunk_masks(two_ranks):
    """A sliding-window layer and a chunked one under cp 2: the gathered keys are masked on
    global indices, so logits, losses, gradient norms and updated weights match one process."""
    (r,) = [r for r in two_ranks if r["layout"] == "cp_masks"]
    print(
        f"cp_masks {r['family']}: max |logit diff| {r['logits_diff']:.1e}, |loss diff| "
        f"{r['loss_diff']:.1e}, |param diff| {r['param_diff']:.1e}"
    )
    assert not r["missing"], r["missing"]
    assert r["logits_diff"] <= LOGITS_TOL and r["loss_diff"] <= LOSS_TOL, r
    assert r["norm_diff"] <= NORM_RTOL * max(r["norms"]) and r["param_diff"] <= PARAM_TOL, r


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["cp_fsdp", "cp_tp", "cp_replicate"])
def test_four_rank_cp_layouts_match_single_process(four_ranks, layout):
    check_cp(four_ranks, layout)
