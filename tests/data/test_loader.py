"""TrainLoader/ValLoader over token windows: layout-independent steps, exact resume, epochs,
errors. (tests/data/test_sft.py checks the same over packed conversations.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from torchloom.config.errors import ConfigError
from torchloom.data.loader import TrainLoader, ValLoader
from torchloom.data.packing import IGNORE_INDEX, Batch, TokenWindows

EOS = 1
T = 8


def random_stream(num_tokens: int = 50 * T + 3, seed: int = 0) -> np.ndarray:
    """Tokens in [1, 20) with EOS=1 about one in ten: documents of varied length."""
    return np.random.default_rng(seed).integers(1, 20, size=num_tokens).astype(np.uint16)


def index_stream(num_windows: int) -> np.ndarray:
    """tokens[i] = i, so a window's first input token // T is its window index."""
    return np.arange(num_windows * T + 1, dtype=np.int64)


def window_indices(batches: list[Batch]) -> list[int]:
    return [int(t) // T for b in batches for t in b.tokens[:, 0]]


def make_loader(tokens: np.ndarray, **overrides: object) -> TrainLoader:
    kwargs: dict = dict(global_batch_size=8, micro_batch_size=2, seed=7)
    kwargs.update(overrides)
    return TrainLoader(TokenWindows(tokens, EOS, T, document_mask=True), **kwargs)


def global_step(tokens: np.ndarray, dp_size: int, micro_batch_size: int, steps: int) -> list:
    """Per step, all ranks' micro-batches concatenated in rank order: (tokens, labels, ...)."""
    loaders = [
        make_loader(tokens, dp_rank=r, dp_size=dp_size, micro_batch_size=micro_batch_size)
        for r in range(dp_size)
    ]
    result = []
    for _ in range(steps):
        batches = [b for loader in loaders for b in loader.next_step()]
        assert len(batches) == dp_size * loaders[0].grad_accum_steps
        result.append(
            tuple(
                torch.cat([getattr(b, n) for b in batches])
                for n in ("tokens", "labels", "positions", "doc_ids")
            )
        )
    return result


@pytest.mark.parametrize(("dp_size", "micro_batch_size"), [(1, 1), (2, 2), (2, 4), (4, 1), (4, 2)])
def test_union_of_ranks_is_independent_of_layout(dp_size: int, micro_batch_size: int) -> None:
    tokens = random_stream()
    reference = global_step(tokens, dp_size=1, micro_batch_size=8, steps=8)  # 8 steps > 1 epoch
    layout = global_step(tokens, dp_size=dp_size, micro_batch_size=micro_batch_size, steps=8)
    for step, (expected, actual) in enumerate(zip(reference, layout)):
        for name, e, a in zip(("tokens", "labels", "positions", "doc_ids"), expected, actual):
            assert_close(a, e, rtol=0, atol=0, msg=lambda m, s=step, n=name: f"step {s} {n}: {m}")


def test_resume_continues_with_identical_batches() -> None:
    tokens = random_stream()
    first = make_loader(tokens, dp_rank=1, dp_size=2)
    for _ in range(5):
        first.next_step()
    state = first.state_dict()
    assert state["step"] == 5
    resumed = make_loader(tokens, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for _ in range(10):  # crosses an epoch boundary
        for a, b in zip(resumed.next_step(), first.next_step()):
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
            assert torch.equal(a.positions, b.positions) and torch.equal(a.doc_ids, b.doc_ids)


def test_resume_may_change_micro_batch_and_dp_size() -> None:
    tokens = random_stream()
    saved = make_loader(tokens, micro_batch_size=8)
    saved.next_step()
    resumed = make_loader(tokens, micro_batch_size=1, dp_size=2)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.step == 1


def test_resume_refuses_changed_seed_naming_it() -> None:
    tokens = random_stream()
    state = make_loader(tokens, seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed was 1 in the checkpoint and is 2 now"):
        make_loader(tokens, seed=2).load_state_dict(state)


def test_resume_refuses_another_tokenizer_and_reads_states_from_before_the_check() -> None:
    tokens = random_stream()
    state = make_loader(tokens, tokenizer="aaaa").state_dict()
    with pytest.raises(ConfigError, match="trained with another tokenizer .*aaaa.*bbbb"):
        make_loader(tokens, tokenizer="bbbb").load_state_dict(state)
    del state["tokenizer"]  # a checkpoint written before the loader recorded its tokenizer
    resumed = make_loader(tokens, tokenizer="bbbb")
    resumed.load_state_dict(state)
    assert resumed.step == 0


def test_every_window_once_per_epoch_and_epochs_reshuffle() -> None:
    loader = make_loader(index_stream(num_windows=12), global_batch_size=4, micro_batch_size=4)
    seen = window_indices([b for _ in range(6) for b in loader.next_step()])  # 24 = 2 epochs
    epoch0, epoch1 = seen[:12], seen[12:]
    assert sorted(epoch0) == list(range(12)), epoch0
    assert sorted(epoch1) == list(range(12)), epoch1
    assert epoch0 != epoch1, "each epoch should use a new permutation"
    assert loader.epoch == 2.0 and loader.tokens_seen == 24 * T


def test_step_spanning_an_epoch_boundary() -> None:
    # 10 windows, 4 per step: step 2 takes the last 2 of epoch 0 and the first 2 of epoch 1.
    loader = make_loader(index_stream(num_windows=10), global_batch_size=4, micro_batch_size=2)
    seen = window_indices([b for _ in range(5) for b in loader.next_step()])
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10)), seen


def test_no_shuffle_visits_windows_in_order() -> None:
    loader = make_loader(index_stream(num_windows=6), global_batch_size=4, shuffle=False)
    seen = window_indices([b for _ in range(3) for b in loader.next_step()])
    assert seen == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5], seen


