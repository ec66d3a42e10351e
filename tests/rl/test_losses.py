"""RL losses (torchloom/rl/losses.py) against numbers worked out by hand and direct formulas."""

from __future__ import annotations

import math

import pytest
import torch

from torchloom.rl.losses import (
    NORMALIZATIONS,
    group_advantages,
    informative_groups,
    loss_normalizer,
    policy_loss,
)


def _assert_close(got: torch.Tensor, want: torch.Tensor | list, atol: float = 1e-6) -> None:
    want = torch.as_tensor(want, dtype=got.dtype).detach()
    diff = (got.detach() - want).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.2e} > {atol:.0e}\ngot  {got}\nwant {want}"


def test_group_advantages_with_and_without_std() -> None:
    rewards_NG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # Group 0: mean 0.5, population std 0.5. Group 1: mean 0.75, deviations
    # [.25, .25, .25, -.75], population std sqrt((3 * .0625 + .5625) / 4) = sqrt(.1875).
    std1 = math.sqrt(0.1875)
    eps = 1e-6
    _assert_close(
        group_advantages(rewards_NG),
        [[0.5 / (0.5 + eps) * s for s in (1, -1, -1, 1)],
         [d / (std1 + eps) for d in (0.25, 0.25, 0.25, -0.75)]],
    )  # fmt: skip
    _assert_close(
        group_advantages(rewards_NG, normalize_std=False),
        [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]],
    )


def test_zero_variance_groups_are_filtered_and_get_zero_advantage() -> None:
    rewards_NG = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    assert informative_groups(rewards_NG).tolist() == [False, True, False]
    advantages_NG = group_advantages(rewards_NG)
    assert torch.isfinite(advantages_NG).all()
    assert (advantages_NG[0] == 0).all() and (advantages_NG[2] == 0).all()


def _ppo_case(high_ratio_masked: float = 1e4):
    """Two sequences of five tokens, the last one masked out. Ratios per token:
    row 0 (A = +1): [1.5, 0.5, 1.1, 1.25, masked]; row 1 (A = -2): [1.5, 0.5, 0.7, 1.25, masked]."""
    ratios = [[1.5, 0.5, 1.1, 1.25, high_ratio_masked], [1.5, 0.5, 0.7, 1.25, high_ratio_masked]]
    old_BT = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0], [-0.2, -1.5, -2.5, -0.7, -1.0]])
    logprobs_BT = (old_BT + torch.tensor(ratios).log()).requires_grad_()
    mask_BT = torch.tensor([[True] * 4 + [False]] * 2)
    return logprobs_BT, old_BT, torch.tensor([1.0, -2.0]), mask_BT


def test_ppo_clip_higher_values_gradients_and_clip_frac() -> None:
    logprobs_BT, old_BT, advantages_B, mask_BT = _ppo_case()
    out = policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT, clip_low=0.2, clip_high=0.28)
    # -min(r A, clip(r, 0.8, 1.28) A). Row 0, A = 1: 1.5 -> clipped to 1.28; 0.5 < 0.8 but
    # A > 0 keeps the lower r; 1.1 inside; 1.25 inside (clip-higher: 0.2 would clip it).
    # Row 1, A = -2: 1.5 keeps the higher loss 3; 0.5 -> 0.8 (clipped); 0.7 -> 0.8 (clipped).
    _assert_close(
        out.per_token_BT,
        [[-1.28, -0.5, -1.1, -1.25, 0.0], [3.0, 1.6, 1.6, 2.5, 0.0]],
        atol=1e-5,
    )
    _assert_close(out.clip_frac, 3 / 8)
    _assert_close(out.ratio_mean, (1.5 + 0.5 + 1.1 + 1.25 + 1.5 + 0.5 + 0.7 + 1.25) / 8, 1e-5)
    assert out.kl == 0 and out.is_weight_mean is None
    # d(-r A)/d lp = -A r where unclipped, 0 where the clip is taken; 0 outside the mask.
    out.per_token_BT.sum().backward()
    _assert_close(
        logprobs_BT.grad,
        [[0.0, -0.5, -1.1, -1.25, 0.0], [3.0, 0.0, 0.0, 2.5, 0.0]],
        atol=1e-5,
    )


