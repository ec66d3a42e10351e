"""Sampling a batch of rows at once, each row from its own reproducible random stream.

A request's stream is counter-based: the noise for its n-th generated token is a hash of (its
seed, n, the token id), computed on the device for every row in one set of tensor ops. A draw
therefore depends on the request alone, not on the batch it shares a step with, the device's
random state or how many requests ran before it; and a step with a hundred sampling rows costs
a handful of kernels and one host read instead of a hundred small draws.

The draw is Gumbel-max: the argmax, over the tokens top-k and top-p keep, of the
temperature-scaled log-probabilities plus independent Gumbel noise is distributed as the
softmax of those scaled log-probabilities renormalised over the kept tokens.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # 2^64 / golden ratio, as a signed int64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def derive_seed(seed: int, *parts: int) -> int:
    """A request's sampling seed from a run's seed and the integers that place it (a step, an
    episode, a turn...), the same on every machine."""
    value = seed
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (2**61 - 1)
    return value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (``>>`` on tensors is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer: every output bit depends on every input bit (int64 products wrap
    modulo 2^64)."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


# Random bits a noise value takes. (bits + 0.5) / 2^23 has 24 significant bits, so fp32 holds it
# exactly: the largest is 1 - 2^-24, never 1. With 24 bits the largest rounded up to 1.0, whose
# Gumbel noise is +inf: that token won the draw whatever its probability (top-k's and top-p's
# removed ones too), about once a vocabulary / 2^24 draws.
NOISE_BITS = 23


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values strictly inside (0, 1), evenly spaced, from integers in [0, 2^NOISE_BITS)."""
    return (bits.float() + 0.5) * 2.0**-NOISE_BITS


def uniform_noise(seeds_B: torch.Tensor, counters_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] fp32 in (0, 1): row b's noise for draw ``counters_B[b]`` of stream
    ``seeds_B[b]`` (int64 tensors on the device the noise is wanted on)."""
    key_B = _mix(_mix(seeds_B) + counters_B * _GOLDEN)
    ids_V = torch.arange(vocab, device=seeds_B.device, dtype=torch.int64)
    return unit_interval(_shift_right(_mix(key_B[:, None] + ids_V * _GOLDEN), 64 - NOISE_BITS))


def kept_tokens(
    scores_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """[B, V] bool: the tokens each row may draw. Top-k keeps every token at least as likely as
    the k-th (0: all); then top-p, on the top-k renormalised probabilities, keeps a token if the
    tokens strictly more likely than it hold less than top_p together (1: all). So tied tokens
    are kept or dropped together, never one of them by its place in the sort."""
    V = scores_BV.shape[-1]
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=V), V)
    sorted_BV = scores_BV.sort(dim=-1, descending=True).values
    kth_B1 = sorted_BV.gather(1, (k_B - 1)[:, None])
    kept_BV = scores_BV >= kth_B1
    probs_BV = torch.softmax(scores_BV.masked_fill(~kept_BV, float("-inf")), dim=-1)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    # Sorted descending, ties are contiguous: a tie counts the mass before its first member.
    # (A nan row, from nan logits, finds no place: clamped, it yields a nan draw that the
    # generator reports, not an index past the row.)
    first_of_tie_BV = torch.searchsorted(-sorted_BV, -sorted_BV, side="left").clamp(max=V - 1)
    before_BV = (sorted_BV.cumsum(-1) - sorted_BV).gather(1, first_of_tie_BV)
    nucleus_sorted_BV = (before_BV < top_p_B[:, None]) | (top_p_B[:, None] >= 1)
    nucleus_BV = torch.zeros_like(kept_BV).scatter(1, order_BV, nucleus_sorted_BV)
    return kept_BV & nucleus_BV


def sampling_logprobs(
    logprobs_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    filtered: bool = True,
) -> torch.Tensor:
    """[B, V] fp32 log-probabilities of the distribution a row is sampled from: the model's
    log-probabilities divided by the temperature, restricted to the tokens top-k and top-p keep,
    renormalised (-inf elsewhere). The generator reports a sampled token's entry of this, and
    the RL trainer computes the same function of its own logits (torchloom/rl/objectives.py),
    so both score the distribution the tokens came from, bit for bit in batch-invariant mode.
    Rows at temperature 1 without top-k or top-p get ``logprobs_BV`` itself (the same
    distribution; renormalising it again would only add rounding). ``filtered=False`` says no
    row uses top-k or top-p (the caller knows from its settings): the sorts they need are
    skipped, with the same result."""
    logprobs_BV = logprobs_BV.float()
    scores_BV = logprobs_BV / temperature_B[:, None]
    if filtered:
        scores_BV = scores_BV.masked_fill(~kept_tokens(scores_BV, top_k_B, top_p_B), float("-inf"))
    sampling_BV = torch.log_softmax(scores_BV, dim=-1)
    plain_B = (temperature_B == 1) & (top_k_B == 0) & (top_p_B >= 1)
    return torch.where(plain_B[:, None], logprobs_BV, sampling_BV)


def sample_rows(
    logprobs_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    seeds_B: torch.Tensor,
    counters_B: torch.Tensor,
    filtered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] token ids, [B] their log-probabilities under the sampling distribution): row b drawn
    from its log-probabilities under its own settings (temperature > 0) with draw
    ``counters_B[b]`` of stream ``seeds_B[b]``."""
    sampling_BV = sampling_logprobs(logprobs_BV, temperature_B, top_k_B, top_p_B, filtered)
    noise_BV = uniform_noise(seeds_B, counters_B, sampling_BV.shape[-1])
    gumbel_BV = -torch.log(-torch.log(noise_BV))
    tokens_B = (sampling_BV + gumbel_BV).argmax(dim=-1)
    return tokens_B, sampling_BV.gather(1, tokens_B[:, None])[:, 0]
