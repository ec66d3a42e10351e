"""Policy-gradient losses for RL post-training, as pure functions on tensors.

Shapes: ``N`` prompts x ``G`` rollouts each for rewards; ``B`` sequences x ``T`` tokens for
everything per token (``B = N * G``; ``advantages_NG.flatten()`` gives ``advantages_B``).
``mask_BT`` is True on the response tokens that count: the model's own generated tokens, not
the prompt nor a tool's output. Log-probs are fp32.

The losses follow the objective contract of ``torchloom/train/loss.py``: a micro-batch gives a
loss *sum*, and the step divides the sum over micro-batches and data ranks by one global
normalizer. ``policy_loss`` gives the loss of every token, ``loss_normalizer`` the weight of
every token and this micro-batch's share of the normalizer::

    out = policy_loss(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT)
    weights_BT, normalizer = loss_normalizer(mask_BT, "token")
    loss_sum = (out.per_token_BT * weights_BT).sum()  # the step divides by sum(normalizer)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "IS_CORRECTIONS",
    "NORMALIZATIONS",
    "RATIO_LEVELS",
    "PolicyLoss",
    "group_advantages",
    "importance_weights",
    "informative_groups",
    "loss_normalizer",
    "policy_loss",
]

RATIO_LEVELS = ("token", "sequence")
NORMALIZATIONS = ("token", "sequence", "constant")


def group_advantages(
    rewards_NG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's group-relative advantages, [N, G]: ``A = r - mean_g(r)``, divided by
    ``std_g(r) + eps`` when ``normalize_std``. The std is the population std (``unbiased=False``:
    divides by G). Dr. GRPO is ``normalize_std=False``. A group whose rewards are all equal gets
    advantages 0 (see ``informative_groups``)."""
    rewards_NG = rewards_NG.float()
    advantages_NG = rewards_NG - rewards_NG.mean(dim=-1, keepdim=True)
    if normalize_std:
        advantages_NG = advantages_NG / (rewards_NG.std(dim=-1, keepdim=True, correction=0) + eps)
    return advantages_NG