def test_ppo_symmetric_clip_clips_the_token_clip_higher_keeps() -> None:
    logprobs_BT, old_BT, advantages_B, mask_BT = _ppo_case()
    out = policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT, clip_low=0.2, clip_high=0.2)
    _assert_close(out.per_token_BT[0], [-1.2, -0.5, -1.1, -1.2, 0.0], atol=1e-5)
    _assert_close(out.clip_frac, 4 / 8)


def _weighted_loss(per_token_BT, mask_BT, mode, max_len=None) -> torch.Tensor:
    weights_BT, normalizer = loss_normalizer(mask_BT, mode, max_len)
    return (per_token_BT * weights_BT).sum() / normalizer


@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_gradient_at_ratio_one_is_minus_advantage_times_weight(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    old_BT = -torch.rand(3, 6, generator=gen) * 3
    mask_BT = torch.tensor(
        [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0]], dtype=torch.bool
    )
    # Outside the mask, log-probs that would poison a careless implementation with NaN.
    logprobs_BT = old_BT.masked_fill(~mask_BT, -math.inf).requires_grad_()
    advantages_B = torch.tensor([0.7, -1.3, 2.0])
    # At the reference, k3's gradient 1 - exp(ref - lp) is 0 too.
    out = policy_loss(
        logprobs_BT, old_BT, advantages_B, mask_BT, ref_logprobs_BT=old_BT, kl_coef=0.5
    )
    assert (out.per_token_BT[~mask_BT] == 0).all()
    loss = _weighted_loss(out.per_token_BT, mask_BT, mode, max_len=6)
    loss.backward()
    weights_BT, normalizer = loss_normalizer(mask_BT, mode, 6)
    want_BT = -advantages_B[:, None] * weights_BT / normalizer
    _assert_close(logprobs_BT.grad, want_BT)
    assert (logprobs_BT.grad[~mask_BT] == 0).all()


def test_gspo_sequence_ratio_value_and_gradient_match_the_formula() -> None:
    # Row 0: log-ratios [0.1, 0.3, (masked)] -> s = exp(0.2) = 1.2214, inside [0.8, 1.28], A = 1.
    # Row 1: log-ratios [-0.4, -0.6, -0.5] -> s = exp(-0.5) = 0.6065 < 0.8 with A = -1: clipped.
    old_BT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0]])
    log_ratio_BT = torch.tensor([[0.1, 0.3, 5.0], [-0.4, -0.6, -0.5]])
    mask_BT = torch.tensor([[True, True, False], [True, True, True]])
    advantages_B = torch.tensor([1.0, -1.0])
    logprobs_BT = (old_BT + log_ratio_BT).requires_grad_()
    out = policy_loss(
        logprobs_BT, old_BT, advantages_B, mask_BT, clip_low=0.2, clip_high=0.28,
        ratio_level="sequence",
    )  # fmt: skip
    s0, s1 = math.exp(0.2), math.exp(-0.5)
    _assert_close(out.per_token_BT, [[-s0, -s0, 0.0], [0.8, 0.8, 0.8]], atol=1e-6)
    _assert_close(out.ratio_mean, (2 * s0 + 3 * s1) / 5)
    _assert_close(out.clip_frac, 3 / 5)
    # Each token's term is sg(s_i) * exp(lp_t - sg(lp_t)): its gradient is s_i on its own
    # token only (what lets per-token weights such as TIS act per token), not s_i / len_i on
    # every token of the sequence as the gradient of s_i itself would be.
    (grad_BT,) = torch.autograd.grad(out.per_token_BT[0, 0], logprobs_BT, retain_graph=True)
    _assert_close(grad_BT, [[-s0, 0.0, 0.0], [0.0, 0.0, 0.0]])

    loss = _weighted_loss(out.per_token_BT, mask_BT, "sequence")
    loss.backward()

    # GSPO directly: s_i = exp(mean of the masked log-ratios), loss = -mean_i min(s A, clip(s) A).
    direct_BT = logprobs_BT.detach().clone().requires_grad_()
    terms = []
    for i in range(2):
        diffs = [direct_BT[i, t] - old_BT[i, t] for t in range(3) if mask_BT[i, t]]
        s = torch.exp(sum(diffs) / len(diffs))
        a = advantages_B[i]
        terms.append(-torch.minimum(s * a, s.clamp(0.8, 1.28) * a))
    direct = sum(terms) / 2
    direct.backward()
    _assert_close(loss, direct)
    _assert_close(logprobs_BT.grad, direct_BT.grad)
    _assert_close(logprobs_BT.grad, [[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]])


