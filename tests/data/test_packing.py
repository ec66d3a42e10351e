"""Window contents on a hand-made stream: inputs, labels, positions and doc ids, exactly."""

from __future__ import annotations

import numpy as np
import torch
from torch.testing import assert_close

from torchloom.data.packing import IGNORE_INDEX, Batch, pack_windows

EOS = 0
X = IGNORE_INDEX
# Documents [5 6], [7 8 9], [10], [11 12 13 14...] each followed by EOS, cut at T=4.
STREAM = np.array([5, 6, EOS, 7, 8, 9, EOS, 10, EOS, 11, 12, 13, 14], dtype=np.uint16)
T = 4
STARTS = np.array([0, 4, 8])  # windows 0, 1, 2


def assert_equal(actual: torch.Tensor, expected: list[list[int]]) -> None:
    # assert_close with zero tolerance prints the mismatching indices and values.
    assert_close(actual, torch.tensor(expected, dtype=torch.int64), rtol=0, atol=0)


def test_document_masked_windows() -> None:
    batch = pack_windows(STREAM, STARTS, T, EOS, document_mask=True)
    assert_equal(batch.tokens, [[5, 6, EOS, 7], [8, 9, EOS, 10], [EOS, 11, 12, 13]])
    # The label after an EOS is the next document's first token: never predicted.
    assert_equal(batch.labels, [[6, EOS, X, 8], [9, EOS, X, EOS], [X, 12, 13, 14]])
    # A document continuing from the previous window is doc 0 and restarts at position 0.
    assert_equal(batch.positions, [[0, 1, 2, 0], [0, 1, 2, 0], [0, 0, 1, 2]])
    assert batch.doc_ids is not None
    assert_equal(batch.doc_ids, [[0, 0, 0, 1], [0, 0, 0, 1], [0, 1, 1, 1]])
    assert batch.num_label_tokens == 9


def test_without_document_mask_is_one_causal_stream() -> None:
    batch = pack_windows(STREAM, STARTS, T, EOS, document_mask=False)
    assert_equal(batch.tokens, [[5, 6, EOS, 7], [8, 9, EOS, 10], [EOS, 11, 12, 13]])
    assert_equal(batch.labels, [[6, EOS, 7, 8], [9, EOS, 10, EOS], [11, 12, 13, 14]])
    assert_equal(batch.positions, [[0, 1, 2, 3]] * 3)
    assert batch.doc_ids is None
    assert batch.num_label_tokens == 12


def test_consecutive_windows_share_one_token() -> None:
    batch = pack_windows(STREAM, STARTS, T, EOS, document_mask=False)
    # Every stream token after the first is a label exactly once.
    assert_equal(batch.labels.reshape(1, -1), [STREAM[1:].tolist()])


def test_batch_to_keeps_values_and_label_count() -> None:
    batch = pack_windows(STREAM, STARTS, T, EOS, document_mask=True)
    moved = batch.to("cpu")
    assert isinstance(moved, Batch)
    for name in ("tokens", "labels", "positions", "doc_ids"):
        assert torch.equal(getattr(moved, name), getattr(batch, name)), name
    assert moved.tokens.dtype == torch.int64
    assert moved.num_label_tokens == batch.num_label_tokens == 9
