"""The RL loop (`torchloom rl`): rollouts from the generator, GRPO-family updates of the policy,
weight sync, metrics, checkpoints.

One policy update per step. Its rollouts: ``rl.prompts_per_step`` prompts x ``rl.group_size``
episodes (torchloom/rl/rollout.py). Advantages are group-relative (losses.group_advantages);
groups whose rollouts all got the same reward are dropped (no signal). The trainer scores the
sampled tokens with the same model code (``PolicyGradient``: fp32 log-softmax of the logits,
as the generator scores them) and takes a clipped policy-gradient step.

Placement is colocated: the generator runs on the trainer's device. With
``rl.max_offpolicy_steps 0`` it runs the trainer's very modules, one batch after the other:
exactly on-policy, and there are no weights to move. With k > 0 a generator thread works on
its own copy of the weights, up to k updates ahead of the trainer: before each batch it pulls
the newest policy in place (``Generator.update_weights``: a device-to-device copy into the same
storage) and tags the batch with that policy's version; the trainer's step never waits for a
batch whose version is more than k behind, and the generator never starts one that would be.

With batch-invariant mode the trainer's log-probability of every sampled token equals the
generator's bit for bit on-policy (``logprob_diff_max`` 0.0); otherwise the two can differ
slightly, and truncated importance sampling (``rl.tis_cap``) reweights the tokens by their
(capped) ratio.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchloom.checkpoint.manager import CheckpointManager, on_rank0
from torchloom.checkpoint.stateful import ModelState, OptimizerState
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.data.build import build_tokenizer
from torchloom.generate.engine import Generator
from torchloom.models import build_model
from torchloom.parallel import build_parallel_dims, init_distributed, loss_context
from torchloom.parallel.data_parallel import mixed_precision_policy
from torchloom.parallel.state import full_state_items
from torchloom.rl.config import RLJobConfig
from torchloom.rl.disaggregated import Link, last_version_sent, policy_needed, trainer_ranks
from torchloom.rl.losses import (
    group_advantages,
    informative_groups,
    loss_normalizer,
    policy_loss,
)
from torchloom.rl.rollout import Rollout, RolloutBatch, generate_rollouts
from torchloom.rl.tasks import TASKS, make_env
from torchloom.rl.tool_env import PythonToolEnv, tool_prompts
from torchloom.train.builders import build_model_config, build_model_parts, check_seq_len
from torchloom.train.loss import IGNORE_INDEX, LossOutput, label_logprobs, with_auxiliary
from torchloom.train.metrics import MetricsLogger
from torchloom.train.optim import build_lr_scheduler, build_optimizer, clip_gradients
from torchloom.train.output import check_output_dir, remove_outputs, truncate_metrics
from torchloom.train.trainer import Trainer, export_final_model


class PolicyGradient:
    """The RL objective: the clipped policy-gradient loss of a micro-batch of rollouts, as a
    sum of weighted token losses (the step divides by the global normalizer)."""

    fields = ("labels", "advantages", "weights", "normalizer", "behavior_logprobs",
              "ref_logprobs")  # fmt: skip

    def __init__(self, job: RLJobConfig) -> None:
        self.cfg = job.rl
        # On-policy in batch-invariant mode the generator's log-probs are the trainer's.
        self.tis = self.cfg.tis_cap > 0 and not (
            job.model.batch_invariant and self.cfg.max_offpolicy_steps == 0
        )

    def __call__(
        self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]
    ) -> LossOutput:
        """The weighted token-loss sum; metrics as sums over the trained tokens (``tokens``,
        ``clip_frac``, ``kl``) and ``logprob_diff_max``. Layers' auxiliary terms (MoE balance)
        join it as in every objective, weighted by this micro-batch's share of the normalizer."""
        cfg, labels_BT = self.cfg, targets["labels"]
        logprobs_BT = label_logprobs(h_BTD, model, labels_BT)
        mask_BT = labels_BT != IGNORE_INDEX
        behavior_BT = targets["behavior_logprobs"]
        out = policy_loss(
            logprobs_BT, logprobs_BT.detach(), targets["advantages"], mask_BT,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, ratio_level=cfg.ratio_level,
            ref_logprobs_BT=targets.get("ref_logprobs"), kl_coef=cfg.kl_coef,
            behavior_logprobs_BT=behavior_BT if self.tis else None,
            tis_cap=cfg.tis_cap if self.tis else None,
        )  # fmt: skip
        tokens = mask_BT.sum()
        diff_BT = torch.where(mask_BT, (logprobs_BT.detach() - behavior_BT).abs(), 0.0)
        metrics = {"tokens": tokens, "clip_frac": out.clip_frac * tokens, "kl": out.kl * tokens,
                   "logprob_diff_max": diff_BT.max()}  # fmt: skip
        loss = LossOutput((out.per_token_BT * targets["weights"]).sum(), metrics)
        return with_auxiliary(loss, model, targets["normalizer"])


