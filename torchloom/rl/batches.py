"""From a step's rollouts to the training step's input: rewards (with DAPO's overlong
shaping), group-relative advantages, and ``Batch`` micro-batches whose extras carry what the
RL objectives read (torchloom/rl/objectives.py), split into the step's minibatches and each
data rank's share of them.

Every per-rollout value is looked up by the rollout's own group, never by its position, so
rollouts may arrive in any order (several generator ranks, refilled groups).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from torchloom.data.packing import Batch
from torchloom.rl.config import RLConfig
from torchloom.rl.losses import group_advantages
from torchloom.rl.rollout import Rollout
from torchloom.train.loss import IGNORE_INDEX


def shaped_reward(rollout: Rollout, cfg: RLConfig) -> float:
    """The rollout's reward with DAPO's overlong penalty: a last reply longer than
    ``max_new_tokens - overlong_buffer`` loses ``overlong_penalty`` times the fraction of the
    buffer it ran into (the whole penalty when cut at max_new_tokens)."""
    if not cfg.overlong_buffer:
        return rollout.reward
    start = cfg.max_new_tokens - cfg.overlong_buffer
    into = min(max(rollout.last_reply_len - start, 0), cfg.overlong_buffer)
    return rollout.reward - cfg.overlong_penalty * into / cfg.overlong_buffer


def trains(rollout: Rollout, cfg: RLConfig) -> bool:
    """Whether the loss trains on ``rollout``: not when its environment failed ('error': the
    failure is the infrastructure's, not the policy's), nor when it was cut and
    ``overlong_filter`` is on. Either still counts in its group's advantages."""
    return rollout.finish_reason != "error" and not (cfg.overlong_filter and rollout.truncated)


def advantages_by_rollout(rollouts: Sequence[Rollout], cfg: RLConfig) -> list[float]:
    """Each rollout's group-relative advantage (``group_advantages`` over its own group's
    shaped rewards), in the order given."""
    members: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rollouts):
        members[r.group].append(i)
    advantages = [0.0] * len(rollouts)
    for indices in members.values():
        rewards = torch.tensor([[shaped_reward(rollouts[i], cfg) for i in indices]])
        values = group_advantages(rewards, cfg.normalize_std)[0].tolist()
        for i, value in zip(indices, values, strict=True):
            advantages[i] = value
    return advantages


def informative(rollouts: Sequence[Rollout], cfg: RLConfig) -> set[int]:
    """The groups whose shaped rewards are not all equal (they carry a learning signal)."""
    rewards: dict[int, set[float]] = defaultdict(set)
    for r in rollouts:
        rewards[r.group].add(shaped_reward(r, cfg))
    return {group for group, values in rewards.items() if len(values) > 1}


def to_batch(rollouts: Sequence[Rollout], advantages: Sequence[float], cfg: RLConfig,
             multiple: int = 1) -> Batch:  # fmt: skip
    """The rollouts as one right-padded micro-batch (length a ``multiple`` of the sequence
    split of tensor / context parallelism). Labels are the next token on generated positions
    (IGNORE_INDEX elsewhere, and everywhere in a rollout that ``trains`` says no to); extras:
    ``behavior_logprobs`` (the generator's), ``old_logprobs`` (the same until the trainer
    recomputes them), ``advantages`` (on every token of the row), ``weights`` (the loss
    normalization) and ``norm_units`` (int: 1 per trained token, or 1 on a sequence's first
    trained token, so the step's normalizer is their sum over ranks)."""
    mode = cfg.normalization()
    T = -(-(max(len(r.tokens) for r in rollouts) - 1) // multiple) * multiple
    B = len(rollouts)
    tokens_BT = torch.zeros(B, T, dtype=torch.long)
    labels_BT = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    behavior_BT = torch.zeros(B, T)
    for row, r in enumerate(rollouts):
        n = len(r.tokens) - 1
        tokens_BT[row, :n] = torch.tensor(r.tokens[:-1])
        trained = torch.tensor(r.mask[1:])
        if not trains(r, cfg):
            trained = torch.zeros_like(trained)
        labels_BT[row, :n] = torch.where(trained, torch.tensor(r.tokens[1:]), IGNORE_INDEX)
        behavior_BT[row, :n] = torch.tensor(r.logprobs[1:], dtype=torch.float32)
    mask_BT = labels_BT != IGNORE_INDEX
    lengths_B1 = mask_BT.sum(dim=-1, keepdim=True)
    if mode == "token":
        weights_BT, units_BT = mask_BT.float(), mask_BT.long()
    else:
        first_BT = mask_BT & (mask_BT.long().cumsum(dim=-1) == 1)
        units_BT = first_BT.long()
        if mode == "sequence":
            weights_BT = mask_BT.float() / lengths_B1.clamp(min=1)
        else:  # Dr. GRPO: the generation budget of a whole episode, every turn counted
            weights_BT = mask_BT.float() / (cfg.max_new_tokens * cfg.max_turns)
    advantages_BT = torch.tensor(list(advantages), dtype=torch.float32)[:, None].expand(B, T)
    positions_BT = torch.arange(T).expand(B, T)
    extras = {"behavior_logprobs": behavior_BT, "old_logprobs": behavior_BT.clone(),
              "advantages": advantages_BT.contiguous(), "weights": weights_BT,
              "norm_units": units_BT}  # fmt: skip
    return Batch(tokens_BT, labels_BT, positions_BT.contiguous(), None, extras)


def idle_copy(batch: Batch) -> Batch:
    """A micro-batch with nothing to train (no labels, no weight, no normalizer share): what
    a data rank with fewer micro-batches than another runs so that every rank's FSDP
    collectives meet."""
    idle = batch.map_tokens(torch.clone)
    idle.labels.fill_(IGNORE_INDEX)
    idle.extras["weights"].zero_()
    idle.extras["norm_units"].zero_()
    idle._num_label_tokens = 0
    return idle


def minibatch_groups(groups: Sequence[int], minibatches: int) -> list[list[int]]:
    """The step's groups split into ``minibatches`` consecutive parts of near-equal size."""
    count = len(groups)
    bounds = [round(i * count / minibatches) for i in range(minibatches + 1)]
    return [list(groups[bounds[i] : bounds[i + 1]]) for i in range(minibatches)]


def my_micro_batches(
    rollouts: Sequence[Rollout], advantages: Sequence[float], cfg: RLConfig, dp_rank: int,
    dp_size: int, multiple: int = 1,
) -> list[Batch]:  # fmt: skip
    """This data rank's share of the micro-batches (``cfg.micro_batch_size`` rollouts each) of
    ``rollouts``; every rank gets as many micro-batches as the busiest (idle copies fill in)."""
    size = cfg.micro_batch_size
    starts = list(range(0, len(rollouts), size))
    mine = [to_batch(rollouts[s : s + size], advantages[s : s + size], cfg, multiple)
            for s in starts[dp_rank::dp_size]]  # fmt: skip
    busiest = -(-len(starts) // dp_size)
    if len(mine) < busiest:
        template = mine[0] if mine else to_batch(rollouts[:1], advantages[:1], cfg, multiple)
        mine += [idle_copy(template) for _ in range(busiest - len(mine))]
    return mine