def test_k3_kl_value_gradient_and_zero_at_the_reference() -> None:
    logprobs_BT = torch.tensor([[-1.0, -2.0, -0.1]], requires_grad=True)
    ref_BT = torch.tensor([[-1.5, -1.0, 7.0]])
    mask_BT = torch.tensor([[True, True, False]])
    advantages_B = torch.zeros(1)  # only the KL term remains
    out = policy_loss(
        logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, ref_logprobs_BT=ref_BT,
        kl_coef=0.1,
    )  # fmt: skip
    # ref - lp = [-0.5, 1.0]: k3 = exp(d) - d - 1.
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    _assert_close(out.kl, (k3[0] + k3[1]) / 2)
    _assert_close(out.per_token_BT, [[0.1 * k3[0], 0.1 * k3[1], 0.0]])
    out.per_token_BT.sum().backward()
    # d k3 / d lp = 1 - exp(ref - lp).
    _assert_close(logprobs_BT.grad, [[0.1 * (1 - math.exp(-0.5)), 0.1 * (1 - math.e), 0.0]])

    same = policy_loss(
        logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT,
        ref_logprobs_BT=logprobs_BT.detach(), kl_coef=0.1,
    )  # fmt: skip
    assert same.kl == 0 and (same.per_token_BT == 0).all()
    no_ref = policy_loss(logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT)
    assert no_ref.kl == 0
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, kl_coef=0.1)


def test_tis_weights_are_capped_and_detached() -> None:
    old_BT = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    # old - behavior = [0, log 1.5, log 3, -log 2, (masked)] -> w = [1, 1.5, min(3, 2), 0.5].
    behavior_BT = old_BT - torch.tensor([[0.0, math.log(1.5), math.log(3.0), -math.log(2), 9.0]])
    logprobs_BT = old_BT.clone().requires_grad_()
    mask_BT = torch.tensor([[True, True, True, True, False]])
    out = policy_loss(
        logprobs_BT, old_BT, torch.tensor([1.0]), mask_BT, behavior_logprobs_BT=behavior_BT,
        correction="tis", is_low=0.0, is_high=2.0,
    )  # fmt: skip
    weights = [1.0, 1.5, 2.0, 0.5]
    _assert_close(out.per_token_BT, [[-w for w in weights] + [0.0]], atol=1e-6)
    _assert_close(out.is_weight_mean, sum(weights) / 4)
    assert out.is_masked_frac is None
    out.per_token_BT.sum().backward()  # ratio 1: the gradient is -A * w
    _assert_close(logprobs_BT.grad, [[-w for w in weights] + [0.0]], atol=1e-6)
    # A lower bound lifts small weights: w = [1, 1.5, 2, 0.8].
    low = policy_loss(old_BT, old_BT, torch.tensor([1.0]), mask_BT,
                      behavior_logprobs_BT=behavior_BT, is_low=0.8, is_high=2.0)  # fmt: skip
    _assert_close(low.per_token_BT, [[-1.0, -1.5, -2.0, -0.8, 0.0]], atol=1e-6)


def test_mis_masks_tokens_outside_the_bounds() -> None:
    """Masked importance sampling: weights inside [low, high] are kept, the others zeroed (their
    tokens leave the loss) and counted in is_masked_frac."""
    old_BT = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    behavior_BT = old_BT - torch.tensor([[0.0, math.log(1.5), math.log(3.0), -math.log(2), 9.0]])
    mask_BT = torch.tensor([[True, True, True, True, False]])
    out = policy_loss(old_BT, old_BT, torch.tensor([2.0]), mask_BT,
                      behavior_logprobs_BT=behavior_BT, correction="mis", is_low=0.6,
                      is_high=2.0)  # fmt: skip
    # w = [1, 1.5, 3 (masked), 0.5 (masked)]; loss = -A * w.
    _assert_close(out.per_token_BT, [[-2.0, -3.0, 0.0, 0.0, 0.0]], atol=1e-6)
    _assert_close(out.is_masked_frac, 0.5)


