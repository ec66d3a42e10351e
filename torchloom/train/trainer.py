"""The Trainer: parts made by builders (train/builders.py), a step that is a function of them
(train/step.py), and the loop below: fetch the step's micro-batches, step, log, validate, save.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchloom.checkpoint.manager import CheckpointManager, on_rank0
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.data.packing import Batch
from torchloom.models import DecoderConfig
from torchloom.models.components.multimodal import media_flops
from torchloom.parallel import build_parallel_dims, init_distributed, sum_over_data_ranks
from torchloom.parallel.state import full_state_items
from torchloom.train.builders import (
    TrainBuilders,
    autocast_dtype,
    cap_device_memory,
    check_media_encoder,
    check_media_fits,
    check_seq_len,
)
from torchloom.train.cuda_graph import check_cuda_graph_runtime
from torchloom.train.expert_balance import expert_balance
from torchloom.train.job import JobConfig
from torchloom.train.metrics import MetricsLogger, StepWindow
from torchloom.train.output import (
    check_writable,
)
from torchloom.train.profiling import StepProfiler
from torchloom.train.run import RunScaffold
from torchloom.train.step import (
    StepParts,
    TrainingError,
    TrainStep,
    rank_batch,
    validation_loss,
)

__all__ = ["TrainResult", "Trainer", "TrainingError", "TrainingInterrupted"]


class TrainingInterrupted(TrainingError):
    """Ctrl-C stopped the run after ``step``; ``checkpoint`` is the newest complete one (None:
    nothing to resume from)."""

    def __init__(self, step: int, steps: int, checkpoint: str | None) -> None:
        where = (
            f"the last complete checkpoint is {checkpoint}"
            if checkpoint
            else "there is no complete checkpoint to resume from"
        )
        super().__init__(f"Interrupted at step {step} of {steps}; {where}.")
        self.checkpoint = checkpoint


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    val_loss_before: float
    val_loss_after: float
    model_dir: Path | None
    skipped: int = 0
    """Steps --training.skip_nonfinite skipped (non-finite loss or gradient norm)."""


class Trainer:
    """One training job. ``builders`` makes its parts (replace one to change it)."""

    def __init__(self, job: JobConfig, builders: TrainBuilders | None = None) -> None:
        b = builders or TrainBuilders()
        self.job, t = job, job.training
        self.device = init_distributed(t.device)
        cap_device_memory(self.device, t.memory_limit_gib)
        self.dims = build_parallel_dims(job.parallel.following(t.mixed_precision), self.device.type)
        self.is_rank0 = self.dims.is_rank0
        self.output_dir = Path(job.output.dir)
        # Before the data and the model are built: those may take minutes.
        on_rank0(self.is_rank0, lambda: check_writable(self.output_dir))
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if job.model.attn_backend == "flex" and self.device.type == "cpu":
            raise ConfigError(
                "FlexAttention has no backward pass on the CPU in PyTorch, so it cannot train "
                "there; use --model.attn_backend sdpa on the CPU."
            )
        torch.manual_seed(t.seed)
        self.model_config = b.model_config(job)
        check_media_encoder(self.model_config, job.data)  # before the data pass (minutes)
        self.tokenizer, self.train_loader, self.val_loader = b.data(job, self.dims)
        self._check_fits(self.model_config)
        self.objective = b.objective(job)
        self.parts = b.model(job, self.model_config, self.dims, self.device, self.objective)
        self.model, self.pipeline = self.parts.model, self.parts.pipeline
        if self.pipeline is not None:
            self.pipeline.check_batch_size(self.train_loader.micro_batch_size)
        self.optimizer = b.optimizer(self.model, job.optimizer, self.device)
        self.scheduler = b.lr_scheduler(self.optimizer, job.lr_schedule, t.steps)
        self.checkpointer = CheckpointManager(
            job.checkpoint, self.output_dir, device=self.device, is_rank0=self.is_rank0,
            parts=b.state(self.parts, self.optimizer, self.scheduler, self.train_loader),
            marker_extra={"run": "train", "family": job.model.name,
                          "model_config": to_dict(self.parts.saved_config)},
        )  # fmt: skip
        self.step_parts = StepParts(
            self.model, self.pipeline, self.objective, self.optimizer, self.dims, self.device,
            max_norm=t.max_norm or float("inf"),
            autocast_dtype=autocast_dtype(job, self.dims, self.device),
            expert_balance=expert_balance(self.model, self.model_config, self.dims, self.device),
        )  # fmt: skip
        if t.cuda_graph:
            compute_dtype = self.step_parts.autocast_dtype or next(self.model.parameters()).dtype
            check_cuda_graph_runtime(self.device, self.dims.world_size, self.model, compute_dtype)
        self.train_step = TrainStep(
            self.step_parts,
            self.checkpointer.wait_for_staging,
            t.skip_nonfinite,
            t.cuda_graph,
            check_late=True,
        )
        self.run = RunScaffold(job, self.checkpointer, self.is_rank0)
        self.step = 0

    @property
    def saved_config(self) -> DecoderConfig:
        return self.parts.saved_config

    def _check_fits(self, config: DecoderConfig) -> None:
        if config.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
                f"holds only {config.vocab_size}; set "
                f"--model.overrides '{{\"vocab_size\": {self.tokenizer.vocab_size}}}' or use a "
                "tokenizer that matches the model."
            )
        check_seq_len(config, self.job.training.seq_len, self.job.checkpoint.initial_load_hf)
        check_media_fits(config, self.tokenizer, self.job.data)

    def _local(self, batch: Batch) -> Batch:
        return rank_batch(batch, self.dims, self.device)

    def validate(self) -> float:
        """The objective's mean on the held-out batches (nan when there is no validation split)."""
        if self.val_loader is None:
            return float("nan")
        per_batch = self.val_loader.batch_size * self.val_loader.dp_size
        num_batches = -(-self.job.training.val_sequences // per_batch)
        batches = (self._local(b) for b in self.val_loader.batches(num_batches))
        return validation_loss(self.step_parts, batches)

    def train(self) -> TrainResult:
        """Run the job; Ctrl-C ends it with TrainingInterrupted, saying how to continue."""
        try:
            return self._train()
        except KeyboardInterrupt:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C stops the wait
                self.checkpointer.wait()  # a save in flight completes (or fails) first
            latest = self.checkpointer.latest_step_dir() if self.is_rank0 else None
            raise TrainingInterrupted(self.step, self.job.training.steps, latest) from None
        except Exception:
            if self.step == 0:  # nothing trained: the run's files must not block a retry
                self.run.discard_unstarted()
            raise

    def _train(self) -> TrainResult:
        job, t = self.job, self.job.training
        # Its options and folder are checked before the run writes anything.
        profiler = StepProfiler(job.profiling, self.output_dir, self.dims.rank, self.device)
        self.step = first = self.run.start()
        self.train_step.step = self.step
        flops = self.model_config.flops_per_token(t.seq_len)
        metrics = MetricsLogger(
            self.output_dir, job.metrics, t.steps, self.device, flops, enabled=self.is_rank0
        )
        metrics.print(self._banner(metrics))
        if (resumed := self.run.resumed_line(self.step)) is not None:
            metrics.print(resumed)
        validating = self.val_loader is not None  # no held-out split: no val_loss records
        val_before = self.validate()
        if validating and self.step == 0:
            metrics.log({"step": 0, "val_loss": val_before})
        elif validating:  # printed only: metrics.jsonl reads as the uninterrupted run's did
            metrics.print(f"step {self.step}  val_loss {val_before:.4g} (resumed weights)")
        first_loss = last_loss = float("nan")
        self.model.train()
        tokens_per_step = t.global_batch_sequences * t.seq_len
        window = StepWindow()
        previous: torch.cuda.Event | None = None  # the end of the last step queued unsynced
        try:
            while self.step < t.steps:
                profiler.step_begins(self.step + 1)
                window.begin()
                start = time.perf_counter()
                loaded = self.train_loader.next_step()
                logged = metrics.should_log(self.step + 1)
                media = self._media_flops(loaded) if logged else None  # from the host's grids
                batches = [self._local(b) for b in loaded]
                data_seconds = time.perf_counter() - start
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                loss, grad_norm, step_metrics = self.train_step(batches)
                self.scheduler.step()
                self.step += 1
                window.add_step(data_seconds)
                val_due = validating and bool(t.val_interval) and self.step % t.val_interval == 0
                val_due = val_due and self.step < t.steps
                # The host waits for the GPU only where it needs a value (a logged step, a
                # validation, a save: a checkpoint never holds a step whose loss went
                # non-finite, a profiled step); elsewhere it queues the next step first.
                if (
                    logged
                    or math.isnan(first_loss)  # TrainResult's first loss (a resumed run's too)
                    or val_due
                    or self.checkpointer.should_save(self.step, t.steps)
                    or profiler.covers(self.step)
                ):
                    self.train_step.check()
                    last_loss = loss.item()
                    window.synced()
                    previous = None
                else:
                    previous = self._wait_for_step_before(previous)
                profiler.step_ends(self.step)
                for path in profiler.written:
                    metrics.print(f"wrote {path}")
                profiler.written.clear()
                first_loss = last_loss if math.isnan(first_loss) else first_loss
                if logged:
                    seconds, data_wait = window.take()
                    record = metrics.step_record(
                        self.step, last_loss, grad_norm.item(), lr, tokens_per_step, seconds,
                        data_wait, num_devices=self.dims.world_size, media_flops=media.item(),
                    )  # fmt: skip
                    metrics.log(record | {k: v.item() for k, v in step_metrics.items()})
                else:
                    metrics.advance(self.step)
                if val_due:
                    metrics.log({"step": self.step, "val_loss": self.validate()})
                self.run.save_if_due(metrics, self.step, self.train_loader.tokens_seen)
            self.run.finish(metrics)
            val_after = self.validate()  # the run trained at least one step (NothingToTrain)
            if validating:
                metrics.log({"step": self.step, "val_loss": val_after})
            self._check_trained(self.step - first, val_after)
            model_dir = self._export(metrics)
        finally:
            metrics.close()
        return TrainResult(self.step, first_loss, last_loss, val_before, val_after, model_dir,
                           self.train_step.skipped)  # fmt: skip

    def _check_trained(self, steps: int, val_after: float) -> None:
        """TrainingError (on every rank alike) for a run that ends without a model worth
        exporting: every one of its ``steps`` skipped, non-finite weights, or a non-finite
        validation loss. One host sync and one collective, at the end only."""
        skipped = self.train_step.skipped
        why = f" ({skipped} of {steps} steps were skipped as non-finite)" if skipped else ""
        fix = (
            "lower --optimizer.lr, lengthen --lr_schedule.warmup_steps, or check the "
            "initialization (--model.overrides init_std) and the data."
        )
        if steps and skipped == steps:
            raise TrainingError(
                f"Every one of the {steps} steps had a non-finite loss or gradient norm and was "
                f"skipped, so nothing was trained; {fix}"
            )
        if not self._weights_finite():
            raise TrainingError(f"The weights are non-finite after training{why}; {fix}")
        if self.val_loader is not None and not math.isfinite(val_after):
            raise TrainingError(f"The validation loss after training is {val_after}{why}; {fix}")

    @torch.no_grad()
    def _weights_finite(self) -> bool:
        """Whether every parameter shard of every rank is finite."""
        shards = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        finite = torch.stack([s.isfinite().all() for s in shards]).all().to(torch.int32)
        if dist.is_initialized() and self.dims.world_size > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite)

    def _wait_for_step_before(self, previous: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """With this step queued, wait for the one before it and check its loss: the host runs
        at most one step ahead of the GPU. Returns the event this step's end records (on CUDA;
        elsewhere every op has finished already, and the check is as late all the same)."""
        if previous is not None:
            previous.synchronize()
        self.train_step.check(through=self.step - 1)
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _media_flops(self, batches: list[Batch]) -> torch.Tensor:
        """The media encoders' FLOPs on this step's images (and clips), summed over the data
        ranks (from the config and the grids: no model pass, whatever the layout)."""
        if getattr(self.model_config, "vision", None) is None:  # the same on every rank
            return torch.zeros((), dtype=torch.float64)
        local = sum(media_flops(self.model_config, b.media) for b in batches)
        total = torch.tensor(float(local), dtype=torch.float64, device=self.device)
        return sum_over_data_ranks(total, self.dims)

    def _banner(self, metrics: MetricsLogger) -> str:
        job, t = self.job, self.job.training
        hf_dir = job.checkpoint.initial_load_hf
        name = (
            f"{job.model.name} from {hf_dir}" if hf_dir else f"{job.model.name}/{job.model.flavor}"
        )
        d = self.dims.degrees
        layout = (
            f"{self.dims.world_size} process(es): dp_replicate {d.dp_replicate} x dp_shard "
            f"{d.dp_shard} x cp {d.cp} x tp {d.tp} x pp {d.pp}"
        )
        return (
            f"torchloom: {name} {self.model_config.num_params() / 1e6:.2f}M params on "
            f"{metrics.device_name}, {layout}; {t.steps} steps of {t.global_batch_sequences} x "
            f"{t.seq_len} tokens, {self.train_loader.grad_accum_steps} micro-batch(es) per step "
            "per rank"
            + ("" if metrics.peak_tflops else "; MFU n/a (no known peak for this device)")
        )

    def _export(self, metrics: MetricsLogger) -> Path | None:
        """Write the final model (and an HF folder when asked); see ``export_final_model``."""
        pipeline = self.pipeline  # rank 0 receives the other stages' tensors
        return self.run.export(
            metrics, self.saved_config, self.tokenizer,
            lambda: pipeline.full_state_items() if pipeline else full_state_items(self.model),
        )  # fmt: skip
