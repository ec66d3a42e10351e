"""AttentionMask: the dense form against a brute-force loop over (query, key) for every field
and combinations, compressed groups, top-k picks, and the FlexAttention mask_mod."""

from __future__ import annotations

import itertools

import pytest
import torch

from torchloom.kernels.attention_mask import CAUSAL, AttentionMask

T = 13
DOC_IDS_BT = torch.tensor([[0] * 5 + [1] * 8, [0] * 13])
CPU = torch.device("cpu")


def brute_force(mask: AttentionMask, t: int, s: int, docs: list[int] | None) -> bool:
    """Whether query t sees key s, written out rule by rule from the docstring."""
    pos = s if mask.compress is None else (s + 1) * mask.compress - 1
    if mask.causal and pos > t:
        return False
    if mask.window is not None and t - pos >= mask.window:
        return False
    if mask.chunk is not None and t // mask.chunk != pos // mask.chunk:
        return False
    return not (mask.document and docs is not None and docs[t] != docs[s])


MASKS = [
    CAUSAL,
    AttentionMask(document=False),
    AttentionMask(causal=False),
    AttentionMask(window=4),
    AttentionMask(chunk=5),
    AttentionMask(window=3, chunk=6),
    AttentionMask(causal=False, chunk=4),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
@pytest.mark.parametrize("with_docs", [False, True])
def test_dense_equals_a_brute_force_loop(mask: AttentionMask, with_docs: bool) -> None:
    docs = DOC_IDS_BT if with_docs else None
    dense = mask.dense(T, CPU, docs)
    assert dense.shape == ((2 if with_docs and mask.document else 1), 1, T, T)
    for b in range(dense.shape[0]):
        row = None if docs is None else docs[b].tolist()
        expected = torch.tensor(
            [[brute_force(mask, t, s, row) for s in range(T)] for t in range(T)]
        )
        wrong = (dense[b, 0] != expected).nonzero().tolist()
        assert not wrong, f"{mask.describe()} row {b}: (query, key) pairs that differ: {wrong}"


@pytest.mark.parametrize("compress", [2, 4])
@pytest.mark.parametrize("window", [None, 8])
def test_compressed_keys_are_visible_once_their_group_is_complete(compress, window) -> None:
    """Key j pools tokens j*compress .. (j+1)*compress - 1: a query sees it from the group's
    last token on (and, with a window, while that token is within it)."""
    mask = AttentionMask(compress=compress, window=window)
    S = T // compress
    dense = mask.dense(T, CPU, S=S)[0, 0]
    for t, j in itertools.product(range(T), range(S)):
        last = (j + 1) * compress - 1
        expected = last <= t and (window is None or t - last < window)
        assert dense[t, j].item() == expected, (t, j)
        assert dense[t, j].item() == brute_force(mask, t, j, None)
    with pytest.raises(ValueError, match="compressed keys"):
        mask.dense(T, CPU, DOC_IDS_BT, S=S)


def test_topk_picks_are_the_only_keys_seen() -> None:
    mask = AttentionMask(topk=3)
    generator = torch.Generator().manual_seed(0)
    picks_BTk = torch.randint(0, T, (2, T, 3), generator=generator)
    picks_BTk[:, :, 2] = -1  # no third pick
    dense = mask.dense(T, CPU, DOC_IDS_BT, picks_BTk=picks_BTk)
    for b, t, s in itertools.product(range(2), range(T), range(T)):
        picked = s in picks_BTk[b, t, :2].tolist()
        expected = picked and brute_force(mask, t, s, DOC_IDS_BT[b].tolist())
        assert dense[b, 0, t, s].item() == expected, (b, t, s)
    with pytest.raises(ValueError, match="without topk"):
        CAUSAL.dense(T, CPU, picks_BTk=picks_BTk)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
@pytest.mark.parametrize("with_docs", [False, True])
def test_mask_mod_equals_dense(mask: AttentionMask, with_docs: bool) -> None:
    """The FlexAttention mask_mod, evaluated on every (b, q, kv), is the dense mask."""
    docs = DOC_IDS_BT if with_docs else None
    mod = mask.mask_mod(docs)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(T), torch.arange(T), indexing="ij")
    got = mod(b, torch.zeros_like(b), q, kv)
    expected = mask.dense(T, CPU, docs)[:, 0].expand(2, T, T)
    assert torch.equal(got, expected), (got != expected).nonzero().tolist()
    for keys in (AttentionMask(compress=4), AttentionMask(topk=2)):
        with pytest.raises(ValueError, match="keys are not tokens"):
            keys.mask_mod()


def test_plain_describe_and_refusals() -> None:
    assert CAUSAL.plain and AttentionMask(document=False).plain
    for mask in (AttentionMask(causal=False), AttentionMask(window=2), AttentionMask(sink=True)):
        assert not mask.plain
    assert AttentionMask(window=8, sink=True).describe() == "causal + document + window 8 + sink"
    CAUSAL.require_plain("kernel", "no fix needed")
    with pytest.raises(ValueError, match=r"kernel .*\(causal \+ document \+ chunk 4\); use x"):
        AttentionMask(chunk=4).require_plain("kernel", "use x")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            AttentionMask(window=bad)
