"""The `parallel` section: degrees (validated against the world size) and how data parallelism
stores and reduces parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from torchloom.config.errors import ConfigError
from torchloom.config.fields import warn_unused_options

_AXES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
_PIPELINE_OPTIONS = (
    "pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_layers_per_stage",
    "pp_embedding_weight",
)  # fmt: skip
_DATA_PARALLEL_OPTIONS = (
    "mixed_precision_param",
    "mixed_precision_reduce",
    "reshard_after_forward",
)
"""What only FSDP reads (``mixed_precision_policy``, ``fully_shard``)."""

ParamDtype = Literal["auto", "bf16", "fp32"]
ReduceDtype = Literal["fp32", "bf16"]
ReshardPolicy = Literal["default", "always", "never"]


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate axis; plain replication when dp_shard is 1)."""
    dp_shard: int = -1
    """Data-parallel sharding degree (FSDP). -1 takes whatever the other degrees leave."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel on norms)."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are split into stages over this many ranks."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, zbv."""
    pp_microbatches: int = 0
    """Pipeline microbatches per trainer micro-batch; 0 takes the total number of stages."""
    pp_stages_per_rank: int = 0
    """Virtual stages per rank; 0 takes 1 for gpipe/1f1b and 2 for the other schedules."""
    pp_layers_per_stage: list[int] | None = None
    """Explicit split, e.g. [3, 5]: transformer layers of each stage, in order (None: balance)."""
    pp_embedding_weight: float = 1.0
    """How many layers the embedding and the output head each count as when balancing stages."""
    ep: int = 1
    """Expert-parallel degree for mixture-of-experts layers: each of ep ranks, borrowed from
    dp_shard x cp (ep must divide it), holds num_experts / ep experts and tokens travel to
    them by all-to-all."""
    mixed_precision_param: ParamDtype = "auto"
    """Dtype data parallelism (FSDP) gathers parameters in for compute; the sharded master copy
    and the optimizer stay fp32. auto: --training.mixed_precision when that is bf16 or fp32,
    else bf16 on the GPU and fp32 on the CPU."""
    mixed_precision_reduce: ReduceDtype = "fp32"
    """Dtype in which data parallelism reduces gradients across ranks."""
    reshard_after_forward: ReshardPolicy = "default"
    """Free gathered parameters after each block's forward (re-gather in backward): default
    does it for every block but the last (and never under pure replication); always / never
    trade memory for communication."""
    fsdp_always: bool = False
    """Apply FSDP (``fully_shard``) even when only one rank holds each shard, e.g. a single GPU:
    its mixed precision then keeps fp32 master weights and computes in bf16 (instead of
    autocast), and the model takes the same DTensor form as on many ranks."""
    loss_parallel: bool = True
    """With tensor parallelism, keep the logits sharded over the vocabulary and compute the
    cross-entropy in parallel (saves gathering [batch, seq, vocab]); false gathers the logits."""

    def validate(self) -> None:
        for axis in (*_AXES, "ep"):
            value = getattr(self, axis)
            if value < 1 and not (axis == "dp_shard" and value == -1):
                raise ConfigError(
                    f"--parallel.{axis} must be a positive integer"
                    + (" or -1 (take what is left)" if axis == "dp_shard" else "")
                    + f"; got {value}."
                )
        for name, kind in (
            ("mixed_precision_param", ParamDtype),
            ("mixed_precision_reduce", ReduceDtype),
            ("reshard_after_forward", ReshardPolicy),
        ):
            if getattr(self, name) not in get_args(kind):
                raise ConfigError(
                    f"--parallel.{name} must be one of {', '.join(get_args(kind))}; "
                    f"got {getattr(self, name)!r}."
                )

        if self.pp_microbatches < 0 or self.pp_stages_per_rank < 0:
            raise ConfigError(
                "--parallel.pp_microbatches and --parallel.pp_stages_per_rank must be >= 0 "
                f"(0 picks a default); got {self.pp_microbatches} and {self.pp_stages_per_rank}."
            )
        self._validate_pipeline_options()
        if self.pp == 1:
            warn_unused_options(self, "parallel", _PIPELINE_OPTIONS, "--parallel.pp > 1")
        if self.tp == 1:
            warn_unused_options(self, "parallel", ("loss_parallel",), "--parallel.tp > 1")

    def _validate_pipeline_options(self) -> None:
        """The pipeline options' own values, whatever pp is: a typo must not wait for the run
        that turns pipelining on."""
        schedule_class(self.pp_schedule)
        per_rank = stages_per_rank(self)
        split = self.pp_layers_per_stage
        if split is not None and (min(split, default=0) < 0 or len(split) != self.pp * per_rank):
            raise ConfigError(
                f"--parallel.pp_layers_per_stage {split} must list {self.pp * per_rank} "
                f"non-negative layer counts, one per pipeline stage (pp {self.pp} x "
                f"{per_rank} stage(s) per rank)."
            )
        if self.pp_embedding_weight < 0:
            raise ConfigError(
                f"--parallel.pp_embedding_weight must be >= 0; got {self.pp_embedding_weight}."
            )

    def resolve(self, world_size: int) -> ParallelConfig:
        """These degrees with dp_shard=-1 filled in; refuses products that miss the world size."""
        self.validate()
        others = self.dp_replicate * self.cp * self.tp * self.pp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"The world size {world_size} is not divisible by dp_replicate x cp x tp x pp "
                    f"= {self.dp_replicate} x {self.cp} x {self.tp} x {self.pp} = {others}; "
                    + _launch_hint(world_size, others)
                )
            dp_shard = world_size // others
        resolved = replace(self, dp_shard=dp_shard)
        product = math.prod(getattr(resolved, a) for a in _AXES)
        if product != world_size:
            degrees = " x ".join(str(getattr(resolved, a)) for a in _AXES)
            fix = (
                f"this is one process; {_launch_hint(world_size, product)}"
                if world_size == 1
                else f"{world_size} processes were launched; make the product equal the world "
                "size (or set --parallel.dp_shard -1 to fill it)."
            )
            raise ConfigError(
                f"dp_replicate x dp_shard x cp x tp x pp = {degrees} = {product}, but {fix}"
            )
        if world_size == 1 and not self.fsdp_always:
            warn_unused_options(
                self, "parallel", _DATA_PARALLEL_OPTIONS,
                "FSDP is on (more than one process, or --parallel.fsdp_always true)",
            )  # fmt: skip
        borrowed = resolved.dp_shard * resolved.cp
        if borrowed % resolved.ep:
            raise ConfigError(
                f"--parallel.ep {resolved.ep} does not divide dp_shard x cp = {resolved.dp_shard} "
                f"x {resolved.cp} = {borrowed}: expert parallelism borrows its ranks from those "
                "(it adds none); "
                + (
                    _launch_hint(world_size, resolved.ep)
                    if world_size == 1
                    else f"choose an ep that divides {borrowed}, or raise dp_shard."
                )
            )
        return resolved

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (replicate x shard); valid after resolve()."""
        return self.dp_replicate * self.dp_shard

    def following(self, mixed_precision: str) -> ParallelConfig:
        """These settings with ``mixed_precision_param auto`` resolved to an explicit
        ``--training.mixed_precision`` (bf16 or fp32), so FSDP computes in the dtype the run
        asked for; with auto the device decides (``mixed_precision_policy``)."""
        if self.mixed_precision_param != "auto" or mixed_precision == "auto":
            return self
        return replace(self, mixed_precision_param=mixed_precision)


def _launch_hint(world_size: int, needed: int) -> str:
    """How to get the processes a layout needs: torchrun, when this is a single process."""
    if world_size == 1:
        return (
            f"these degrees need {needed} processes: launch them with torchrun "
            f"--nproc-per-node {needed} (--dry-run simulates them with --world-size {needed}), "
            "or set the degrees to 1."
        )
    return "choose degrees whose product divides the number of processes."


# -- pipeline schedules (the facts the config checks; parallel/pipeline.py runs them) ----------

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""--parallel.pp_schedule -> class name in torch.distributed.pipelining.schedules."""
_ONE_STAGE_PER_RANK = ("gpipe", "1f1b")
SPLIT_BACKWARD = ("interleaved_zb", "zbv")


