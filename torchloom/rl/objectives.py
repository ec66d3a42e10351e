"""RL objectives: loss components of the training step (torchloom/train/step.py), like
``CrossEntropy``, reading the extras of the ``Batch`` rows the rollouts became
(torchloom/rl/batches.py): ``advantages``, ``weights`` (the loss normalization), ``norm_units``
(each micro-batch's share of the normalizer), ``old_logprobs`` (the ratio's denominator),
``behavior_logprobs`` (the generator's) and, with a KL penalty, ``ref_logprobs``.

A registry maps ``--rl.objective`` to a factory, so a new objective is one file that calls
``register_objective`` and a recipe line that names it::

    register_objective("my_loss", lambda job: MyObjective(job.rl))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchloom.config.errors import ConfigError
from torchloom.generate.sampling import sampling_logprobs
from torchloom.rl.config import RLConfig, RLJobConfig
from torchloom.rl.losses import policy_loss
from torchloom.train.loss import (
    IGNORE_INDEX,
    LossOutput,
    Objective,
    label_logprobs,
    picked_logprobs,
    with_auxiliary,
)

OBJECTIVES: dict[str, Callable[[RLJobConfig], Objective]] = {}
"""``--rl.objective`` name -> a factory of the objective from the job."""


def register_objective(name: str, factory: Callable[[RLJobConfig], Objective]) -> None:
    """Make ``--rl.objective name`` build ``factory(job)``."""
    if name in OBJECTIVES:
        raise ValueError(f"RL objective {name!r} is registered already")
    OBJECTIVES[name] = factory


def build_rl_objective(job: RLJobConfig) -> Objective:
    name = job.rl.objective
    if name not in OBJECTIVES:
        raise ConfigError(
            f"--rl.objective {name!r} is not a registered RL objective; one of "
            f"{sorted(OBJECTIVES)} (torchloom.rl.objectives.register_objective adds one)."
        )
    return OBJECTIVES[name](job)


def sampled_token_logprobs(
    h_BTD: torch.Tensor, model: Any, labels_BT: torch.Tensor, cfg: RLConfig
) -> torch.Tensor:
    """[B, T] log-probability of each label under the distribution the generator sampled it
    from (``sampling_logprobs``: temperature and top-p applied; at temperature 1 without top-p
    the model's own), 0 where the label is IGNORE_INDEX. The same function of the logits as the
    generator's, so bitwise equal to its numbers in batch-invariant mode."""
    if cfg.temperature == 1 and cfg.top_p >= 1:
        return label_logprobs(h_BTD, model, labels_BT)
    logits_BTV = model.logits(h_BTD)
    if isinstance(logits_BTV, DTensor):  # vocabulary-sharded: top-p needs the whole row
        logits_BTV = logits_BTV.full_tensor()
    logprobs_NV = torch.log_softmax(logits_BTV.float(), dim=-1).flatten(0, 1)
    rows = logprobs_NV.shape[0]
    device = logprobs_NV.device
    sampling_NV = sampling_logprobs(
        logprobs_NV, torch.full((rows,), cfg.temperature, device=device),
        torch.zeros(rows, dtype=torch.long, device=device),
        torch.full((rows,), cfg.top_p, device=device), filtered=cfg.top_p < 1,
    )  # fmt: skip
    return picked_logprobs(sampling_NV.view(*labels_BT.shape, -1), labels_BT)


class PolicyGradient:
    """The clipped policy-gradient objective (``losses.policy_loss``) of a micro-batch of
    rollouts: a sum of weighted token losses that the step divides by the global normalizer.

    Metrics (sums the step divides as it divides the loss; the runner turns them into token
    means): ``tokens``, ``clipped``, ``kl_sum``, ``ratio_sum``, ``is_weight_sum``,
    ``is_masked``; maxima: ``logprob_diff_max`` (trainer vs generator), ``ratio_max``,
    ``ratio_min_neg`` (minus the smallest ratio)."""

    def __init__(self, cfg: RLConfig, clip: bool = True) -> None:
        self.cfg, self.clip = cfg, clip
        # One update per batch: the ratio's denominator is this very forward's log-probs (the
        # weights the step starts from), so no separate scoring pass runs.
        self.own_old = cfg.old_logprobs == "recompute" and cfg.ppo_epochs * cfg.minibatches == 1
        self.fields = ("labels", "advantages", "weights", "norm_units", "old_logprobs",
                       "behavior_logprobs") + (("ref_logprobs",) if cfg.kl_coef > 0 else ())  # fmt: skip

    def __call__(
        self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]
    ) -> LossOutput:
        cfg, labels_BT = self.cfg, targets["labels"]
        logprobs_BT = sampled_token_logprobs(h_BTD, model, labels_BT, cfg)
        mask_BT = labels_BT != IGNORE_INDEX
        behavior_BT = targets["behavior_logprobs"]
        clip_low, clip_high = cfg.clip_range()
        old_BT = logprobs_BT.detach() if self.own_old else targets["old_logprobs"]
        out = policy_loss(
            logprobs_BT, old_BT, targets["advantages"], mask_BT,
            clip_low=clip_low, clip_high=clip_high, ratio_level=cfg.ratio_level,
            ref_logprobs_BT=targets.get("ref_logprobs"), kl_coef=cfg.kl_coef,
            behavior_logprobs_BT=behavior_BT, correction=cfg.is_correction,
            is_level=cfg.is_level, is_low=cfg.is_low, is_high=cfg.is_high, clip=self.clip,
        )  # fmt: skip
        tokens = mask_BT.sum()
        diff_BT = torch.where(mask_BT, (logprobs_BT.detach() - behavior_BT).abs(), 0.0)
        assert out.ratio_BT is not None
        metrics = {
            "tokens": tokens, "clipped": out.clip_frac * tokens, "kl_sum": out.kl * tokens,
            "ratio_sum": out.ratio_mean * tokens,
        }  # fmt: skip
        if out.is_weight_mean is not None:
            metrics["is_weight_sum"] = out.is_weight_mean * tokens
        if out.is_masked_frac is not None:
            metrics["is_masked"] = out.is_masked_frac * tokens
        maxima = {"logprob_diff_max": diff_BT.max(), "ratio_max": out.ratio_BT.max(),
                  "ratio_min_neg": -out.ratio_BT.min()}  # fmt: skip
        loss = LossOutput((out.per_token_BT * targets["weights"]).sum(), metrics, maxima=maxima)
        # Multi-token prediction's term is next-token cross-entropy on the rollouts: imitating
        # every sampled token, whatever its advantage. The policy gradient leaves it out.
        return with_auxiliary(loss, model, targets["norm_units"].sum(), skip=("mtp",))

    def normalizer(self, batch: Any) -> torch.Tensor:
        """This micro-batch's share of the normalizer: its tokens (token normalization) or the
        sequences whose first trained token it holds (per sequence, constant)."""
        return batch.extras["norm_units"].sum()


class SampledLogProbs:
    """The labels' log-probabilities under the sampling distribution (no loss): the ratio's
    denominator before an update, and a reference model's scores."""

    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        self.fields = ("labels",)

    def __call__(self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]) -> Any:
        return sampled_token_logprobs(h_BTD, model, targets["labels"], self.cfg)


register_objective("ppo", lambda job: PolicyGradient(job.rl))
register_objective("reinforce", lambda job: PolicyGradient(job.rl, clip=False))
