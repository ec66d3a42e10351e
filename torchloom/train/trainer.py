"""The training loop. Collaborators (mesh, data, model, optimizer, metrics) are built in
``__init__``; ``train`` reads top to bottom: fetch the step's micro-batches, accumulate
gradients, clip, step, log."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from torchloom.checkpoint.hf import load_hf_weights, model_config_from_hf, save_hf
from torchloom.checkpoint.manager import CheckpointManager, on_rank0
from torchloom.checkpoint.model_io import write_model_folder
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.data import build_dataloaders
from torchloom.kernels.float8 import check_float8_device
from torchloom.models import TransformerConfig, build_model, get_model_spec, resolve_model_config
from torchloom.parallel import (
    as_local,
    build_parallel_dims,
    global_label_count,
    init_distributed,
    loss_context,
    parallelize,
    sum_over_data_ranks,
)
from torchloom.parallel.context_parallel import shard_sequence
from torchloom.parallel.pipeline import Pipeline, build_pipeline
from torchloom.parallel.state import full_state_items
from torchloom.train.compile import compile_regions
from torchloom.train.cuda_graph import StepGraph, check_cuda_graph_runtime
from torchloom.train.job import JobConfig
from torchloom.train.metrics import MetricsLogger
from torchloom.train.optim import build_lr_scheduler, build_optimizer, clip_gradients
from torchloom.train.output import (
    check_output_dir,
    check_writable,
    remove_outputs,
    truncate_metrics,
)
from torchloom.train.profiling import StepProfiler
from torchloom.train.remat import apply_remat


class TrainingError(RuntimeError):
    """The run cannot go on (for example a non-finite loss); the message says what to change."""


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


class Trainer:
    def __init__(self, job: JobConfig) -> None:
        self.job = job
        t = job.training
        self.device = init_distributed(t.device)
        self.dims = build_parallel_dims(job.parallel, self.device.type)
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
        dp_size = self.dims.dp_size
        self.tokenizer, self.train_loader, self.val_loader = build_dataloaders(
            job.data,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_sequences,
            micro_batch_size=t.micro_batch_size or max(1, t.global_batch_sequences // dp_size),
            dp_rank=self.dims.dp_rank,
            dp_size=dp_size,
            seed=t.seed,
        )
        hf_dir = job.checkpoint.initial_load_hf
        if hf_dir:
            self.model_config = model_config_from_hf(Path(hf_dir), job.model)
        else:
            self.model_config = resolve_model_config(job.model)
        self._check_fits(self.model_config)
        check_float8_device(self.model_config.float8, self.device)
        # What saved models record: float8 is how this run computes, not part of the model.
        self.saved_config = replace(self.model_config, float8="none")
        with torch.device("meta"):
            self.model = build_model(self.model_config, job.model.name)
        self.model.to_empty(device=self.device)
        # Identical full weights on every rank first: parallelize keeps rank 0's values.
        if hf_dir:
            load_hf_weights(self.model, Path(hf_dir))
        else:
            self.model.init_weights(generator=torch.Generator(self.device).manual_seed(t.seed))
        spec = get_model_spec(job.model.name)

        if self.dims.tp_enabled and spec.tp_plan is None:
            raise ConfigError(
                f"Model '{spec.name}' declares no tensor-parallel plan; set --parallel.tp 1."
            )
        self.pipeline: Pipeline | None = None
        if self.dims.degrees.pp > 1:
            # The stages keep their share of the full model's modules; self.model becomes the
            # list of this rank's stages (optimizer, clipping and train/eval modes use it).
            self.pipeline = build_pipeline(
                self.model, self.dims, seq_len=t.seq_len, tp_plan=spec.tp_plan,
                device=self.device, wrap_blocks=self._wrap_blocks,
            )  # fmt: skip
            self.pipeline.check_batch_size(self.train_loader.micro_batch_size)
            self.model = self.pipeline.stages
        else:
            self.model = parallelize(
                self.model, self.dims, seq_len=t.seq_len, tp_plan=spec.tp_plan,
                wrap_blocks=self._wrap_blocks,
            )  # fmt: skip
        self.optimizer = build_optimizer(self.model, job.optimizer, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, job.lr_schedule, t.steps)
        self.step_graph: StepGraph | None = None
        if t.cuda_graph:
            check_cuda_graph_runtime(self.device, self.dims.world_size)
            self.step_graph = StepGraph(self._captured_step, self.optimizer)
        state_model = self.model if self.pipeline is None else self.pipeline.local_model()
        self.checkpointer = CheckpointManager(
            job.checkpoint, self.output_dir, model=state_model, optimizer=self.optimizer,
            scheduler=self.scheduler, loader=self.train_loader, device=self.device,
            marker_extra={"family": job.model.name, "model_config": to_dict(self.saved_config)},
            is_rank0=self.is_rank0,
        )  # fmt: skip
        # With FSDP the compute dtype is its mixed-precision policy; otherwise autocast.
        self.autocast_dtype = None
        if self.dims.fsdp_mesh is None and (
            t.mixed_precision == "bf16"
            or (t.mixed_precision == "auto" and self.device.type == "cuda")
        ):
            self.autocast_dtype = torch.bfloat16
        self.step = 0

    def _wrap_blocks(self, model: torch.nn.Module) -> None:
        """Recomputation, then regional compile (parallelize calls this between TP and FSDP)."""
        apply_remat(model.layers, self.job.remat, self.job.compile.enabled)
        # Measured on torch 2.13 (gloo, inductor and aot_eager): with FSDP x TP, compiled
        # sequence-parallel norms give wrong weight gradients (grad norm 0.41 instead of 0.53),
        # so there the norms stay eager and the rest of each block is compiled.
        fsdp_tp = self.dims.tp_enabled and self.dims.fsdp_mesh is not None
        compile_regions(model, self.job.compile, eager_types=("RMSNorm",) if fsdp_tp else ())

    def _check_fits(self, config: TransformerConfig) -> None:
        t = self.job.training
        if config.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocabulary "
                f"holds only {config.vocab_size}; set "
                f"--model.overrides '{{\"vocab_size\": {self.tokenizer.vocab_size}}}' or use a "
                "tokenizer that matches the model."
            )
        if t.seq_len > config.max_seq_len:
            raise ConfigError(
                f"--training.seq_len {t.seq_len} exceeds the model's max_seq_len "
                f"{config.max_seq_len}; lower seq_len or set "
                f"--model.overrides '{{\"max_seq_len\": {t.seq_len}}}'."
            )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _local(self, batch):
        """The batch on this rank's device; under context parallelism, this rank's tokens."""
        batch = batch.to(self.device, non_blocking=True)
        if self.dims.degrees.cp > 1:
            rank, size = self.dims.local_rank("cp"), self.dims.size("cp")
            batch = batch.map_tokens(lambda t: shard_sequence(t, rank, size))
        return batch

    def _token_loss_sum(self, batch) -> torch.Tensor:
        with self._autocast():
            return self.model(batch.tokens, batch.positions, batch.doc_ids, labels_BT=batch.labels)

    def train_step(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over this step's micro-batches, then clip and step (all replayed from
        one CUDA graph with --training.cuda_graph). Returns the mean token loss of the global
        batch and the gradient norm (before clipping)."""
        num_tokens = global_label_count(
            sum(b.num_label_tokens for b in batches), self.dims, self.device
        )
        if self.step_graph is not None:
            self.checkpointer.wait_for_staging()  # an async save still copying the weights
            loss_sum, grad_norm = self.step_graph(batches, num_tokens)
            self._check_finite(loss_sum)  # after the step: a captured step cannot skip it
        else:
            loss_sum, grad_norm = self._backward_and_clip(batches, num_tokens)
            # With skip_nonfinite the check decides before the step (a host sync); otherwise
            # the step is queued first, so its launches overlap the GPU's backward, and the
            # check after it raises (the run stops before any save).
            skip = self.job.training.skip_nonfinite
            if not skip or self._check_finite(loss_sum):
                self.checkpointer.wait_for_staging()
                self.optimizer.step()
            if not skip:
                self._check_finite(loss_sum)
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_sum, grad_norm

    def _captured_step(
        self, batches: list, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step that --training.cuda_graph captures: the same kernels as the eager step."""
        loss_sum, grad_norm = self._backward_and_clip(batches, num_tokens)
        self.optimizer.step()
        return loss_sum, grad_norm

    def _backward_and_clip(
        self, batches: list, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the micro-batches' gradients and clip them; no host sync (a CUDA graph
        captures this). Returns (global mean token loss, gradient norm before clipping)."""
        loss_sum = torch.zeros((), device=self.device)
        for batch in batches:
            if self.pipeline is not None:
                with self._autocast():
                    loss_sum += self.pipeline.step(batch, num_tokens)
                continue
            with loss_context(self.dims):
                loss = self._token_loss_sum(batch) / num_tokens
                loss.backward()
            loss_sum += as_local(loss.detach())
        loss_sum = self._sum_over_ranks(loss_sum)  # the same value on every rank
        max_norm = self.job.training.max_norm or float("inf")
        pp_mesh = self.dims.mesh("pp")
        norm = clip_gradients(self.optimizer, self.model.parameters(), max_norm, pp_mesh)
        return loss_sum, norm

    def _check_finite(self, loss_sum: torch.Tensor) -> bool:
        """True for a finite loss; otherwise raise, or False with --training.skip_nonfinite."""
        if torch.isfinite(loss_sum):
            return True
        if not self.job.training.skip_nonfinite:
            raise TrainingError(
                f"The loss became {loss_sum.item()} at step {self.step + 1}. Lower "
                "--optimizer.lr, lengthen --lr_schedule.warmup_steps or check the data; "
                "--training.skip_nonfinite true skips such steps instead."
            )
        return False

    def _sum_over_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks and, under pipeline parallelism, from the last stage."""
        loss = sum_over_data_ranks(loss, self.dims)
        return loss if self.pipeline is None else self.pipeline.reduce_over_stages(loss)

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss on the held-out batches (nan when there is no validation split)."""
        if self.val_loader is None:
            return float("nan")
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), dtype=torch.int64, device=self.device)
        per_batch = self.val_loader.batch_size * self.val_loader.dp_size
        num_batches = -(-self.job.training.val_sequences // per_batch)
        for batch in self.val_loader.batches(num_batches):
            batch = self._local(batch)
            if self.pipeline is not None:
                with self._autocast():
                    total += self.pipeline.eval_loss_sum(batch)
            else:
                with loss_context(self.dims):
                    total += as_local(self._token_loss_sum(batch))
            count += batch.num_label_tokens
        self.model.train()
        # Every rank of a data group counts the same labels, so counts sum over data ranks only.
        total, count = self._sum_over_ranks(total), sum_over_data_ranks(count, self.dims)
        return (total / count.clamp(min=1)).item()

    def train(self) -> TrainResult:
        """Run the job; Ctrl-C ends it with TrainingInterrupted, saying how to continue."""
        try:
            return self._train()
        except KeyboardInterrupt:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C stops the wait
                self.checkpointer.wait()  # a save in flight completes (or fails) first
            latest = self.checkpointer.latest_step_dir() if self.is_rank0 else None
            raise TrainingInterrupted(self.step, self.job.training.steps, latest) from None

    def _train(self) -> TrainResult:
        job, t = self.job, self.job.training
        self.step, kept = self._start()
        start_step = self.step
        flops = self.model_config.flops_per_token(t.seq_len)
        metrics = MetricsLogger(
            self.output_dir, job.metrics, t.steps, self.device, flops, enabled=self.is_rank0
        )
        metrics.print(self._banner(metrics))
        if self.checkpointer.loaded_step is not None:
            then = f"continuing at step {self.step + 1}" if self.step < t.steps else "no steps left"
            metrics.print(
                f"resumed from {self.checkpointer.storage.step_dir(self.checkpointer.loaded_step)}"
                f" in {self.checkpointer.load_seconds:.2f} s; {then}"
            )
        val_before = self.validate()
        if self.step == 0:
            metrics.log({"step": 0, "val_loss": val_before})
        else:  # printed only: metrics.jsonl reads as the uninterrupted run's did
            metrics.print(f"step {self.step}  val_loss {val_before:.4g} (resumed weights)")
        first_loss = last_loss = float("nan")
        self.model.train()
        tokens_per_step = t.global_batch_sequences * t.seq_len
        profiler = StepProfiler(job.profiling, self.output_dir, self.dims.rank, self.device)
        try:
            while self.step < t.steps:
                profiler.step_begins(self.step + 1)
                start = time.perf_counter()
                batches = [self._local(b) for b in self.train_loader.next_step()]
                data_seconds = time.perf_counter() - start
                lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
                loss, grad_norm = self.train_step(batches)
                self.step += 1
                last_loss = loss.item()  # syncs, so the step time below is honest
                profiler.step_ends(self.step)
                for path in profiler.written:
                    metrics.print(f"wrote {path}")
                profiler.written.clear()
                first_loss = last_loss if math.isnan(first_loss) else first_loss
                if metrics.should_log(self.step):
                    seconds = time.perf_counter() - start
                    metrics.log(
                        metrics.step_record(
                            self.step, last_loss, grad_norm.item(), lr, tokens_per_step,
                            seconds, data_seconds, num_devices=self.dims.world_size,
                        )
                    )  # fmt: skip
                else:
                    metrics.advance(self.step)
                if t.val_interval and self.step % t.val_interval == 0 and self.step < t.steps:
                    metrics.log({"step": self.step, "val_loss": self.validate()})
                if self.checkpointer.should_save(self.step, t.steps):
                    self.checkpointer.save(self.step, self.train_loader.tokens_seen)
                for record in self.checkpointer.poll():
                    metrics.log(record)
            for record in self.checkpointer.finish():
                metrics.log(record)
            val_after = self.validate() if self.step > start_step else val_before
            # A run resumed at its last step may have logged this record already.
            if not any(r["step"] == self.step and "val_loss" in r for r in kept):
                metrics.log({"step": self.step, "val_loss": val_after})
            model_dir = self._export(metrics)
        finally:
            metrics.close()
        return TrainResult(self.step, first_loss, last_loss, val_before, val_after, model_dir)

    def _start(self) -> tuple[int, list[dict]]:
        """Choose the checkpoint and check the folders before any file is written or removed;
        then clean up, load, and record the resolved config. Returns the step to continue from
        and the metrics records kept from before it."""
        job, ckpt = self.job, self.checkpointer
        step = ckpt.choose(job.training.steps)
        replaced = on_rank0(self.is_rank0, lambda: self._check_folders(step is not None))
        if self.is_rank0:
            remove_outputs(self.output_dir, replaced)
        if job.checkpoint.resume or job.checkpoint.interval:  # else the folder is not this run's
            ckpt.clean_interrupted()
        kept: list[dict] = []
        if step is not None:
            step = ckpt.load(step)
            if self.is_rank0:
                kept = truncate_metrics(self.output_dir / "metrics.jsonl", step)
        if self.is_rank0:  # only now: a refused resume must not replace the run's config
            (self.output_dir / "config.json").write_text(json.dumps(to_dict(job), indent=2) + "\n")
        return step or 0, kept

    def _check_folders(self, resuming: bool) -> list[str]:
        """Rank 0: refuse an output or checkpoint folder this run may not write into; returns
        the earlier run's outputs that --output.overwrite replaces."""
        job, storage = self.job, self.checkpointer.storage
        replaced = check_output_dir(
            self.output_dir, job.output.overwrite, resuming, job.checkpoint.resume, storage.root_url
        )
        # The output folder's own checkpoints/ is the output rules' (refused or replaced).
        own = storage.root_url == os.path.abspath(self.output_dir / "checkpoints")
        if job.checkpoint.interval and not job.checkpoint.resume and not own:
            self.checkpointer.check_unused()
        return replaced

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
        """Write the final model (and an HF folder when asked). Every rank takes part in
        gathering the full tensors; rank 0 alone writes."""
        job = self.job
        model_dir = self.output_dir / "model"
        if job.checkpoint.save_final_model:
            self._write(
                lambda items: write_model_folder(
                    model_dir, job.model.name, self.saved_config, items, self.tokenizer
                )
            )
            metrics.print(f"saved the model to {model_dir}")
        if job.checkpoint.export_hf:
            hf_dir = self.output_dir / "hf"
            self._write(
                lambda items: save_hf(
                    hf_dir, job.model.name, self.saved_config, items, self.tokenizer
                )
            )
            metrics.print(f"exported a Hugging Face folder to {hf_dir}")
        return model_dir if job.checkpoint.save_final_model else None

    def _write(self, write) -> None:
        if self.pipeline is not None:  # rank 0 receives the other stages' tensors
            items: Iterator = self.pipeline.full_state_items()
        else:
            items = full_state_items(self.model)
        if self.is_rank0:
            write(items)
        for _ in items:  # the other ranks still take part in every gather
            pass