def schedule_class(name: str) -> type:
    """The torch schedule class for a name; ConfigError for unknown or unavailable ones."""
    available = {k: v for k, v in SCHEDULES.items() if hasattr(torch_schedules, v)}
    if name not in available:
        raise ConfigError(
            f"Unknown or unavailable --parallel.pp_schedule {name!r}; this torch "
            f"({torch.__version__}) offers: {', '.join(available)}."
        )
    return getattr(torch_schedules, available[name])


def stages_per_rank(config: ParallelConfig) -> int:
    """Virtual stages each rank holds: 1 for gpipe/1f1b, >= 2 (exactly 2 for zbv) otherwise."""
    single = config.pp_schedule in _ONE_STAGE_PER_RANK
    per_rank = config.pp_stages_per_rank or (1 if single else 2)
    if single and per_rank != 1:
        raise ConfigError(
            f"--parallel.pp_schedule {config.pp_schedule} runs one stage per rank; set "
            f"--parallel.pp_stages_per_rank 1 (got {per_rank}) or pick interleaved_1f1b."
        )
    if not single and per_rank < 2:
        raise ConfigError(
            f"--parallel.pp_schedule {config.pp_schedule} needs >= 2 stages per rank; got "
            f"--parallel.pp_stages_per_rank {per_rank}."
        )
    if config.pp_schedule == "zbv" and per_rank != 2:
        raise ConfigError(f"zbv places exactly 2 stages per rank (V shape); got {per_rank}.")
    return per_rank