def test_sequence_level_importance_weight_is_the_product() -> None:
    old_BT = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    gaps = torch.tensor([[math.log(1.2), math.log(1.5), 0.0], [math.log(2.0), math.log(3.0), 0.0]])
    mask_BT = torch.tensor([[True, True, False], [True, True, True]])
    for correction, want in (("tis", [1.8, 2.5]), ("mis", [1.8, 0.0])):
        out = policy_loss(old_BT, old_BT, torch.tensor([1.0, 1.0]), mask_BT,
                          behavior_logprobs_BT=old_BT - gaps, correction=correction,
                          is_level="sequence", is_high=2.5)  # fmt: skip
        # Sequence 0: 1.2 * 1.5 = 1.8 (its third token is masked); sequence 1: 6, over 2.5.
        expect = [[-want[0], -want[0], 0.0], [-want[1]] * 3]
        _assert_close(out.per_token_BT, expect, atol=1e-5)


def test_zero_advantage_tokens_are_never_counted_as_clipped() -> None:
    """clip_frac counts tokens whose clip stops the gradient; a token with A = 0 has no
    gradient to stop, whatever its ratio."""
    old_BT = torch.zeros(3, 2)
    logprobs_BT = torch.tensor([[1.0, -1.0], [1.0, -1.0], [0.0, 0.0]])  # ratios e and 1/e
    advantages_B = torch.tensor([0.0, 1.0, -1.0])
    out = policy_loss(logprobs_BT, old_BT, advantages_B, torch.ones(3, 2, dtype=torch.bool),
                      clip_low=0.2, clip_high=0.28)  # fmt: skip
    # Row 0 (A = 0): no clip. Row 1 (A > 0): e > 1.28 clipped, 1/e not. Row 2: ratio 1.
    _assert_close(out.clip_frac, 1 / 6)


def test_the_three_normalizations() -> None:
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    per_token_BT = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0] * 4])
    weights_BT, normalizer = loss_normalizer(mask_BT, "token")
    _assert_close(weights_BT, mask_BT.float())
    assert normalizer == 4
    weights_BT, normalizer = loss_normalizer(mask_BT, "sequence")
    _assert_close(weights_BT, [[1 / 3, 1 / 3, 1 / 3, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert normalizer == 2  # the padding row does not count
    weights_BT, normalizer = loss_normalizer(mask_BT, "constant", max_len=4)
    _assert_close(weights_BT, mask_BT.float() / 4)
    assert normalizer == 2
    # token: (1+2+3+4) / 4; sequence: (6/3 + 4/1) / 2; constant: (6/4 + 4/4) / 2.
    _assert_close(_weighted_loss(per_token_BT, mask_BT, "token"), 2.5)
    _assert_close(_weighted_loss(per_token_BT, mask_BT, "sequence"), 3.0)
    _assert_close(_weighted_loss(per_token_BT, mask_BT, "constant", max_len=4), 1.25)
    with pytest.raises(ValueError, match="max_len"):
        loss_normalizer(mask_BT, "constant")
    with pytest.raises(ValueError, match="one of"):
        loss_normalizer(mask_BT, "batch")


@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_micro_batches_sum_to_the_whole_batch(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    mask_BT = torch.rand(5, 7, generator=gen) < 0.6
    mask_BT[4] = False  # a padding row
    old_BT = -torch.rand(5, 7, generator=gen)
    logprobs_BT = old_BT + 0.3 * torch.randn(5, 7, generator=gen)
    out = policy_loss(logprobs_BT, old_BT, torch.randn(5, generator=gen), mask_BT)
    whole = _weighted_loss(out.per_token_BT, mask_BT, mode, max_len=7)
    sums, normalizers = [], []
    for rows in (slice(0, 2), slice(2, 5)):  # two micro-batches (or data ranks)
        weights_BT, normalizer = loss_normalizer(mask_BT[rows], mode, max_len=7)
        sums.append((out.per_token_BT[rows] * weights_BT).sum())
        normalizers.append(normalizer)
    _assert_close(sum(sums) / sum(normalizers), whole.item())
