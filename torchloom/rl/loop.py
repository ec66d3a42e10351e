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
import threading
import time
from pathlib import Path
from typing import Any

import torch

from torchloom.checkpoint.hf import save_hf
from torchloom.checkpoint.manager import CheckpointManager, on_rank0
from torchloom.checkpoint.model_io import write_model_folder
from torchloom.checkpoint.stateful import ModelState, OptimizerState
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.data.build import build_tokenizer
from torchloom.generate.engine import Generator
from torchloom.parallel import build_parallel_dims, init_distributed
from torchloom.parallel.state import full_state_items
from torchloom.rl.config import RLJobConfig
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
    device: torch.device,
) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """The rollouts as right-padded micro-batches: tokens (inputs), labels (the next token on
    generated positions, IGNORE_INDEX elsewhere), the generator's log-probs of the labels,
    advantages and the normalization weights."""
    batches = []
    for start in range(0, len(rollouts), micro):
        chunk = rollouts[start : start + micro]
        T = max(len(r.tokens) for r in chunk) - 1
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
        self.dims = build_parallel_dims(job.parallel, self.device.type)
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
        if r.task == "python_tool":  # multi-turn: the model's code runs in the sandbox
            self.prompts = tool_prompts(seed=t.seed)
            self.make_env = lambda prompt: PythonToolEnv(max_turns=r.max_turns)
        else:
            self.prompts = TASKS[r.task](seed=t.seed)
            self.make_env = lambda prompt: make_env(prompt, r.format_reward)
        self.prompt_stream = iter(self.prompts)  # reads the source's position as it goes
        self.buffer = RolloutBuffer()
        parts: dict[str, Any] = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.scheduler, "prompts": self.prompts, "rollouts": self.buffer,
        }  # fmt: skip
        if self.reference is not None:
            parts["reference"] = ModelState(self.reference)
        self.checkpointer = CheckpointManager(
            job.checkpoint, self.output_dir, device=self.device, is_rank0=self.dims.is_rank0,
            parts=parts, marker_extra={"family": job.model.name,
                                       "model_config": to_dict(self.parts.saved_config)},
        )  # fmt: skip
        # On-policy: the trainer's own modules generate; with lag, a copy of them does.
        self.gen_model = self.model if r.max_offpolicy_steps == 0 else copy.deepcopy(self.model)
        self.generator = Generator(self.gen_model, max_batch=r.generator_slots,
                                   max_len=t.seq_len, cuda_graphs=False)  # fmt: skip
        self.version = 0  # optimizer steps the policy has taken
        self.gen_version = 0
        self.params_lock = threading.Lock()
        self.step = 0

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
                                 r.max_new_tokens, self.device)  # fmt: skip
        normalizer = sum(b["normalizer"] for b in batches).clamp(min=1).float()
        totals: dict[str, torch.Tensor] = {}
        for b in batches:
            targets = {k: b[k] for k in PolicyGradient.fields if k in b}
            if self.reference is not None:
                with torch.no_grad():
                    ref = self.reference(b["tokens"], objective=_LabelLogprobs(),
                                         targets={"labels": b["labels"]})  # fmt: skip
                targets["ref_logprobs"] = ref
            out = self.model(b["tokens"], objective=self.objective, targets=targets)
            (out.loss / normalizer).backward()
            totals["loss"] = totals.get("loss", 0) + out.loss.detach()
            for key, value in out.metrics.items():
                if key == "logprob_diff_max":
                    totals[key] = torch.maximum(totals.get(key, value), value)
                else:
                    totals[key] = totals.get(key, 0) + value
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

    # -- the loop -------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
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
        source = _Producer(self) if r.max_offpolicy_steps else None
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
        fifth = max(1, len(rewards) // 5)
        return {"steps": self.step, "reward_first": sum(rewards[:fifth]) / fifth,
                "reward_last": sum(rewards[-fifth:]) / fifth}  # fmt: skip

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
        job, family, config = self.job, self.job.model.name, self.parts.saved_config
        if job.checkpoint.save_final_model:
            write_model_folder(self.output_dir / "model", family, config,
                               full_state_items(self.model), self.tokenizer)  # fmt: skip
            metrics.print(f"saved the model to {self.output_dir / 'model'}")
        if job.checkpoint.export_hf:
            save_hf(self.output_dir / "hf", family, config, full_state_items(self.model),
                    self.tokenizer)  # fmt: skip
            metrics.print(f"exported a Hugging Face folder to {self.output_dir / 'hf'}")


class _LabelLogprobs:
    """The reference model's log-probabilities of the labels (no loss)."""

    fields = ("labels",)

    def __call__(self, h_BTD: torch.Tensor, model: Any, targets: dict[str, torch.Tensor]) -> Any:
        return label_logprobs(h_BTD, model, targets["labels"])


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

    def next(self) -> RolloutBatch:
        """The oldest batch not trained on yet (waits for the generator)."""
        with self.cond:
            self.cond.notify_all()  # the trainer's version moved: the generator may go on
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


def prepare_initial_model(job: RLJobConfig) -> None:
    """Run ``rl.init_recipes`` when the starting model (--checkpoint.initial_load_hf) is
    missing: each recipe trains with its own defaults unless its output already exists."""
    from torchloom.config.recipes import get_recipe
    from torchloom.train.trainer import Trainer

    start = job.checkpoint.initial_load_hf
    if not start or Path(start).exists() or not job.rl.init_recipes:
        return
    for name in job.rl.init_recipes:
        recipe_job = get_recipe(name).build()
        recipe_job.training.device = job.training.device
        done = Path(recipe_job.output.dir) / "hf"
        if done.exists():
            continue
        print(f"torchloom rl: {start} is missing; training recipe {name} first", flush=True)
        Trainer(recipe_job).train()
    if not Path(start).exists():
        raise ConfigError(
            f"--checkpoint.initial_load_hf {start} still does not exist after the recipes "
            f"{job.rl.init_recipes}; point it at a Hugging Face folder of the model to train."
        )
