"""The job config: one typed tree composed of every component's own config section."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchloom.checkpoint.config import CheckpointConfig
from torchloom.config.errors import ConfigError, warn
from torchloom.config.fields import warn_unused_options
from torchloom.data.config import DataConfig
from torchloom.models.components.transformer import TransformerConfig
from torchloom.models.config import ModelConfig
from torchloom.models.transforms import apply_transforms, list_transforms
from torchloom.parallel.config import ParallelConfig
from torchloom.train.compile import CompileConfig
from torchloom.train.config import TrainingConfig
from torchloom.train.metrics import MetricsConfig
from torchloom.train.optim import LRScheduleConfig, OptimizerConfig
from torchloom.train.profiling import ProfilingConfig
from torchloom.train.remat import RematConfig


@dataclass
class OutputConfig:
    dir: str = "outputs/run"
    """Folder for config.json, metrics.jsonl, TensorBoard events and the saved model."""
    overwrite: bool = False
    """Replace the outputs of an earlier run in that folder (otherwise such a folder is refused,
    so nothing already there is ever mixed up or lost)."""

    def validate(self) -> None:
        if not self.dir.strip():
            raise ConfigError(
                "--output.dir is empty; name the run's folder, e.g. --output.dir outputs/run "
                "(. for the current folder)."
            )


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def validate(self) -> None:
        """Checks that span sections (each section validates its own fields)."""
        p = self.parallel
        warmup, steps = self.lr_schedule.warmup_steps, self.training.steps
        if warmup > steps:
            warn(
                f"--lr_schedule.warmup_steps {warmup} exceeds --training.steps {steps}: the "
                f"learning rate ends the run at {steps / (warmup + 1):.0%} of --optimizer.lr, "
                "never reaching it; lower warmup_steps to reach the peak."
            )
        if self.training.cuda_graph:
            _check_cuda_graph_job(self)
        _check_mixed_precision(self)
        _check_unused_checkpoint_options(self)
        traced = self.profiling.steps
        if traced and max(traced) > steps:
            raise ConfigError(
                f"--profiling.steps {traced} lies beyond --training.steps {steps}, so the trace "
                f"would never be written; pick steps within 1..{steps}."
            )
        if self.model.attn_backend == "fa4" and p.cp > 1:
            raise ConfigError(
                "--parallel.cp attends through its own kernel (SDPA under each layer's mask) "
                "whatever --model.attn_backend says, so fa4 would not run; leave attn_backend at "
                "sdpa with cp."
            )
        if self.optimizer.grad_dtype == "bf16" and (
            max(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep) > 1 or p.fsdp_always
        ):
            raise ConfigError(
                "--optimizer.grad_dtype bf16 is implemented for one GPU: data, context, tensor and "
                "expert parallelism keep sharded fp32 gradients, and pipeline stages are not "
                "verified with it. Leave grad_dtype at fp32 with those degrees."
            )
        if self.optimizer.grad_dtype == "bf16" and self.training.mixed_precision == "fp32":
            raise ConfigError(
                "--optimizer.grad_dtype bf16 holds gradients that bf16 matmuls produce; under "
                "--training.mixed_precision fp32 they are fp32 and every one would be rounded. "
                "Use mixed_precision bf16 (or auto on a GPU), or leave grad_dtype at fp32."
            )
        if self.model.batch_invariant and (p.tp > 1 or p.cp > 1 or p.pp > 1):
            raise ConfigError(
                "--model.batch_invariant true is implemented for whole-model ranks only; set "
                "--parallel.tp, --parallel.cp and --parallel.pp to 1 (data parallelism is fine)."
            )
        if self.remat.weight_casts == "recompute" and self.compile.backend != "inductor":
            raise ConfigError(
                f"--remat.weight_casts recompute is an inductor pass; --compile.backend "
                f"{self.compile.backend} would ignore it. Use --compile.backend inductor, or "
                "leave --remat.weight_casts at keep."
            )
        if self.model.batch_invariant and self.compile.enabled:
            raise ConfigError(
                "--model.batch_invariant true and --compile.enabled true do not mix: inductor "
                "fuses the pointwise code between the fixed-order kernels and rounds it "
                "differently from the eager generator, so the log-probabilities would no longer "
                "match it bit for bit. Set --compile.enabled false."
            )
        if self.model.loss_impl == "chunked" and (self.parallel.tp > 1 or self.parallel.pp > 1):
            raise ConfigError(
                "--model.loss_impl chunked fuses the whole output head on one rank; it does not "
                "run with --parallel.tp or --parallel.pp > 1 (use loss_impl full, whose tensor-"
                "parallel form keeps the logits sharded over the vocabulary)."
            )
        # The norm slot as the transforms leave it (triton_kernels sets it too).
        slot = TransformerConfig(norm_impl=self.model.norm_impl)
        try:
            norm_impl = apply_transforms(slot, self.model.transforms).norm_impl
        except ConfigError:
            known = {name for name, _ in list_transforms()}
            if not set(self.model.transforms) <= known:
                raise
            # A family's own transform (dsa_warmup) refused the stand-in: the real config
            # checks it when the model is resolved.
            norm_impl = self.model.norm_impl
        if norm_impl == "triton" and p.tp > 1:
            raise ConfigError(
                "The Triton RMSNorm (norm_impl triton, also set by the triton_kernels transform) "
                "cannot take the DTensors that sequence-parallel norms receive with --parallel.tp "
                "> 1; keep --model.norm_impl torch and set --model.rope_impl triton --model."
                "mlp_impl triton instead of the transform."
            )


def _check_mixed_precision(job: JobConfig) -> None:
    """Refuse an FSDP compute dtype that contradicts --training.mixed_precision (with auto,
    FSDP follows an explicit training.mixed_precision: ``ParallelConfig.following``)."""
    run, fsdp = job.training.mixed_precision, job.parallel.mixed_precision_param
    if "auto" not in (run, fsdp) and run != fsdp:
        raise ConfigError(
            f"--training.mixed_precision {run} contradicts --parallel.mixed_precision_param "
            f"{fsdp} (the dtype FSDP computes in); set both to {run}, or leave "
            "mixed_precision_param at auto to follow training.mixed_precision."
        )


def _check_unused_checkpoint_options(job: JobConfig) -> None:
    """Warn about checkpoint options that do nothing in this job: saving options without saves,
    loading options without a resume (the checkpoint section's own rule, checked here where
    the job is validated)."""
    c = job.checkpoint
    if not c.interval:
        options = ("mode", "keep_latest_k")
        warn_unused_options(c, "checkpoint", options, "--checkpoint.interval > 0")
    if not c.resume:
        options = ("fallback", "exclude_from_loading")
        warn_unused_options(c, "checkpoint", options, "--checkpoint.resume true")


def _check_cuda_graph_job(job: JobConfig) -> None:
    """ConfigError for a job whose step cannot be captured (called with cuda_graph on)."""
    p = job.parallel
    if max(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp) > 1 or p.fsdp_always:
        raise ConfigError(
            "--training.cuda_graph true captures a single-GPU step: it does not run with data, "
            "context, tensor or pipeline parallelism or --parallel.fsdp_always (their "
            "collectives and host-side schedules are not captured); set those degrees to 1."
        )
    if job.optimizer.implementation not in ("auto", "fused", "triton"):
        raise ConfigError(
            "--training.cuda_graph true captures a device-side AdamW (fused or triton), which "
            "computes the same captured or not; set --optimizer.implementation auto, fused or "
            "triton."
        )
    if job.model.batch_invariant:
        raise ConfigError(
            "--training.cuda_graph true is not verified with --model.batch_invariant true; drop "
            "one of the two."
        )
    if job.optimizer.grad_dtype != "fp32":
        raise ConfigError(
            "--training.cuda_graph true is not verified with --optimizer.grad_dtype bf16 (its "
            "gradients are held by a Python hook, which a replayed graph does not run); drop one "
            "of the two."
        )
    if job.model.attn_backend == "fa4" and job.data.document_mask:
        raise ConfigError(
            "--training.cuda_graph true cannot capture fa4 over packed documents (where the "
            "documents start is read back from the GPU each step); set --data.document_mask "
            "false or --model.attn_backend sdpa."
        )
