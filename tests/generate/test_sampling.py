"""Sampling (torchloom/generate/sampling.py): draws follow the distribution, a row's draw does
not depend on its batch, and top-p's support at exact boundaries and ties is the documented
rule (``kept_tokens``: a token is kept if the tokens strictly more likely than it hold less than
top_p together; tied tokens are therefore kept or dropped together).
"""

import pytest
import torch

from torchloom.generate.engine import SamplingParams
from torchloom.generate.sampling import NOISE_BITS, sample_rows, uniform_noise, unit_interval


def sample(logprobs_V: torch.Tensor, params: SamplingParams, seed: int, draw: int = 0) -> int:
    """One row's draw number ``draw`` from stream ``seed``."""
    settings = (params.temperature, params.top_k, params.top_p, seed, draw)
    return int(sample_rows(logprobs_V[None], *(torch.tensor([x]) for x in settings))[0][0])


DRAWS = 400  # with every kept probability >= 0.2, missing one has odds below 1e-38


def _support(probs: list[float], top_p: float) -> set[int]:
    """The tokens drawn over DRAWS fixed seeds."""
    logprobs_V = torch.tensor(probs).log()
    params = SamplingParams(top_p=top_p)
    return {sample(logprobs_V, params, seed) for seed in range(DRAWS)}


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
    drawn = {sample(logprobs_V, params, s) for s in range(DRAWS)}
    assert drawn == {0, 1, 2}, drawn


def test_draws_follow_the_distribution():
    """20,000 draws (one stream, counters 0..N-1, and N streams at counter 0) of a 4-token
    distribution at temperature 1 and 0.5: each frequency within 0.015 of its probability."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    N = 20_000
    for temperature in (1.0, 0.5):
        want = torch.softmax(probs.log() / temperature, dim=-1)
        ones = torch.ones(N)
        for seeds, counters in ((torch.full((N,), 7), torch.arange(N)),
                                (torch.arange(N), torch.zeros(N, dtype=torch.long))):  # fmt: skip
            tokens, _ = sample_rows(probs.log().expand(N, -1), ones * temperature,
                                    torch.zeros(N, dtype=torch.long), ones, seeds, counters)  # fmt: skip
            freq = torch.bincount(tokens, minlength=4) / N
            print(f"T {temperature}: frequencies {freq.tolist()}, probabilities {want.tolist()}")
            assert (freq - want).abs().max() < 0.015


def test_a_rows_draw_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    logprobs_BV = torch.randn(6, 50).log_softmax(-1)
    temperature, top_k = (
        torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.9]),
        torch.tensor([0, 5, 0, 3, 0, 0]),
    )
    top_p, seeds = torch.tensor([1.0, 1.0, 0.8, 1.0, 0.5, 0.95]), torch.arange(100, 106)
    counters = torch.tensor([0, 3, 9, 1, 0, 27])
    together, together_lp = sample_rows(logprobs_BV, temperature, top_k, top_p, seeds, counters)
    for b in range(6):
        alone, alone_lp = sample_rows(logprobs_BV[b : b + 1], temperature[b : b + 1],
                                      top_k[b : b + 1], top_p[b : b + 1], seeds[b : b + 1],
                                      counters[b : b + 1])  # fmt: skip
        assert alone.item() == together[b].item()
        assert alone_lp.item() == together_lp[b].item()  # bitwise: the trainer scores row by row


def test_the_reported_log_prob_is_the_sampling_distributions():
    """A drawn token's log-probability is that of the distribution it came from: temperature-
    scaled, top-p-restricted and renormalised; at temperature 1 without top-k/p, the model's."""
    torch.manual_seed(1)
    logprobs_BV = torch.randn(3, 20).log_softmax(-1)
    temperature, top_k, top_p = (
        torch.tensor([1.0, 0.7, 0.7]),
        torch.zeros(3, dtype=torch.long),
        torch.tensor([1.0, 1.0, 0.6]),
    )
    tokens, picked = sample_rows(
        logprobs_BV, temperature, top_k, top_p, torch.arange(3), torch.zeros(3, dtype=torch.long)
    )
    assert picked[0].item() == logprobs_BV[0, tokens[0]].item()
    scaled = (logprobs_BV[1] / 0.7).log_softmax(-1)
    assert abs(picked[1].item() - scaled[tokens[1]].item()) < 1e-6
    probs = (logprobs_BV[2] / 0.7).softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = order[before < 0.6]
    want = probs[nucleus] / probs[nucleus].sum()
    got = {int(t): p for t, p in zip(nucleus, want.log())}
    print(f"picked {picked.tolist()}, nucleus {sorted(got)}")
    assert int(tokens[2]) in got and abs(picked[2].item() - got[int(tokens[2])].item()) < 1e-6


def test_noise_never_reaches_zero_or_one():
    """The extreme bit patterns map strictly inside (0, 1), so every Gumbel noise is finite: a
    noise of exactly 1.0 (24 bits rounded up to it in fp32) gave a +inf Gumbel, and its token
    won the draw whatever its probability, even one top-k had removed (then reported with a
    log-probability of -inf). And over 2^23 draws, as many as there are bit patterns."""
    extremes = unit_interval(torch.tensor([0, 1, 2**NOISE_BITS - 2, 2**NOISE_BITS - 1]))
    assert bool((extremes > 0).all() and (extremes < 1).all()), extremes.tolist()
    assert len(set(extremes.tolist())) == 4
    assert bool(torch.isfinite(-torch.log(-torch.log(extremes))).all())
    seeds = torch.arange(64)
    noise = uniform_noise(seeds, torch.zeros_like(seeds), 2**17)
    assert noise.min() > 0 and noise.max() < 1
    # A draw under top-k 1 is the argmax, log-probability 0, at every one of those streams.
    logprobs_BV = torch.randn(64, 2**17, generator=torch.Generator().manual_seed(0))
    logprobs_BV = logprobs_BV.log_softmax(-1)
    ones = torch.ones(64)
    tokens, picked = sample_rows(logprobs_BV, ones, ones.long(), ones, seeds, seeds * 0)
    assert torch.equal(tokens, logprobs_BV.argmax(-1)) and bool((picked == 0).all())


def test_noise_streams_are_uniform_and_distinct():
    noise = uniform_noise(torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1]), 4096)
    assert noise.min() > 0 and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.01
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    again = uniform_noise(torch.tensor([0]), torch.tensor([0]), 4096)
    assert torch.equal(again[0], noise[0])  # a pure function of (seed, counter, token)


def test_a_nan_row_draws_a_nan_log_prob_and_leaves_the_others_alone():
    """nan logits under top-k and top-p: the row's reported log-probability is nan (which the
    generator turns into an error), never an index past the row; the row beside it draws what
    it draws alone."""
    torch.manual_seed(2)
    logprobs_BV = torch.randn(2, 20).log_softmax(-1)
    logprobs_BV[0] = float("nan")
    settings = (torch.tensor([1.0, 1.0]), torch.tensor([5, 5]), torch.tensor([0.5, 0.5]),
                torch.tensor([1, 2]), torch.tensor([0, 0]))  # fmt: skip
    tokens, picked = sample_rows(logprobs_BV, *settings)
    alone, alone_lp = sample_rows(logprobs_BV[1:], *(s[1:] for s in settings))
    assert picked[0].isnan() and 0 <= tokens[0] < 20
    assert tokens[1] == alone[0] and picked[1] == alone_lp[0]
