"""The RL runner (`torchloom rl`): a rollout source (torchloom/rl/sources.py) feeds the
training step (torchloom/train/step.py) with rollouts turned into ``Batch`` micro-batches
(torchloom/rl/batches.py) under an RL objective (torchloom/rl/objectives.py); the run scaffold
(torchloom/train/run.py) starts, resumes, logs, saves and exports as it does for training.

Each step: the step's groups (``rl.prompts_per_step`` prompts x ``rl.group_size`` rollouts,
refilled by dynamic sampling) get group-relative advantages; the trainer scores the ratio's
denominator when it will move during the step (several minibatches or epochs); then
``rl.ppo_epochs`` passes over ``rl.minibatches`` parts each take one optimizer step through the
same ``TrainStep`` as pre-training (autocast, MoE balancing and load logs, the non-finite check,
every parallel layout the step supports).

Placement: colocated (one process) on-policy uses the trainer's modules to generate; with lag a
generator thread works on a copy; disaggregated puts generator ranks beside trainer ranks.
The policy's version (optimizer steps' RL step count) moves under ``params_lock``, the lock the
generator thread pulls weights under, so a batch's version tag is the weights that made it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from torchloom.checkpoint.manager import CheckpointManager, on_rank0
from torchloom.checkpoint.stateful import ModelState
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.data.build import build_tokenizer
from torchloom.data.packing import Batch
from torchloom.generate.engine import CacheTooLarge, Generator
from torchloom.models import build_model
from torchloom.parallel import build_parallel_dims, init_distributed
from torchloom.parallel.data_parallel import mixed_precision_policy
from torchloom.parallel.state import full_state_items
from torchloom.rl.batches import (
    advantages_by_rollout,
    minibatch_groups,
    my_micro_batches,
    trains,
)
from torchloom.rl.config import RLJobConfig
from torchloom.rl.disaggregated import Link, trainer_ranks
from torchloom.rl.env import Prompt
from torchloom.rl.evaluate import evaluate
from torchloom.rl.objectives import SampledLogProbs, build_rl_objective
from torchloom.rl.rollout import Rollout, RolloutBatch, context_error, generate_rollouts
from torchloom.rl.sources import Lagged, OnPolicy, Remote, collect, group_plan, prompt_index, serve
from torchloom.rl.state import RolloutBuffer
from torchloom.rl.tasks import CHECKS, HELD_OUT, TASKS, make_env
from torchloom.rl.tool_env import PythonToolEnv, tool_prompts
from torchloom.train.builders import (
    autocast_dtype,
    build_model_config,
    build_model_parts,
    build_state,
    cap_device_memory,
    check_seq_len,
)
from torchloom.train.expert_balance import expert_balance
from torchloom.train.loss import IGNORE_INDEX
from torchloom.train.metrics import MetricsLogger
from torchloom.train.optim import build_lr_scheduler, build_optimizer
from torchloom.train.output import check_writable
from torchloom.train.profiling import StepProfiler
from torchloom.train.run import RunScaffold
from torchloom.train.step import StepParts, TrainingError, TrainStep, rank_batch
from torchloom.train.trainer import Trainer, TrainingInterrupted


class RLRunner:
    """One `torchloom rl` job."""

    def __init__(self, job: RLJobConfig) -> None:
        self.job, t, r = job, job.training, job.rl
        self.device = init_distributed(t.device)
        cap_device_memory(self.device, t.memory_limit_gib)
        # Disaggregated: the first ranks train, over a mesh of their own; the others generate.
        self.trainers = trainer_ranks(r)
        self.dims = build_parallel_dims(
            job.parallel.following(t.mixed_precision), self.device.type, self.trainers or None
        )
        self.is_generator = bool(self.trainers) and self.dims.rank >= self.trainers
        self.output_dir = Path(job.output.dir)
        # As train checks it: before the tokenizer, the model and the starting weights load.
        on_rank0(self.dims.is_rank0, lambda: check_writable(self.output_dir))
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
        check_seq_len(self.model_config, t.seq_len, job.checkpoint.initial_load_hf)
        self.link = None
        if self.trainers:
            if self.dims.world_mesh is not None:
                self.dims.moe_meshes()  # collective: the generator ranks join its creation
            dtype = mixed_precision_policy(self.dims.degrees, self.device.type).param_dtype
            if self.dims.world_mesh is None:  # one trainer rank: no FSDP, no cast
                dtype = torch.float32
            self.link = Link(self.trainers, self.device, dtype, r.sync_bucket_mb,
                             in_flight=r.max_offpolicy_steps + 1)  # fmt: skip
        if r.task == "python_tool":  # multi-turn: the model's code runs in the sandbox
            self.prompts = tool_prompts(seed=t.seed)
            self.make_env = lambda prompt: PythonToolEnv(
                max_turns=r.max_turns, unsafe_sandbox=r.unsafe_sandbox
            )
            self.make_env(None)  # without isolation (and unsafe_sandbox) it refuses here
        else:
            self.prompts = TASKS[r.task](seed=t.seed)
            self.make_env = lambda prompt: make_env(prompt, r.format_reward)
        ev = job.eval
        if (ev.every or ev.k) and r.task not in HELD_OUT:
            raise ConfigError(
                f"--eval.every / --eval.k evaluate on the task's held-out set, and task "
                f"{r.task!r} has none (tasks with one: {sorted(HELD_OUT)}); set both to 0."
            )
        held_out: list[Prompt] = []
        if ev.every or ev.k:
            try:
                held_out = HELD_OUT[r.task](ev.problems)
            except ValueError as e:
                raise ConfigError(f"--eval.problems {ev.problems}: {e}.") from None
        self._check_context(held_out)
        self.version = 0  # RL steps the policy has taken
        self.gen_version = 0  # the version the generator's weights hold (a copy's, with lag)
        self.params_lock = threading.Lock()
        self._holding = False  # this (the trainer's) thread holds params_lock
        self.step = 0
        self.step_parts: StepParts | None = None
        self.eval_generator: Generator | None = None
        if self.is_generator:
            self._init_generator_rank()
        else:
            self._init_trainer()
        self.run = RunScaffold(job, self.checkpointer, self.dims.is_rank0)

    def _check_context(self, held_out: list[Prompt]) -> None:
        """Refuse, before any folder is written, a --training.seq_len (the generator's
        context) with no room for the first step's prompts (rendered as the rollouts render
        them) plus a reply, or for the held-out prompts plus an evaluation answer. Later
        steps' prompts are checked as they come (``context_error``)."""
        job, r, ev = self.job, self.job.rl, self.job.eval
        seq_len = job.training.seq_len

        def longest(prompts: list[Prompt], rendered: Callable[[Prompt], str]) -> int:
            messages = ([{"role": "user", "content": rendered(p)}] for p in prompts)
            return max((len(self.tokenizer.encode_chat_prompt(m)) for m in messages), default=0)

        first = [self.prompts.prompt(prompt_index(1, j)) for j in range(r.prompts_per_step)]
        tokens = longest(first, lambda p: self.make_env(p).reset(p))
        if tokens + r.max_new_tokens > seq_len:
            raise context_error("A prompt of the first step", tokens,
                                f"--rl.max_new_tokens {r.max_new_tokens}", r.max_new_tokens,
                                seq_len, "lower --rl.max_new_tokens")  # fmt: skip
        budget = ev.max_new_tokens or r.max_new_tokens
        tokens = longest(held_out, lambda p: p.text)
        if held_out and tokens + budget > seq_len:
            given = (
                f"--eval.max_new_tokens {budget}"
                if ev.max_new_tokens
                else f"the evaluation's --rl.max_new_tokens {budget} (--eval.max_new_tokens 0)"
            )
            lower = (
                "lower --eval.max_new_tokens" if ev.max_new_tokens else "set --eval.max_new_tokens"
            )
            raise context_error("A held-out evaluation prompt", tokens, given, budget, seq_len,
                                lower)  # fmt: skip

    def _init_trainer(self) -> None:
        job, t, r = self.job, self.job.training, self.job.rl
        self.objective = build_rl_objective(job)
        self.parts = build_model_parts(
            job, self.model_config, self.dims, self.device, self.objective
        )
        self.model = self.parts.model
        self.optimizer = build_optimizer(self.model, job.optimizer, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, job.lr_schedule, t.steps)
        self.buffer = RolloutBuffer()
        state = build_state(self.parts, self.optimizer, self.scheduler, None)
        state["rollouts"] = self.buffer
        self.reference = None
        if r.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
            state["reference"] = ModelState(self.reference)
        self.checkpointer = CheckpointManager(
            job.checkpoint, self.output_dir, device=self.device, is_rank0=self.dims.is_rank0,
            parts=state, marker_extra={"run": "rl", "family": job.model.name,
                                       "model_config": to_dict(self.parts.saved_config),
                                       "settings": resume_settings(job)},
        )  # fmt: skip
        # Batch-invariant mode computes in the parameters' dtype, as the generator does.
        autocast = (
            None if job.model.batch_invariant else autocast_dtype(job, self.dims, self.device)
        )
        self.step_parts = StepParts(
            self.model, None, self.objective, self.optimizer, self.dims, self.device,
            max_norm=t.max_norm or float("inf"), autocast_dtype=autocast,
            expert_balance=expert_balance(self.model, self.model_config, self.dims, self.device),
        )  # fmt: skip
        self.train_step = TrainStep(self.step_parts, self._before_update, t.skip_nonfinite)
        if self.link is not None:
            return  # the generator ranks generate
        # On-policy: the trainer's own modules generate; with lag, a copy of them does.
        self.gen_model = self.model if r.max_offpolicy_steps == 0 else copy.deepcopy(self.model)
        self.generator = self._new_generator(self.gen_model)

    def _new_generator(self, model: torch.nn.Module) -> Generator:
        """A generator over ``model`` with --rl.generator_slots cache slots of --training.seq_len
        tokens; ConfigError naming both when that cache cannot fit."""
        r, seq_len = self.job.rl, self.job.training.seq_len
        try:
            return Generator(model, max_batch=r.generator_slots, max_len=seq_len,
                             cuda_graphs=self._graphs())  # fmt: skip
        except CacheTooLarge as err:
            most = r.prompts_per_step * r.group_size
            raise ConfigError(
                f"--rl.generator_slots {r.generator_slots}: its cache of that many rollouts of "
                f"--training.seq_len {seq_len} tokens {err.sizes}; lower --rl.generator_slots "
                f"(a step's first round generates {most} rollouts) or --training.seq_len."
            ) from None

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
        job = self.job
        assert self.link is not None
        with torch.device("meta"):
            self.gen_model = build_model(self.model_config)
        self.gen_model.to_empty(device=self.device)
        self.gen_model.to(self.link.dtype).eval()
        self.generator = self._new_generator(self.gen_model)
        own = [p for p in job.checkpoint.exclude_from_loading if p in ("train_state", "rng")]
        self.checkpointer = CheckpointManager(
            replace(job.checkpoint, exclude_from_loading=own), self.output_dir,
            device=self.device, is_rank0=False, parts={}, marker_extra={},
        )  # fmt: skip

    # -- rollouts -------------------------------------------------------------------------------

    def generate(self, step: int, groups: list[int], version: int) -> RolloutBatch:
        """The rollouts of ``groups`` at ``step`` (prompts addressed by step and group)."""
        prompts = [self.prompts.prompt(prompt_index(step, j)) for j in groups]
        self.gen_model.eval()
        parts = self.step_parts
        try:
            with parts.autocast(cache=False) if parts is not None else contextlib.nullcontext():
                return generate_rollouts(
                    self.generator, self.tokenizer, prompts, self.make_env, self.job.rl,
                    seed=self.job.training.seed, step=step, version=version, groups=groups,
                )  # fmt: skip
        finally:
            self.gen_model.train()

    def rollouts(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch from the colocated generator, dynamic sampling included."""
        version = self.version if self.gen_model is self.model else self.gen_version
        first, more = group_plan(self.job.rl)
        return collect(lambda groups: self.generate(step, groups, version), first, more,
                       self.job.rl)  # fmt: skip

    def sync_generator(self) -> float:
        """Pull the newest policy into the generator's copy, in place, and tag it with that
        policy's version (both under the lock the update holds); seconds spent."""
        if self.link is not None or self.gen_model is self.model:
            return 0.0  # disaggregated: the generator ranks receive; on-policy: shared modules
        start = time.perf_counter()
        with self.params_lock:
            if self.gen_version == self.version:
                return 0.0
            cuda = self.device.type == "cuda"
            if cuda:  # the copy reads what the trainer's stream wrote (the optimizer step)
                torch.cuda.current_stream().wait_stream(torch.cuda.default_stream(self.device))
            self.generator.update_weights(
                (name, p.detach()) for name, p in self.model.named_parameters()
            )
            if cuda:  # done before the trainer, once the lock is free, writes them again
                torch.cuda.current_stream().synchronize()
            self.gen_version = self.version
        return time.perf_counter() - start

    def evaluate(self, step: int, sampled: bool) -> dict[str, Any]:
        """The policy's greedy pass@1 on the task's held-out set (and sampled pass@k when
        ``sampled``), with the trainer's own modules, as a metrics record of ``step``."""
        ev, r = self.job.eval, self.job.rl
        if self.eval_generator is None:  # on-policy the rollouts' generator is the same modules
            same = self.gen_model is self.model
            self.eval_generator = self.generator if same else self._new_generator(self.model)
        started = time.perf_counter()
        self.model.eval()
        try:
            with (
                self.step_parts.autocast(cache=False)
                if self.step_parts
                else contextlib.nullcontext()
            ):
                values = evaluate(
                    self.eval_generator, self.tokenizer, HELD_OUT[r.task](ev.problems),
                    CHECKS[r.task], max_new_tokens=ev.max_new_tokens or r.max_new_tokens,
                    k=ev.k if sampled else 0, temperature=ev.temperature,
                    seed=self.job.training.seed,
                )  # fmt: skip
        finally:
            self.model.train()
        return {"step": step, **{f"eval_{k}": v for k, v in values.items()},
                "time_eval_s": time.perf_counter() - started}  # fmt: skip

    def _eval_due(self, step: int) -> bool:
        ev, steps = self.job.eval, self.job.training.steps
        return bool(ev.every) and (step % ev.every == 0 or step == steps)

    # -- the update -----------------------------------------------------------------------------

    def _local(self, batch: Batch) -> Batch:
        return rank_batch(batch, self.dims, self.device)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """``ppo_epochs`` x ``minibatches`` optimizer steps on ``batch``; their metrics."""
        r, d = self.job.rl, self.dims.degrees
        rollouts = batch.rollouts
        advantages = advantages_by_rollout(rollouts, r)
        multiple = d.tp * (2 * d.cp if d.cp > 1 else 1)
        minibatches = []
        for groups in minibatch_groups(sorted({x.group for x in rollouts}), r.minibatches):
            chosen = [i for i, x in enumerate(rollouts) if x.group in set(groups)]
            if not any(_trained(rollouts[i], r) for i in chosen):
                continue  # nothing to train (every reply cut and filtered)
            local = my_micro_batches([rollouts[i] for i in chosen], [advantages[i] for i in chosen],
                                     r, self.dims.dp_rank, self.dims.dp_size, multiple)  # fmt: skip
            minibatches.append([self._local(b) for b in local])
        diff = self._score(minibatches)
        sums: dict[str, float] = {}
        extremes = {"ratio_max": 0.0, "ratio_min": float("inf")}
        firsts: dict[str, float] = {}
        updates = 0
        for _ in range(r.ppo_epochs):
            for micro in minibatches:
                loss, norm, metrics = self.train_step(micro)
                values = _update_values(loss, norm, metrics)
                sums = {k: sums.get(k, 0.0) + v for k, v in values.items()}
                extremes["ratio_max"] = max(extremes["ratio_max"], metrics["ratio_max"].item())
                extremes["ratio_min"] = min(extremes["ratio_min"], -metrics["ratio_min_neg"].item())
                if updates == 0:  # before any update: the generator's policy vs the trainer's
                    diff = max(diff, metrics["logprob_diff_max"].item())
                    firsts = {"ratio_max_first": metrics["ratio_max"].item(),
                              "ratio_min_first": -metrics["ratio_min_neg"].item()}  # fmt: skip
                updates += 1
        means = {k: v / max(updates, 1) for k, v in sums.items()}
        if not updates:
            extremes = {"ratio_max": 1.0, "ratio_min": 1.0}
        zero = {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "kl": 0.0, "ratio_mean": 1.0}
        return zero | means | extremes | firsts | {
            "logprob_diff_max": diff, "updates": float(updates),
            "groups_kept": float(len({x.group for x in rollouts})),
        }  # fmt: skip

    def _before_update(self) -> None:
        """Right before an optimizer step changes the weights: wait for a checkpoint still
        copying them, and hold the weights (``params_lock``) until the step's last update has
        made the next version, so the generator thread never pulls a half-updated policy. The
        forwards and backwards before the first change run unlocked, overlapping its pulls."""
        self.checkpointer.wait_for_staging()
        if not self._holding:
            self.params_lock.acquire()
            self._holding = True

    def _next_version(self, done: bool = True) -> None:
        """The step is done: the weights are the next version (tagged under the lock). Not
        ``done`` (the update raised): only release the lock."""
        if not self._holding:
            self.params_lock.acquire()
        try:
            if done:
                self.step += 1
                self.version = self.step
        finally:
            self._holding = False
            self.params_lock.release()

    def _score(self, minibatches: list[list[Batch]]) -> float:
        """Fill each micro-batch's ``old_logprobs`` with the trainer's own, under the weights
        the step starts from, when the step's updates will move them before the last one reads
        them (``rl.old_logprobs recompute`` with several updates: the first update computes
        them in its own forward otherwise), and ``ref_logprobs`` with the reference model's.
        Returns the largest |trainer - generator| difference seen (0 without a pass)."""
        r, parts = self.job.rl, self.step_parts
        assert parts is not None
        recompute = r.old_logprobs == "recompute" and r.ppo_epochs * r.minibatches > 1
        scorer = SampledLogProbs(r)
        ref_parts = None if self.reference is None else replace(parts, model=self.reference)
        diff = torch.zeros((), device=self.device)  # one host read at the end, not per batch
        for micro in minibatches:
            for b in micro:
                if recompute:
                    old = parts.score(b, scorer).float()
                    b.extras["old_logprobs"] = old
                    gap = (old - b.extras["behavior_logprobs"]).abs()
                    diff = torch.maximum(
                        diff, torch.where(b.labels != IGNORE_INDEX, gap, 0.0).max()
                    )
                if ref_parts is not None:
                    b.extras["ref_logprobs"] = ref_parts.score(b, scorer).float()
        return diff.item()

    # -- the loop -------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        """Run the job; Ctrl-C ends it with TrainingInterrupted on rank 0, saying where it
        stopped (`torchloom rl` adds the command that resumes, as `torchloom train` does)."""
        try:
            return self._train()
        except KeyboardInterrupt:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C stops the wait
                self.checkpointer.wait()  # a save in flight completes (or fails) first
            if not self.dims.is_rank0:
                raise
            latest = self.checkpointer.latest_step_dir()
            raise TrainingInterrupted(self.step, self.job.training.steps, latest) from None
        except Exception:
            if self.step == 0:  # no update trained: the run's files must not block a retry
                self.run.discard_unstarted()
            raise

    def _train(self) -> dict[str, float]:
        if self.is_generator:
            start = self.run.start()
            return _summary(self.job.training.steps, serve(self, start))
        job, t, r = self.job, self.job.training, self.job.rl
        # Trainer ranks trace their steps (generation included: a step waits for its batch);
        # its options and folder are checked before the run writes anything.
        profiler = StepProfiler(job.profiling, self.output_dir, self.dims.rank, self.device)
        first = self.start()
        metrics = MetricsLogger(self.output_dir, job.metrics, t.steps, self.device,
                                self.model_config.flops_per_token(t.seq_len),
                                enabled=self.dims.is_rank0)  # fmt: skip
        metrics.print(
            f"torchloom rl: {job.model.name} {self.model_config.num_params() / 1e6:.2f}M params, "
            f"task {r.task}, {r.prompts_per_step} prompts x {r.group_size} rollouts per update, "
            f"{r.ppo_epochs} epoch(s) x {r.minibatches} minibatch(es), {t.steps} updates, "
            f"max_offpolicy_steps {r.max_offpolicy_steps}"
        )
        if (resumed := self.run.resumed_line(self.step)) is not None:
            metrics.print(resumed)
        if self.link is not None:
            source: OnPolicy | Lagged | Remote = Remote(self)
        elif r.max_offpolicy_steps:
            source = Lagged(self)
        else:
            source = OnPolicy(self)
        rewards: list[float] = []
        # Steps that trained nothing: no group kept (all rewards equal), every rollout left out
        # of the loss, every update skipped as non-finite.
        idle = {"no_signal": 0, "left_out": 0, "nonfinite": 0}
        ev = job.eval
        if self.step == 0 and (ev.every or ev.k):
            metrics.log(self.evaluate(0, sampled=bool(ev.k)))
        try:
            source.start(self.step)
            while self.step < t.steps:
                profiler.step_begins(self.step + 1)
                start = time.perf_counter()
                batch = source.next()
                waited = time.perf_counter() - start
                lr = self.scheduler.get_last_lr()[0]
                self.model.train()
                skipped, done = self.train_step.skipped, False
                try:
                    update = self.update(batch)  # takes params_lock at its first weight change
                    with warnings.catch_warnings():  # a step that trained nothing still counts
                        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                        self.scheduler.step()
                    done = True
                finally:
                    self._next_version(done)  # an interrupted update is no step (Ctrl-C's line)
                source.updated()
                if not update["updates"]:
                    idle["left_out" if update["groups_kept"] else "no_signal"] += 1
                elif self.train_step.skipped - skipped == update["updates"]:
                    idle["nonfinite"] += 1
                train_s = time.perf_counter() - start - waited
                record = self._record(metrics, batch, update, lr, waited, train_s, start)
                rewards.append(record["reward_mean"])
                if metrics.should_log(self.step):
                    metrics.log(record)
                else:
                    metrics.advance(self.step)
                profiler.step_ends(self.step)
                for path in profiler.written:
                    metrics.print(f"wrote {path}")
                profiler.written.clear()
                last = self.step == t.steps
                if self._eval_due(self.step) or (last and ev.k):
                    # Between the generator's batches: on the H200 a lagged run's evaluation
                    # beside its generator thread lost 12-29 points of pass@1, and the batch
                    # generated meanwhile had log-prob gaps of ~30 (the step-0 and last
                    # evaluations, with no generation beside them, were right).
                    with source.hold():
                        metrics.log(self.evaluate(self.step, sampled=last and bool(ev.k)))
                self.run.save_if_due(metrics, self.step, hold=source.hold)
            self.run.finish(metrics)
            self._check_trained(metrics, self.step - first, idle)
            self.run.export(metrics, self.parts.saved_config, self.tokenizer,
                            lambda: full_state_items(self.model))  # fmt: skip
        finally:
            source.stop()
            metrics.close()
        return _summary(self.step - sum(idle.values()), rewards)

    def _check_trained(self, metrics: MetricsLogger, steps: int, idle: dict[str, int]) -> None:
        """Say how many of the run's ``steps`` trained nothing (``idle``, by cause); when none
        trained anything, TrainingError (on every trainer rank alike) with the fixes, before the
        export, as `torchloom train` ends a run whose every step was skipped."""
        r = self.job.rl
        if not any(idle.values()):
            return
        causes = {
            "no_signal": "kept no group: each group's rollouts all got the same reward, and "
            "--rl.filter_zero_variance drops such groups",
            "left_out": "left every rollout out of the loss: an environment error, or a reply "
            "cut at --rl.max_new_tokens with --rl.overlong_filter true",
            "nonfinite": "had every update skipped as non-finite (--training.skip_nonfinite)",
        }
        why = "; ".join(f"{n} {causes[k]}" for k, n in idle.items() if n)
        if sum(idle.values()) < steps:
            metrics.print(f"{sum(idle.values())} of {steps} steps trained nothing ({why}).")
            return
        fixes = []
        if idle["no_signal"]:
            fixes.append(
                "give the groups rewards that differ: "
                + ("--rl.format_reward 0.1 if the task checks a format, " if not r.format_reward
                   else "")
                + "more refill rounds (--rl.max_refill_rounds) or a larger --rl.group_size, or "
                "a stronger starting model (--checkpoint.initial_load_hf); or "
                "--rl.filter_zero_variance false to update on every group"
            )  # fmt: skip
        if idle["left_out"]:
            fixes.append("raise --rl.max_new_tokens or set --rl.overlong_filter false, and look "
                         "for the environment's errors")  # fmt: skip
        if idle["nonfinite"]:
            fixes.append("lower --optimizer.lr or check the starting model")
        which = (
            "the run's one step did not update"
            if steps == 1
            else f"none of the {steps} steps updated"
        )
        raise TrainingError(
            f"Nothing was trained: {which} the policy ({why}). "
            f"{'. '.join(f[:1].upper() + f[1:] for f in fixes)}."
        )

    def start(self) -> int:
        """Start or resume (the run scaffold), then give the generator the policy the run
        continues from: its copy (with lag) was made from the initial weights before the
        checkpoint loaded. Returns the step to continue from."""
        self.step = self.run.start()
        with self.params_lock:
            self.version = self.step
            self.gen_version = -1
        self.sync_generator()
        return self.step

    def _record(self, metrics: MetricsLogger, batch: RolloutBatch, update: dict[str, float],
                lr: float, gen_s: float, train_s: float, start: float) -> dict[str, Any]:  # fmt: skip
        """The step's record: training's fields (``step_record``: tps over the trained tokens,
        memory, ...) and the RL ones (docs/rl.md). Rewards, correctness and lengths are those
        of the step's first round of generation (refills are chosen for their variance)."""
        stats, r = batch.stats, self.job.rl
        first = max(stats.get("first_rollouts", 0), 1)
        trained = sum(_trained(x, r) for x in batch.rollouts) if update["updates"] else 0
        record = metrics.step_record(self.step, update["loss"], update["grad_norm"], lr,
                                     trained, time.perf_counter() - start, gen_s)  # fmt: skip
        rewards = [x.reward for x in batch.rollouts]
        return record | update | {
            "reward_mean": stats.get("first_reward_sum", 0.0) / first,
            "reward_max": max(rewards, default=0.0),
            "trained_reward_mean": sum(rewards) / max(len(rewards), 1),
            "correct_frac": stats.get("first_correct_sum", 0.0) / first,
            "response_len_mean": stats.get("first_generated_tokens", 0.0) / first,
            "truncated_frac": stats.get("truncated", 0.0) / max(stats.get("rollouts", 0), 1),
            "groups_generated": stats.get("groups_generated", 0.0),
            "refill_rounds": stats.get("refill_rounds", 0.0),
            "policy_lag": self.step - 1 - batch.version,
            "gen_tps": stats.get("generated_tokens", 0.0) / max(batch.seconds, 1e-9),
            "train_tps": trained / max(train_s, 1e-9), "weight_sync_s": batch.sync_seconds,
            "time_generate_s": gen_s, "time_rollout_s": batch.seconds, "time_train_s": train_s,
            "time_sync_s": batch.sync_seconds,
        }  # fmt: skip


_OBJECTIVE_SUMS = ("tokens", "clipped", "kl_sum", "ratio_sum", "is_weight_sum", "is_masked")
_OBJECTIVE_MAXIMA = ("logprob_diff_max", "ratio_max", "ratio_min_neg")


def _update_values(
    loss: torch.Tensor, norm: torch.Tensor, metrics: dict[str, torch.Tensor]
) -> dict[str, float]:
    """One optimizer step's loss, gradient norm and token means of the objective's sums (the
    step divided every sum by the same normalizer, so their ratios are token means); the
    layers' and the step's other metrics (MoE balance, expert loads) as they came."""
    tokens = metrics["tokens"].clamp(min=1e-30)
    values = {"loss": loss.item(), "grad_norm": norm.item(),
              "clip_frac": (metrics["clipped"] / tokens).item(),
              "kl": (metrics["kl_sum"] / tokens).item(),
              "ratio_mean": (metrics["ratio_sum"] / tokens).item()}  # fmt: skip
    if "is_weight_sum" in metrics:
        values["is_weight_mean"] = (metrics["is_weight_sum"] / tokens).item()
    if "is_masked" in metrics:
        values["is_masked_frac"] = (metrics["is_masked"] / tokens).item()
    others = {k: v for k, v in metrics.items() if k not in (*_OBJECTIVE_SUMS, *_OBJECTIVE_MAXIMA)}
    return values | {k: v.item() for k, v in others.items() if v.numel() == 1}


def _trained(rollout: Rollout, cfg: Any) -> int:
    """Tokens of ``rollout`` the loss trains on."""
    return sum(rollout.mask[1:]) if trains(rollout, cfg) else 0


def _summary(steps: int, rewards: list[float]) -> dict[str, float]:
    """``steps``: the policy updates the run made (the done line's count)."""
    fifth = max(1, len(rewards) // 5)
    return {"steps": steps, "reward_first": sum(rewards[:fifth]) / fifth,
            "reward_last": sum(rewards[-fifth:]) / fifth}  # fmt: skip


def resume_settings(job: RLJobConfig) -> dict[str, Any]:
    """What a resumed RL run must share with the checkpoint's run: what its prompts are (task,
    seed) and how steps address them (prompts per step), so that it neither repeats nor skips
    one. (--rl.group_size may change: it draws more or fewer rollouts of the same prompts.)"""
    r = job.rl
    return {"--rl.task": r.task, "--training.seed": job.training.seed,
            "--rl.prompts_per_step": r.prompts_per_step}  # fmt: skip


def prepare_initial_model(job: RLJobConfig) -> dict[str, float]:
    """Run ``rl.init_recipes`` when the starting model (--checkpoint.initial_load_hf) is
    missing: each recipe trains with its own defaults unless its output already exists.
    Returns the seconds each recipe that ran took."""
    from torchloom.config.recipes import get_recipe

    for name in job.rl.init_recipes:
        try:
            get_recipe(name)
        except ConfigError as err:
            raise ConfigError(f"--rl.init_recipes: {err}") from None
    start = job.checkpoint.initial_load_hf
    seconds: dict[str, float] = {}
    if not start or Path(start).exists():
        return seconds
    # The recipes can only build their own last output folder's export, not any other path.
    built = None
    if job.rl.init_recipes:
        built = Path(get_recipe(job.rl.init_recipes[-1]).build().output.dir) / "hf"
    if built is None or built.resolve() != Path(start).resolve():
        made = f" (--rl.init_recipes build {built}, not it)" if built else ""
        raise ConfigError(
            f"--checkpoint.initial_load_hf {start} does not exist{made}; point it at a Hugging "
            "Face model folder."
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"--checkpoint.initial_load_hf {start} does not exist, and the recipes that build "
            f"it ({', '.join(job.rl.init_recipes)}) run on one process; run them first "
            f"(torchloom train --recipe NAME), then launch this job again."
        )
    check_writable(Path(job.output.dir))  # before the recipes train (minutes), as RLRunner does
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