def policy_batches(
    rollouts: list[Rollout], advantages: list[float], micro: int, mode: str, max_len: int,
    device: torch.device, multiple: int = 1,
) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """The rollouts as right-padded micro-batches: tokens (inputs), labels (the next token on
    generated positions, IGNORE_INDEX elsewhere), the generator's log-probs of the labels,
    advantages and the normalization weights. Lengths are padded to a ``multiple`` (tensor
    parallelism's sequence split)."""
    batches = []
    for start in range(0, len(rollouts), micro):
        chunk = rollouts[start : start + micro]
        T = -(-(max(len(r.tokens) for r in chunk) - 1) // multiple) * multiple
        tokens_BT = torch.zeros(len(chunk), T, dtype=torch.long)
        labels_BT = torch.full((len(chunk), T), IGNORE_INDEX, dtype=torch.long)
        behavior_BT = torch.zeros(len(chunk), T)
        for row, r in enumerate(chunk):
            n = len(r.tokens) - 1
            tokens_BT[row, :n] = torch.tensor(r.tokens[:-1])
            targets = torch.tensor(r.tokens[1:])
            trained = torch.tensor(r.mask[1:])
            labels_BT[row, :n] = torch.where(trained, targets, IGNORE_INDEX)
            behavior_BT[row, :n] = torch.tensor(r.logprobs[1:], dtype=torch.float32)
        weights_BT, normalizer = loss_normalizer(labels_BT != IGNORE_INDEX, mode, max_len)
        batch = {
            "tokens": tokens_BT, "labels": labels_BT, "behavior_logprobs": behavior_BT,
            "advantages": torch.tensor(advantages[start : start + micro], dtype=torch.float32),
            "weights": weights_BT, "normalizer": normalizer,
        }  # fmt: skip
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches


class RolloutBuffer:
    """Batches generated ahead of the trainer (max_offpolicy_steps > 0), checkpointed so a
    resumed run trains on them as the interrupted one would have."""

    def __init__(self) -> None:
        self.batches: list[RolloutBatch] = []

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps([_batch_to_dict(b) for b in self.batches])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches = [_batch_from_dict(d) for d in json.loads(state["json"])]


def _batch_to_dict(batch: RolloutBatch) -> dict[str, Any]:
    return {**vars(batch), "rollouts": [vars(r) for r in batch.rollouts]}


def _batch_from_dict(d: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch(**{**d, "rollouts": [Rollout(**r) for r in d["rollouts"]]})


class RLTrainer:
    """One `torchloom rl` job."""

    def __init__(self, job: RLJobConfig) -> None:
        self.job, t, r = job, job.training, job.rl
        self.device = init_distributed(t.device)
        # Disaggregated: the first ranks train, over a mesh of their own; the others generate.
        self.trainers = trainer_ranks(r)
        self.dims = build_parallel_dims(job.parallel, self.device.type, self.trainers or None)
        self.is_generator = bool(self.trainers) and self.dims.rank >= self.trainers
        self.output_dir = Path(job.output.dir)
        if r.task not in TASKS and r.task != "python_tool":
            raise ConfigError(
                f"--rl.task {r.task!r} is not a registered task; one of "
                f"{sorted([*TASKS, 'python_tool'])} (torchloom.rl.tasks.register_task adds one)."
            )
        if job.model.attn_backend == "flex" and self.device.type == "cpu":
            raise ConfigError(
                "FlexAttention cannot train on the CPU; use --model.attn_backend sdpa."
            )
        torch.manual_seed(t.seed)
        self.tokenizer = build_tokenizer(job.data)
        self.model_config = build_model_config(job)
        if self.model_config.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
                f"holds {self.model_config.vocab_size}; use the tokenizer the model was trained with."
            )
        check_seq_len(self.model_config, t.seq_len)
        self.link = None
        if self.trainers:
            if self.dims.world_mesh is not None:
                self.dims.moe_meshes()  # collective: the generator ranks join its creation
            dtype = mixed_precision_policy(self.dims.degrees, self.device.type).param_dtype
            if self.dims.world_mesh is None:  # one trainer rank: no FSDP, no cast
                dtype = torch.float32
            self.link = Link(self.trainers, self.device, dtype, r.sync_bucket_mb)
        if r.task == "python_tool":  # multi-turn: the model's code runs in the sandbox
            self.prompts = tool_prompts(seed=t.seed)
            self.make_env = lambda prompt: PythonToolEnv(max_turns=r.max_turns)
        else:
            self.prompts = TASKS[r.task](seed=t.seed)
            self.make_env = lambda prompt: make_env(prompt, r.format_reward)
        self.prompt_stream = iter(self.prompts)  # reads the source's position as it goes
        self.version = 0  # optimizer steps the policy has taken
        self.gen_version = 0
        self.params_lock = threading.Lock()
        self.step = 0
        if self.is_generator:
            self._init_generator_rank()
        else:
            self._init_trainer()

    def _init_trainer(self) -> None:
        job, t, r = self.job, self.job.training, self.job.rl
        self.objective = PolicyGradient(job)
        self.parts = build_model_parts(
            job, self.model_config, self.dims, self.device, self.objective
        )
        self.model = self.parts.model
        self.optimizer = build_optimizer(self.model, job.optimizer, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, job.lr_schedule, t.steps)
        self.reference = None
        if r.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.buffer = RolloutBuffer()
        self.prompt_position = PromptPosition(self.prompts)
        parts: dict[str, Any] = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.scheduler, "prompts": self.prompt_position,
            "rollouts": self.buffer,
        }  # fmt: skip
        if self.reference is not None:
            parts["reference"] = ModelState(self.reference)
        self.checkpointer = CheckpointManager(
            job.checkpoint, self.output_dir, device=self.device, is_rank0=self.dims.is_rank0,
            parts=parts, marker_extra={"family": job.model.name,
                                       "model_config": to_dict(self.parts.saved_config)},
        )  # fmt: skip
        if self.link is not None:
            return  # the generator ranks generate
        # On-policy: the trainer's own modules generate; with lag, a copy of them does.
        self.gen_model = self.model if r.max_offpolicy_steps == 0 else copy.deepcopy(self.model)
        self.generator = Generator(self.gen_model, max_batch=r.generator_slots,
                                   max_len=t.seq_len, cuda_graphs=self._graphs())  # fmt: skip

    def _graphs(self) -> bool | None:
        """Decode from CUDA graphs on a GPU (the engine's default): the optimizer and the weight
        sync write the parameters in place, so the captured graphs read each new policy. Not
        in batch-invariant mode, whose bitwise match with the trainer is verified for the eager
        decode (a graph's step attends over every key index of its slot, masked)."""
        return False if self.job.model.batch_invariant else None

    def _init_generator_rank(self) -> None:
        """A generator rank of a disaggregated job: a whole model in the trainer's compute
        dtype (its values arrive from the trainer), and a checkpointer that saves the step
        alongside the trainer's."""
        job, r = self.job, self.job.rl
        assert self.link is not None
        with torch.device("meta"):
            self.gen_model = build_model(self.model_config)
        self.gen_model.to_empty(device=self.device)
        self.gen_model.to(self.link.dtype).eval()
        self.generator = Generator(self.gen_model, max_batch=r.generator_slots,
                                   max_len=job.training.seq_len,
                                   cuda_graphs=self._graphs())  # fmt: skip
        own = [p for p in job.checkpoint.exclude_from_loading if p in ("train_state", "rng")]
        self.checkpointer = CheckpointManager(
            replace(job.checkpoint, exclude_from_loading=own), self.output_dir,
            device=self.device, is_rank0=False, parts={}, marker_extra={},
        )  # fmt: skip

    # -- rollouts -------------------------------------------------------------------------------

    def _rollouts(self, step: int) -> RolloutBatch:
        r = self.job.rl
        prompts = [next(self.prompt_stream) for _ in range(r.prompts_per_step)]
        self.gen_model.eval()
        try:
            return generate_rollouts(
                self.generator, self.tokenizer, prompts, self.make_env, r,
                seed=self.job.training.seed, step=step,
                version=self.version if self.gen_model is self.model else self.gen_version,
            )  # fmt: skip
        finally:
            self.gen_model.train()

    def _sync_generator(self) -> float:
        """Pull the newest policy into the generator's weights, in place; seconds spent."""
        if self.gen_model is self.model or self.gen_version == self.version:
            return 0.0
        start = time.perf_counter()
        with self.params_lock:
            self.generator.update_weights(
                (name, p.detach()) for name, p in self.model.named_parameters()
            )
            self.gen_version = self.version
        return time.perf_counter() - start

    # -- the update -----------------------------------------------------------------------------

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        """One policy update on ``batch``; its metrics."""
        job, r = self.job, self.job.rl
        rollouts = batch.rollouts
        rewards_NG = torch.tensor([x.reward for x in rollouts]).view(-1, r.group_size)
        advantages_NG = group_advantages(rewards_NG, r.normalize_std)
        keep_N = informative_groups(rewards_NG) if r.filter_zero_variance else None
        kept = [x for x in rollouts if keep_N is None or keep_N[x.group]]
        advantages = [a for a, x in zip(advantages_NG.flatten().tolist(), rollouts, strict=True)
                      if keep_N is None or keep_N[x.group]]  # fmt: skip
        metrics = {"loss": 0.0, "grad_norm": 0.0, "kl": 0.0, "clip_frac": 0.0,
                   "logprob_diff_max": 0.0,
                   "groups_kept": float(len(kept) // r.group_size)}  # fmt: skip
        if not kept:
            return metrics
        batches = policy_batches(kept, advantages, r.micro_batch_size, r.loss_normalization,
                                 r.max_new_tokens, self.device, self.dims.degrees.tp)  # fmt: skip
        normalizer = sum(b["normalizer"] for b in batches).clamp(min=1).float()
        totals: dict[str, torch.Tensor] = {}
        for b in self._my_share(batches):
            targets = {k: b[k] for k in PolicyGradient.fields if k in b}
            if self.reference is not None:
                with torch.no_grad():
                    ref = self.reference(b["tokens"], objective=_LabelLogprobs(),
                                         targets={"labels": b["labels"]})  # fmt: skip
                targets["ref_logprobs"] = ref
            with loss_context(self.dims):  # vocabulary-sharded logits under tp
                out = self.model(b["tokens"], objective=self.objective, targets=targets)
                (out.loss / normalizer).backward()
            totals["loss"] = totals.get("loss", 0) + out.loss.detach()
            for key, value in out.metrics.items():
                if key == "logprob_diff_max":
                    totals[key] = torch.maximum(totals.get(key, value), value)
                else:
                    totals[key] = totals.get(key, 0) + value
        totals = self._over_data_ranks(totals)
        grad_norm = clip_gradients(self.optimizer, self.model.parameters(),
                                   job.training.max_norm or float("inf"))  # fmt: skip
        with self.params_lock:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = totals["tokens"].clamp(min=1)
        metrics |= {
            "loss": (totals["loss"] / normalizer).item(), "grad_norm": grad_norm.item(),
            "kl": (totals["kl"] / tokens).item(), "clip_frac": (totals["clip_frac"] / tokens).item(),
            "logprob_diff_max": totals["logprob_diff_max"].item(),
        }  # fmt: skip
        aux = {k: (v / normalizer).item() for k, v in totals.items() if k.startswith("aux_")}
        return metrics | aux

    def _my_share(self, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """This data rank's micro-batches of the step (all of them on one rank). Every rank runs
        as many forwards as the busiest one (FSDP gathers weights in each): the idle ones run a
        copy of a micro-batch with nothing to train (no labels, no weight)."""
        size, rank = self.dims.dp_size, self.dims.dp_rank
        if size == 1:
            return batches
        mine = batches[rank::size]
        idle = dict(batches[0])
        idle |= {"labels": torch.full_like(idle["labels"], IGNORE_INDEX),
                 "weights": torch.zeros_like(idle["weights"]),
                 "normalizer": torch.zeros_like(idle["normalizer"])}  # fmt: skip
        return mine + [idle] * (-(-len(batches) // size) - len(mine))

    def _over_data_ranks(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's metric sums (and the log-prob difference's max) over the data ranks."""
        mesh = self.dims.mesh("dp")
        if mesh is None:
            return totals
        group = mesh.get_group()
        summed = sorted(k for k in totals if k != "logprob_diff_max")
        values = torch.stack([torch.as_tensor(totals[k], dtype=torch.float64) for k in summed])
        dist.all_reduce(values, group=group)
        highest = totals["logprob_diff_max"].clone()
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
        return dict(zip(summed, values, strict=True)) | {"logprob_diff_max": highest}

    # -- the loop -------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        if self.is_generator:
            return self._serve()
        job, t, r = self.job, self.job.training, self.job.rl
        self.step = self._start()
        self.version = self.gen_version = self.step
        metrics = MetricsLogger(self.output_dir, job.metrics, t.steps, self.device,
                                self.model_config.flops_per_token(t.seq_len),
                                enabled=self.dims.is_rank0)  # fmt: skip
        metrics.print(
            f"torchloom rl: {job.model.name} {self.model_config.num_params() / 1e6:.2f}M params, "
            f"task {r.task}, {r.prompts_per_step} prompts x {r.group_size} rollouts per update, "
            f"{t.steps} updates, max_offpolicy_steps {r.max_offpolicy_steps}"
        )
        source: _Producer | _Remote | None = None
        if self.link is not None:
            source = _Remote(self)
        elif r.max_offpolicy_steps:
            source = _Producer(self)
        rewards: list[float] = []
        try:
            if source is not None:
                source.start(self.step)
            while self.step < t.steps:
                start = time.perf_counter()
                batch = self._rollouts(self.step + 1) if source is None else source.next()
                waited = time.perf_counter() - start
                lr = self.scheduler.get_last_lr()[0]
                train_start = time.perf_counter()
                self.model.train()
                step_metrics = self._update(batch)
                self.scheduler.step()
                self.step += 1
                self.version = self.step
                if source is not None:
                    source.updated()
                train_s = time.perf_counter() - train_start
                record = self._record(metrics, batch, step_metrics, lr, waited, train_s, start)
                rewards.append(record["reward_mean"])
                if metrics.should_log(self.step):
                    metrics.log(record)
                else:
                    metrics.advance(self.step)
                if self.checkpointer.should_save(self.step, t.steps):
                    if source is not None:
                        source.pause()
                    self.checkpointer.save(self.step, 0)
                    if source is not None:
                        source.resume()
                for saved in self.checkpointer.poll():
                    metrics.log(saved)
            for saved in self.checkpointer.finish():
                metrics.log(saved)
            self._export(metrics)
        finally:
            if source is not None:
                source.stop()
            metrics.close()
        return _summary(self.step, rewards)

    def _serve(self) -> dict[str, float]:
        """A generator rank's run (disaggregated placement, torchloom/rl/disaggregated.py):
        take each step's prompts, generate its share with the newest policy the lag bound
        needs, hand the rollouts over; checkpoint the step alongside the trainer."""
        t, r, link = self.job.training, self.job.rl, self.link
        assert link is not None
        start = self._start()
        version = start
        link.receive_weights(self.gen_model)
        rewards = []
        for step in range(start + 1, t.steps + 1):
            prompts = link.prompts()
            mine = link.my_share(len(prompts))
            sync_s = 0.0
            while version < policy_needed(step, start, r.max_offpolicy_steps):
                sync_s += link.receive_weights(self.gen_model)
                version += 1
            part = generate_rollouts(
                self.generator, self.tokenizer, [prompts[i] for i in mine], self.make_env, r,
                seed=t.seed, step=step, version=version, groups=mine,
            )  # fmt: skip
            part.sync_seconds = sync_s
            if step - 1 > start and self.checkpointer.should_save(step - 1, t.steps):
                self.checkpointer.save(step - 1, 0)
            batch = link.rollouts(part)
            rewards.append(sum(x.reward for x in batch.rollouts) / len(batch.rollouts))
        if t.steps > start and self.checkpointer.should_save(t.steps, t.steps):
            self.checkpointer.save(t.steps, 0)
        self.checkpointer.finish()
        return _summary(t.steps, rewards)

    def _record(self, metrics: MetricsLogger, batch: RolloutBatch, update: dict[str, float],
                lr: float, gen_s: float, train_s: float, start: float) -> dict[str, Any]:  # fmt: skip
        """The step's record: training's fields (``step_record``: tps over the trained tokens,
        memory, ...) and the RL ones (docs/rl.md)."""
        rollouts = batch.rollouts
        generated = sum(x.generated for x in rollouts)
        trained = sum(len(x.tokens) - 1 for x in rollouts)
        rewards = [x.reward for x in rollouts]
        correct = [float(x.info.get("correct", x.reward >= 1.0)) for x in rollouts]
        record = metrics.step_record(self.step, update["loss"], update["grad_norm"], lr, trained,
                                     time.perf_counter() - start, gen_s)  # fmt: skip
        return record | update | {
            "reward_mean": sum(rewards) / len(rewards), "reward_max": max(rewards),
            "correct_frac": sum(correct) / len(correct),
            "response_len_mean": generated / len(rollouts),
            "policy_lag": self.step - 1 - batch.version,
            "gen_tps": generated / max(batch.seconds, 1e-9),
            "train_tps": trained / max(train_s, 1e-9), "weight_sync_s": batch.sync_seconds,
            "time_generate_s": gen_s, "time_train_s": train_s,
            "time_sync_s": batch.sync_seconds,
        }  # fmt: skip

    def _start(self) -> int:
        """Choose and load the checkpoint, check the output folder, record the config."""
        job, ckpt = self.job, self.checkpointer
        step = ckpt.choose(job.training.steps)

        def check() -> list[str]:
            return check_output_dir(self.output_dir, job.output.overwrite, step is not None,
                                    job.checkpoint.resume, ckpt.storage.root_url)  # fmt: skip

        replaced = on_rank0(self.dims.is_rank0, check)
        if self.dims.is_rank0:
            remove_outputs(self.output_dir, replaced)
        if job.checkpoint.resume or job.checkpoint.interval:
            ckpt.clean_interrupted()
        if step is not None:
            step = ckpt.load(step)
            if self.dims.is_rank0:
                truncate_metrics(self.output_dir / "metrics.jsonl", step)
        if self.dims.is_rank0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(to_dict(job), indent=2) + "\n")
        return step or 0

    def _export(self, metrics: MetricsLogger) -> None:
        export_final_model(self.job, self.output_dir, self.parts.saved_config, self.tokenizer,
                           self.dims.is_rank0, metrics.print,
                           lambda: full_state_items(self.model))  # fmt: skip


class _LabelLogprobs:
    """The reference model's log-probabilities of the labels (no loss)."""

    fields = ("labels",)

    def __call__(self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]) -> Any:
        return label_logprobs(h_BTD, model, targets["labels"])


def _summary(steps: int, rewards: list[float]) -> dict[str, float]:
    fifth = max(1, len(rewards) // 5)
    return {"steps": steps, "reward_first": sum(rewards[:fifth]) / fifth,
            "reward_last": sum(rewards[-fifth:]) / fifth}  # fmt: skip


class PromptPosition:
    """The prompt source's position as of the last step trained (what a checkpoint holds):
    prompts drawn ahead of it for the generator ranks are drawn again by a resumed run."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.marked: dict[str, Any] | None = None

    def mark(self) -> None:
        """Take the position now as the one to save (call when every prompt drawn belongs to
        the step being trained or an older one, before drawing ahead)."""
        self.marked = copy.deepcopy(self.source.state_dict())

    def state_dict(self) -> dict[str, Any]:
        return self.marked if self.marked is not None else self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)
        self.marked = None


class _Remote:
    """The trainer ranks' side of disaggregated placement: sends each step's prompts and the
    policies the generator ranks need, receives the batches (torchloom/rl/disaggregated.py)."""

    def __init__(self, trainer: RLTrainer) -> None:
        self.trainer = trainer
        assert trainer.link is not None
        self.link = trainer.link
        self.sync_s = 0.0

    def start(self, step: int) -> None:
        self.sync_s = self.link.send_weights(self.trainer.model)
        self._send_prompts()

    def _send_prompts(self) -> None:
        trainer = self.trainer
        count = trainer.job.rl.prompts_per_step
        self.link.prompts([next(trainer.prompt_stream) for _ in range(count)])

    def next(self) -> RolloutBatch:
        batch = self.link.rollouts()
        self.trainer.prompt_position.mark()  # every prompt drawn so far is this batch's or older
        if self.trainer.step + 2 <= self.trainer.job.training.steps:
            self._send_prompts()  # the generator ranks start on them while this one trains
        batch.sync_seconds = self.sync_s  # what sending the weights cost the trainer
        return batch

    def updated(self) -> None:
        """The policy moved: send it if the generator ranks will ever use it."""
        trainer, r = self.trainer, self.trainer.job.rl
        self.sync_s = 0.0
        if trainer.version <= last_version_sent(trainer.job.training.steps, r.max_offpolicy_steps):
            self.sync_s = self.link.send_weights(trainer.model)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def stop(self) -> None:
        self.link.wait_sent()


class _Producer:
    """The generator thread of an off-policy run: batch s is generated by the newest policy
    once that policy is at most ``max_offpolicy_steps`` updates behind step s's.

    Generated batches wait in the trainer's ``RolloutBuffer`` (the one queue, so a checkpoint
    taken while the thread is paused holds exactly the batches not yet trained on; a resumed
    run trains on those first and generates from the next step on)."""

    def __init__(self, trainer: RLTrainer) -> None:
        self.trainer = trainer
        self.lag = trainer.job.rl.max_offpolicy_steps
        self.pending = trainer.buffer.batches
        self.cond = threading.Condition()
        self.paused = self.stopping = self.busy = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, step: int) -> None:
        first = step + 1 + len(self.pending)  # a resumed run's buffer holds the next batches
        self.thread = threading.Thread(target=self._run, args=(first,), daemon=True)
        self.thread.start()

    def _run(self, first: int) -> None:
        trainer, steps = self.trainer, self.trainer.job.training.steps
        try:
            for step in range(first, steps + 1):
                with self.cond:
                    # Batch `step` trains policy version step - 1; it may be generated by
                    # version step - 1 - lag at the oldest.
                    self.cond.wait_for(lambda s=step: self.stopping or (
                        not self.paused and trainer.version >= s - 1 - self.lag))  # fmt: skip
                    if self.stopping:
                        return
                    self.busy = True
                batch = None
                try:
                    sync_s = trainer._sync_generator()
                    batch = trainer._rollouts(step)
                    batch.sync_seconds = sync_s
                finally:
                    with self.cond:
                        self.busy = False
                        if batch is not None:
                            self.pending.append(batch)
                        self.cond.notify_all()
        except BaseException as err:  # handed to the trainer thread
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def updated(self) -> None:
        """The trainer's version moved: the generator may go on."""
        with self.cond:
            self.cond.notify_all()

    def next(self) -> RolloutBatch:
        """The oldest batch not trained on yet (waits for the generator)."""
        with self.cond:
            self.cond.wait_for(lambda: self.pending or self.error is not None)
            if self.error is not None:
                raise self.error
            return self.pending.pop(0)

    def pause(self) -> None:
        """Hold the generator between batches (for a consistent checkpoint)."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: not self.busy)

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)


def prepare_initial_model(job: RLJobConfig) -> dict[str, float]:
    """Run ``rl.init_recipes`` when the starting model (--checkpoint.initial_load_hf) is
    missing: each recipe trains with its own defaults unless its output already exists.
    Returns the seconds each recipe that ran took."""
    from torchloom.config.recipes import get_recipe

    start = job.checkpoint.initial_load_hf
    seconds: dict[str, float] = {}
    if not start or Path(start).exists() or not job.rl.init_recipes:
        return seconds
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"--checkpoint.initial_load_hf {start} does not exist, and the recipes that build "
            f"it ({', '.join(job.rl.init_recipes)}) run on one process; run them first "
            f"(torchloom train --recipe NAME), then launch this job again."
        )
    for name in job.rl.init_recipes:
        recipe_job = get_recipe(name).build()
        recipe_job.training.device = job.training.device
        done = Path(recipe_job.output.dir) / "hf"
        if done.exists():
            continue
        print(f"torchloom rl: {start} is missing; training recipe {name} first", flush=True)
        began = time.perf_counter()
        Trainer(recipe_job).train()
        seconds[name] = time.perf_counter() - began
    if not Path(start).exists():
        raise ConfigError(
            f"--checkpoint.initial_load_hf {start} still does not exist after the recipes "
            f"{job.rl.init_recipes}; point it at a Hugging Face folder of the model to train."
        )
    return seconds