def informative_groups(rewards_NG: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic filtering, bool [N]: False for a group whose G rewards are all equal
    (zero variance: every advantage is 0, so the group gives no learning signal)."""
    return (rewards_NG != rewards_NG[:, :1]).any(dim=-1)


@dataclass
class PolicyLoss:
    """What ``policy_loss`` computed. The metrics are detached means over the masked tokens."""

    per_token_BT: torch.Tensor
    """The loss of every token (fp32), exactly 0 outside the mask: weight it with
    ``loss_normalizer``'s weights, sum, and divide by the global normalizer."""
    clip_frac: torch.Tensor
    """The fraction of tokens whose ratio was clipped where the clip stops the gradient:
    ratio > 1 + clip_high with A > 0, or ratio < 1 - clip_low with A < 0 (tokens with A = 0
    are never clipped; they count in the denominator as every masked token does)."""
    kl: torch.Tensor
    """The k3 estimate of KL(policy || reference); 0 without a reference."""
    ratio_mean: torch.Tensor
    """The importance ratio's mean (per sequence and repeated on its tokens under GSPO)."""
    ratio_BT: torch.Tensor | None = None
    """The ratio of every token (detached; 1 outside the mask), for its extremes."""
    is_weight_mean: torch.Tensor | None = None
    """The importance-sampling weights' mean; None when no correction is applied."""
    is_masked_frac: torch.Tensor | None = None
    """The fraction of tokens masked by MIS (weight outside its bounds); None otherwise."""


IS_CORRECTIONS = ("none", "tis", "mis")


def importance_weights(
    old_logprobs_BT: torch.Tensor,
    behavior_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    correction: str = "tis",
    level: str = "token",
    low: float = 0.0,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached [B, T] weights correcting for rollouts sampled by a behavior policy (the
    generator's numerics, or older weights) other than the ratio's denominator, and the masked
    fraction: ``w = p_old / p_behavior`` per token, or per sequence (the product over its masked
    tokens, on each of them). 'tis' clamps ``w`` to [low, high]; 'mis' keeps it inside and sets
    it to 0 outside (those tokens leave the loss); 'none' is 1. 0 outside the mask."""
    if correction not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance correction {correction!r}; one of {IS_CORRECTIONS}")
    zero = torch.zeros((), device=mask_BT.device)
    if correction == "none":
        return mask_BT.float(), zero
    log_w_BT = torch.where(mask_BT, old_logprobs_BT - behavior_logprobs_BT, 0.0).detach()
    if level == "sequence":
        log_w_BT = log_w_BT.sum(dim=-1, keepdim=True).expand_as(log_w_BT)
    elif level != "token":
        raise ValueError(f"unknown importance level {level!r}; one of ('token', 'sequence')")
    w_BT = log_w_BT.float().exp()
    if correction == "tis":
        return torch.where(mask_BT, w_BT.clamp(low, high), 0.0), zero
    kept_BT = (w_BT >= low) & (w_BT <= high) & mask_BT
    masked = (mask_BT & ~kept_BT).sum() / mask_BT.sum().clamp(min=1)
    return torch.where(kept_BT, w_BT, 0.0), masked


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_level: str = "token",
    ref_logprobs_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behavior_logprobs_BT: torch.Tensor | None = None,
    correction: str = "tis",
    is_level: str = "token",
    is_low: float = 0.0,
    is_high: float = 2.0,
    clip: bool = True,
) -> PolicyLoss:
    """The PPO clipped surrogate per token, with an optional KL penalty and importance
    correction::

        loss = -w * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3

    ``logprobs_BT`` are the trainer's, with gradient; ``old_logprobs_BT`` the ratio's
    denominator (detached): the policy the step's updates start from. ``clip_high > clip_low``
    is DAPO's clip-higher. ``advantages_B`` is per sequence ([B]) or per token ([B, T]).
    ``clip=False`` is the plain importance-weighted policy gradient (REINFORCE with a baseline).

    ``ratio_level``: 'token' (PPO, GRPO): ``ratio = exp(lp - old_lp)`` per token. 'sequence'
    (GSPO): ``s_i = exp(mean_t(lp - old_lp))`` over sequence i's masked tokens, used on each of
    its tokens as ``sg(s_i) * exp(lp_t - sg(lp_t))``: the value is ``s_i`` and the gradient
    ``s_i * grad(lp_t)``, so with the 'sequence' normalization the tokens' gradients add up to
    the gradient of the sequence's clipped ``s_i * A_i`` (GSPO's clip ranges are far smaller,
    e.g. 3e-4 / 4e-4).

    ``ref_logprobs_BT``: a frozen reference's; adds ``kl_coef * k3`` per token, with
    ``k3 = exp(ref - lp) - (ref - lp) - 1`` (>= 0, unbiased for KL(policy || ref)); its
    gradient flows through ``lp``.

    ``behavior_logprobs_BT``: the generator's, when they can differ from ``old_logprobs_BT``:
    each token's surrogate is multiplied by ``importance_weights(old, behavior, ...)`` (TIS or
    MIS, per token or sequence); the KL penalty is a regularizer and is not reweighted.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; one of {RATIO_LEVELS}")
    if kl_coef != 0.0 and ref_logprobs_BT is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs_BT (a reference model's)")

    # Outside the mask log-probs may be anything (padding, -inf): zero them first, so nothing
    # there reaches a value or a gradient, not even as NaN.
    def masked(x_BT: torch.Tensor) -> torch.Tensor:
        return torch.where(mask_BT, x_BT, 0.0)

    mask_float_BT = mask_BT.float()
    num_tokens = mask_float_BT.sum().clamp(min=1)
    logprobs_BT = masked(logprobs_BT)
    log_ratio_BT = logprobs_BT - masked(old_logprobs_BT).detach()
    if ratio_level == "token":
        ratio_BT = log_ratio_BT.exp()
    else:
        lengths_B = mask_float_BT.sum(dim=-1).clamp(min=1)
        seq_ratio_B = (log_ratio_BT.sum(dim=-1) / lengths_B).exp()
        ratio_BT = seq_ratio_B.detach()[:, None] * (logprobs_BT - logprobs_BT.detach()).exp()

    advantages = advantages_B.float()
    advantages_BT = (advantages[:, None] if advantages.dim() == 1 else advantages).expand_as(
        ratio_BT
    )
    if clip:
        clipped_ratio_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
        surrogate_BT = torch.minimum(ratio_BT * advantages_BT, clipped_ratio_BT * advantages_BT)
        clipped_BT = ((advantages_BT > 0) & (ratio_BT > 1.0 + clip_high)) | (
            (advantages_BT < 0) & (ratio_BT < 1.0 - clip_low)
        )
    else:
        surrogate_BT = ratio_BT * advantages_BT
        clipped_BT = torch.zeros_like(mask_BT)
    loss_BT = -surrogate_BT

    is_weight_mean = is_masked_frac = None
    if behavior_logprobs_BT is not None and correction != "none":
        weight_BT, masked_frac = importance_weights(
            old_logprobs_BT, behavior_logprobs_BT, mask_BT, correction, is_level, is_low, is_high
        )
        loss_BT = loss_BT * weight_BT
        is_weight_mean = (weight_BT * mask_float_BT).sum() / num_tokens
        is_masked_frac = masked_frac if correction == "mis" else None

    kl_BT = torch.zeros_like(loss_BT)
    if ref_logprobs_BT is not None:
        ref_minus_lp_BT = masked(ref_logprobs_BT).detach() - logprobs_BT
        kl_BT = ref_minus_lp_BT.exp() - ref_minus_lp_BT - 1.0
        loss_BT = loss_BT + kl_coef * kl_BT

    def token_mean(x_BT: torch.Tensor) -> torch.Tensor:
        return (x_BT.detach().float() * mask_float_BT).sum() / num_tokens

    return PolicyLoss(
        per_token_BT=torch.where(mask_BT, loss_BT, 0.0),
        clip_frac=token_mean(clipped_BT),
        kl=token_mean(kl_BT),
        ratio_mean=token_mean(ratio_BT),
        ratio_BT=torch.where(mask_BT, ratio_BT.detach(), 1.0),
        is_weight_mean=None if is_weight_mean is None else is_weight_mean.detach(),
        is_masked_frac=is_masked_frac,
    )


def loss_normalizer(
    mask_BT: torch.Tensor, mode: str, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """How per-token losses average into the loss: ``(weights_BT, normalizer)`` with
    ``loss = sum(weights * per_token) / sum(normalizer)``, both sums over every micro-batch
    and data rank, so splitting the batch by sequences leaves the loss unchanged.

    - 'token' (DAPO): every response token of the global batch counts the same: weight 1,
      normalizer = the number of masked tokens.
    - 'sequence' (GRPO): the mean over each sequence's tokens, then over sequences: weight
      ``1 / len_i``, normalizer = the number of sequences.
    - 'constant' (Dr. GRPO): as 'sequence' with the fixed ``max_len`` (the generation budget)
      for every ``len_i``, so a token's weight does not depend on its sequence's length.

    Sequences count when they have a masked token (padding rows do not). ``weights_BT`` is fp32
    and 0 outside the mask; ``normalizer`` is a 0-dim integer tensor (no host sync).
    """
    if mode not in NORMALIZATIONS:
        raise ValueError(f"unknown loss normalization {mode!r}; one of {NORMALIZATIONS}")
    weights_BT = mask_BT.float()
    if mode == "token":
        return weights_BT, mask_BT.sum()
    if mode == "sequence":
        weights_BT = weights_BT / weights_BT.sum(dim=-1, keepdim=True).clamp(min=1)
    else:
        if max_len is None or max_len <= 0:
            raise ValueError(f"the 'constant' normalization needs max_len > 0, got {max_len}")
        weights_BT = weights_BT / max_len
    return weights_BT, mask_BT.any(dim=-1).sum()
