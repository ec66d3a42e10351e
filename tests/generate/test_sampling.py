"""Top-p sampling's support, at exact boundaries and ties: which tokens can be drawn at all.

The rule (``sample``'s docstring): a token is kept if the tokens strictly more likely than it
hold less than top_p together; tied tokens are therefore kept or dropped together.
"""

import pytest
import torch

from torchloom.generate.engine import SamplingParams, sample

DRAWS = 400  # with every kept probability >= 0.2, missing one has odds below 1e-38


def _support(probs: list[float], top_p: float) -> set[int]:
    """The tokens drawn over DRAWS fixed seeds."""
    logprobs_V = torch.tensor(probs).log()
    params = SamplingParams(top_p=top_p)
    return {
        sample(logprobs_V, params, torch.Generator().manual_seed(seed)) for seed in range(DRAWS)
    }


def _rule(probs: list[float], top_p: float) -> set[int]:
    """The documented rule, written out (for probabilities exact in float32 and far enough
    from top_p that sums rounding cannot decide)."""
    return {i for i, p in enumerate(probs) if sum(q for q in probs if q > p) < top_p}


@pytest.mark.parametrize(
    ("probs", "top_p", "kept"),
    [
        ([0.4, 0.3, 0.3], 0.7, {0, 1, 2}),  # the tie holds 0.4 before it: both kept
        ([0.4, 0.3, 0.3], 0.5, {0, 1, 2}),  # a tie straddling top_p: kept together
        ([0.3, 0.4, 0.3], 0.5, {0, 1, 2}),  # the same, tied tokens on either side
        ([0.4, 0.3, 0.3], 0.35, {0}),  # only the most likely
        ([0.1, 0.3, 0.3, 0.3], 0.2, {1, 2, 3}),  # a three-way tie first
        ([0.2, 0.3, 0.3, 0.2], 0.65, {0, 1, 2, 3}),  # two ties
        ([0.2, 0.3, 0.3, 0.2], 0.55, {1, 2}),
    ],
)
def test_top_p_keeps_ties_together(probs, top_p, kept):
    assert _rule(probs, top_p) == kept  # the case says what the rule says
    support = _support(probs, top_p)
    print(f"probs {probs}, top_p {top_p}: drew {sorted(support)}, the rule keeps {sorted(kept)}")
    assert support == kept


def test_top_p_at_an_exact_boundary():
    """Probabilities exact in float32 (softmax of log 1/2 and log 1/4 gives 1/2 and 1/4): the
    more likely tokens hold exactly top_p, which is not less than top_p: those are dropped."""
    probs = [0.25, 0.5, 0.25]
    exact = torch.softmax(torch.tensor(probs).log(), dim=-1)
    assert exact.tolist() == probs, f"softmax gave {exact.tolist()}: not an exact boundary"
    for top_p, kept in [(0.5, {1}), (0.75, {0, 1, 2}), (0.25, {1})]:
        support = _support(probs, top_p)
        print(f"probs {probs}, top_p {top_p}: drew {sorted(support)}, the rule keeps {kept}")
        assert support == kept == _rule(probs, top_p)
    uniform = [0.25] * 4  # all tied: nothing is more likely than any token
    for top_p in (0.25, 0.5):
        support = _support(uniform, top_p)
        print(f"probs {uniform}, top_p {top_p}: drew {sorted(support)}")
        assert support == {0, 1, 2, 3}


def test_top_p_one_and_top_k_ties():
    probs = [0.4, 0.3, 0.2, 0.1]
    assert _support(probs, 1.0) == {0, 1, 2, 3}
    logprobs_V = torch.tensor([0.4, 0.3, 0.3]).log()
    params = SamplingParams(top_k=2)  # the 2nd most likely ties with the 3rd: both stay
    drawn = {sample(logprobs_V, params, torch.Generator().manual_seed(s)) for s in range(DRAWS)}
    assert drawn == {0, 1, 2}, drawn
