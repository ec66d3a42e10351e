"""The training loop. Collaborators (data, model, optimizer, metrics) are built in `setup`;
`train` reads top to bottom: fetch the step's micro-batches, accumulate gradients, clip, step."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchloom.checkpoint.model_io import save_model
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.data import build_dataloaders
from torchloom.job import JobConfig
from torchloom.models import build_model, resolve_model_config
from torchloom.train.loss import cross_entropy_sum
from torchloom.train.metrics import MetricsLogger
from torchloom.train.optim import build_lr_scheduler, build_optimizer

# Files a run owns in its output folder; --output.overwrite removes exactly these.
_RUN_OUTPUTS = ("config.json", "metrics.jsonl", "tb", "model", "metrics.png")


class TrainingError(RuntimeError):
    """The run cannot go on (for example a non-finite loss); the message says what to change."""


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    val_loss_before: float
    val_loss_after: float
    model_dir: Path | None


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--training.device cuda was asked for, but no CUDA GPU is visible.")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def prepare_output_dir(path: Path, overwrite: bool) -> None:
    """Create the run folder; refuse to mix with an earlier run unless asked to replace it."""
    existing = [name for name in _RUN_OUTPUTS if (path / name).exists()]
    if existing and not overwrite:
        raise ConfigError(
            f"The output folder {path} already holds a run ({', '.join(existing)}). Choose another "
            "--output.dir, or pass --output.overwrite true to replace those files."
        )
    for name in existing:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    path.mkdir(parents=True, exist_ok=True)


class Trainer:
    def __init__(self, job: JobConfig) -> None:
        self.job = job
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.parallel = job.parallel.resolve(world_size)
        if world_size > 1:
            raise ConfigError(
                f"{world_size} processes were launched, but this build trains on one process only "
                "(distributed layouts arrive with the parallelism work); run without torchrun."
            )
        self.device = pick_device(job.training.device)
        self.output_dir = Path(job.output.dir)
        self.autocast_dtype = self._compute_dtype()
        if job.training.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if job.model.attn_backend == "flex" and self.device.type == "cpu":
            raise ConfigError(
                "FlexAttention has no backward pass on the CPU in PyTorch, so it cannot train "
                "there; use --model.attn_backend sdpa on the CPU."
            )

        t = job.training
        torch.manual_seed(t.seed)
        self.tokenizer, self.train_loader, self.val_loader = build_dataloaders(
            job.data,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_sequences,
            micro_batch_size=t.micro_batch_size
            or t.global_batch_sequences // self.parallel.dp_size,
            dp_rank=0,
            dp_size=self.parallel.dp_size,
            seed=t.seed,
        )
        self.model_config = resolve_model_config(job.model)
        if self.model_config.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
                f"holds only {self.model_config.vocab_size}; set "
                f"--model.overrides '{{\"vocab_size\": {self.tokenizer.vocab_size}}}' or use a "
                "tokenizer that matches the model."
            )
        if t.seq_len > self.model_config.max_seq_len:
            raise ConfigError(
                f"--training.seq_len {t.seq_len} exceeds the model's max_seq_len "
                f"{self.model_config.max_seq_len}; lower seq_len or set "
                f"--model.overrides '{{\"max_seq_len\": {t.seq_len}}}'."
            )
        with torch.device("meta"):
            self.model = build_model(self.model_config, job.model.name)
        self.model.to_empty(device=self.device)
        self.model.init_weights(generator=torch.Generator(self.device).manual_seed(t.seed))
        self.optimizer = build_optimizer(self.model, job.optimizer, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, job.lr_schedule, t.steps)
        self.step = 0

    def _compute_dtype(self) -> torch.dtype | None:
        choice = self.job.training.mixed_precision
        if choice == "bf16" or (choice == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over this step's micro-batches, then clip and step.
        Returns the mean token loss of the global batch and the gradient norm (before clipping)."""
        num_tokens = sum(b.num_label_tokens for b in batches)
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            with self._autocast():
                logits = self.model(batch.tokens, batch.positions, batch.doc_ids)
            loss = cross_entropy_sum(logits, batch.labels) / num_tokens
            loss.backward()
            loss_sum += loss.detach()
        max_norm = self.job.training.max_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if not torch.isfinite(loss_sum):
            if not self.job.training.skip_nonfinite:
                raise TrainingError(
                    f"The loss became {loss_sum.item()} at step {self.step + 1}. Lower "
                    "--optimizer.lr, lengthen --lr_schedule.warmup_steps or check the data; "
                    "--training.skip_nonfinite true skips such steps instead."
                )
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum, grad_norm

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss on the held-out batches (nan when there is no validation split)."""
        if self.val_loader is None:
            return float("nan")
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        per_batch = self.val_loader.batch_size * self.val_loader.dp_size
        num_batches = -(-self.job.training.val_sequences // per_batch)
        for batch in self.val_loader.batches(num_batches):
            batch = batch.to(self.device)
            with self._autocast():
                logits = self.model(batch.tokens, batch.positions, batch.doc_ids)
            total += cross_entropy_sum(logits, batch.labels)
            count += batch.num_label_tokens
        self.model.train()
        return (total / max(count, 1)).item()

    def train(self) -> TrainResult:
        job, t = self.job, self.job.training
        prepare_output_dir(self.output_dir, job.output.overwrite)
        (self.output_dir / "config.json").write_text(json.dumps(to_dict(job), indent=2) + "\n")
        spec_flops = self.model_config.flops_per_token(t.seq_len)
        metrics = MetricsLogger(self.output_dir, job.metrics, t.steps, self.device, spec_flops)
        metrics.print(
            f"torchloom: {job.model.name}/{job.model.flavor} "
            f"{self.model_config.num_params() / 1e6:.2f}M params on {metrics.device_name}; "
            f"{t.steps} steps of {t.global_batch_sequences} x {t.seq_len} tokens, "
            f"{self.train_loader.grad_accum_steps} micro-batch(es) per step"
            + ("" if metrics.peak_tflops else "; MFU n/a (no known peak for this device)")
        )
        val_before = self.validate()
        metrics.log({"step": 0, "val_loss": val_before})
        first_loss = last_loss = float("nan")
        self.model.train()
        try:
            while self.step < t.steps:
                start = time.perf_counter()
                batches = [
                    b.to(self.device, non_blocking=True) for b in self.train_loader.next_step()
                ]
                data_seconds = time.perf_counter() - start
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                loss, grad_norm = self.train_step(batches)
                self.step += 1
                last_loss = loss.item()  # syncs, so the step time below is honest
                first_loss = last_loss if self.step == 1 else first_loss
                if metrics.should_log(self.step):
                    tokens = sum(b.tokens.numel() for b in batches)
                    metrics.log(
                        metrics.step_record(
                            self.step,
                            last_loss,
                            grad_norm.item(),
                            lr,
                            tokens,
                            time.perf_counter() - start,
                            data_seconds,
                        )
                    )
                else:
                    metrics.advance(self.step)
                if t.val_interval and self.step % t.val_interval == 0 and self.step < t.steps:
                    metrics.log({"step": self.step, "val_loss": self.validate()})
            val_after = self.validate()
            metrics.log({"step": self.step, "val_loss": val_after})
            model_dir = None
            if job.checkpoint.save_final_model:
                model_dir = self.output_dir / "model"
                save_model(self.model, job.model.name, self.model_config, model_dir, self.tokenizer)
                metrics.print(f"saved the model to {model_dir}")
        finally:
            metrics.close()
        return TrainResult(self.step, first_loss, last_loss, val_before, val_after, model_dir)