def test_indivisible_global_batch_explains_the_fix() -> None:
    message = (
        "global_batch_size=12 is not a multiple of micro_batch_size × dp_size = 5 × 2 = 10: "
        "each optimizer step must split into equal micro-batches on every data-parallel rank. "
        "Use global_batch_size=10 or 20, or a micro_batch_size dividing 6 (e.g. 3)."
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_loader(random_stream(), global_batch_size=12, micro_batch_size=5, dp_size=2)


def test_too_few_tokens_for_one_window() -> None:
    with pytest.raises(ConfigError, match="one sequence of seq_len=8 needs 9"):
        make_loader(np.ones(T, dtype=np.uint16))


def val_pass(tokens: np.ndarray, batch_size: int, dp_size: int) -> list[list[Batch]]:
    rows = TokenWindows(tokens, EOS, T, document_mask=True)
    loaders = [ValLoader(rows, batch_size, r, dp_size) for r in range(dp_size)]
    return [list(loader) for loader in loaders]


def test_val_is_deterministic_and_unshuffled() -> None:
    tokens = index_stream(num_windows=5)
    loader = ValLoader(TokenWindows(tokens, EOS, T, document_mask=True), batch_size=2)
    first, second = list(loader), list(loader)
    assert window_indices(first) == [0, 1, 2, 3, 4, 0]  # last row is padding
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, second))
    assert (first[-1].labels[1] == IGNORE_INDEX).all(), "padding rows must not count"
    assert len(list(loader.batches(max_batches=1))) == 1


@pytest.mark.parametrize(("batch_size", "dp_size"), [(1, 2), (3, 2), (2, 4)])
def test_val_label_tokens_same_for_any_layout(batch_size: int, dp_size: int) -> None:
    tokens = random_stream(num_tokens=7 * T + 1)  # 7 windows: ranks need padding rows
    reference = val_pass(tokens, batch_size=7, dp_size=1)[0]
    per_rank = val_pass(tokens, batch_size=batch_size, dp_size=dp_size)
    assert len({len(batches) for batches in per_rank}) == 1, "all ranks run the same count"

    def real_labels(batches: list[Batch]) -> list[list[int]]:
        rows = torch.cat([b.labels for b in batches])
        return sorted(r.tolist() for r in rows if (r != IGNORE_INDEX).any())

    assert real_labels([b for bs in per_rank for b in bs]) == real_labels(reference)


class WindowsWithExtras(TokenWindows):
    """Token windows whose rows also carry a per-token weight and a per-row reward, both
    functions of the row, as an RL or multimodal source's would be."""

    def batch(self, rows_B: np.ndarray) -> Batch:
        batch = super().batch(rows_B)
        rows = torch.as_tensor(rows_B, dtype=torch.float32)
        batch.extras["weight"] = rows[:, None] + torch.arange(T) / T
        batch.row_extras["reward"] = -rows
        return batch


def test_extras_travel_through_the_loader_resume_and_sharding() -> None:
    tokens = random_stream()
    make = lambda: TrainLoader(WindowsWithExtras(tokens, EOS, T, document_mask=True),  # noqa: E731
                               global_batch_size=8, micro_batch_size=2, seed=7)  # fmt: skip
    loader = make()
    loader.next_step()
    state = loader.state_dict()
    expected = loader.next_step()
    resumed = make()
    resumed.load_state_dict(state)
    for want, got in zip(expected, resumed.next_step()):
        row = want.row_extras["reward"][:, None]
        assert torch.equal(want.extras["weight"].floor(), -row.expand(-1, T))  # the rows' own
        for name, value in want.named_tensors().items():
            assert torch.equal(value, got.named_tensors()[name]), name
    batch = expected[0]
    assert set(batch.fields(["labels", "weight", "reward"])) == {"labels", "weight", "reward"}
    with pytest.raises(KeyError, match="no field advantages"):
        batch.fields(["advantages"])
    half = batch.map_tokens(lambda t: t[:, : T // 2])  # as context parallelism cuts tokens
    assert half.extras["weight"].shape == (2, T // 2) and torch.equal(
        half.row_extras["reward"], batch.row_extras["reward"]
    )
