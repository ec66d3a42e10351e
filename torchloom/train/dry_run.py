"""`torchloom train --dry-run`: build the job's model on the meta device under the real mesh,
run the checks the real run makes of the layout, and report what each rank would hold, without
allocating the model, loading data or building the optimizer.

Each rank counts the bytes of its own parameter shards (``DTensor.to_local()`` on meta), the
gradients (one per trainable parameter, shaped and typed like its local shard: FSDP keeps
sharded gradients, without FSDP the local parameter is the whole tensor or its TP shard) and the
optimizer state (``OPTIMIZER_STATE_BYTES``, train/optim.py). Rank 0 gathers and prints them.
With expert parallelism a rank's experts are its num_experts / ep, further split by FSDP over
the ranks sharing them (parallel/expert_parallel.py): the local shards say so.

The activation estimate runs the forward of a model holding one block of each distinct kind
(layer spec x recomputed or not), and of that model with a second block of one kind, on fake
tensors (shapes and dtypes only) at this rank's micro-batch shape with the job's recomputation
applied, and counts the bytes of every tensor the forward created that is still alive when it
returns: what autograd keeps for backward, including what recomputation keeps outside
autograd's saved tensors (the blocks' inputs). The estimate is the first model plus, per kind,
the further layers of that kind times what the second block added.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchloom.config.errors import ConfigError
from torchloom.data.loader import check_batch_layout
from torchloom.models import DecoderConfig, build_model
from torchloom.parallel import ParallelDims, build_parallel_dims, destroy, init_distributed
from torchloom.parallel.data_parallel import mixed_precision_policy
from torchloom.parallel.pipeline import layers_per_stage, stage_model
from torchloom.train.builders import (
    GiB,
    autocast_dtype,
    build_model_config,
    build_model_parts,
    build_objective,
    check_seq_len,
    local_bytes,
    micro_batch_size,
)
from torchloom.train.job import JobConfig
from torchloom.train.loss import Objective
from torchloom.train.optim import OPTIMIZER_STATE_BYTES, linear_weights
from torchloom.train.remat import apply_remat


@dataclass
class RankMemory:
    """What one rank holds, in bytes."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int | None
    """The activation estimate (None: not available for this layout)."""
    peak_rss: int
    """This process's peak resident memory during the dry run."""

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state: what stays allocated between steps."""
        return self.params + self.grads + self.optimizer


@dataclass
class Activations:
    bytes: int | None
    note: str
    """How the estimate was made, or why there is none."""


def dry_run(job: JobConfig, world_size: int | None = None) -> int:
    """Build, check and report (rank 0 prints); every rank leaves the process group. Returns
    the exit status; an impossible layout raises ConfigError.

    ``world_size``: instead of joining the launched processes, simulate a job of that many
    ranks in this one process (``simulate_ranks``)."""
    if job.training.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "--training.device cuda: no CUDA GPU is visible here, and a dry run needs none: drop "
            "--training.device (or set cpu), with --training.mixed_precision bf16 to estimate "
            "the activations in a GPU's compute dtype."
        )
    if world_size is not None:
        return simulate_ranks(job, world_size)
    device = init_distributed(job.training.device)
    config, dims, micro, mine, activations = check_rank(job, device)
    rows = [mine]
    if dist.is_initialized() and dims.world_size > 1:
        rows = [None] * dims.world_size
        dist.all_gather_object(rows, mine)
    if dims.is_rank0:
        print(format_report(job, config, dims, micro, rows, activations))
    destroy()
    return 0


def simulate_ranks(job: JobConfig, world_size: int) -> int:
    """The dry run of a ``world_size``-rank job from one process (``--dry-run --world-size N``):
    a layout for 32 nodes is checked on a laptop. Each reported rank joins a fake process group
    (torch's "fake" backend: every collective returns at once, moving no data) as that rank of
    ``world_size``, builds its shards on meta and makes the checks a real rank makes. The ranks
    reported are the first of each pipeline stage (pp is the outermost mesh axis, so ranks
    ``s * world_size / pp``): the other ranks of a stage hold the same shapes, FSDP's last
    shards at most a padding row less."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "--world-size simulates the job's ranks in one process; launch it without torchrun "
            "(under torchrun the dry run takes the launched world)."
        )
    if world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}.")
    # Importing it registers the "fake" backend (torch 2.13 imports it itself only when
    # init_process_group gets no store); TorchTitan's fake-backend dry runs use it the same way.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = init_distributed(job.training.device)
    stages = job.parallel.resolve(world_size).pp
    rows, first = [], None
    for rank in range(0, world_size, world_size // stages):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            config, dims, micro, mine, activations = check_rank(job, device)
        finally:
            dist.destroy_process_group()
        rows.append(mine)
        first = first or (config, dims, micro, activations)
    config, dims, micro, activations = first
    print(format_report(job, config, dims, micro, rows, activations, simulated=True))
    print(
        f"simulated: {world_size} ranks in this one process (fake process group); reported the "
        f"first rank of each of the {stages} pipeline stage(s)"
    )
    return 0


def check_rank(
    job: JobConfig, device: torch.device
) -> tuple[DecoderConfig, ParallelDims, int, RankMemory, Activations]:
    """This rank's checks and memory: (model config, dims, micro-batch, memory, activations)."""
    t = job.training
    dims = build_parallel_dims(job.parallel.following(t.mixed_precision), device.type)
    config = build_model_config(job)
    check_seq_len(config, t.seq_len, job.checkpoint.initial_load_hf)
    micro = micro_batch_size(job, dims)
    check_batch_layout(t.global_batch_sequences, micro, dims.dp_size, dims.dp_rank, t.seq_len)
    objective = build_objective(job)
    parts = build_model_parts(job, config, dims, device, objective, allocate=False)
    if parts.pipeline is not None:
        parts.pipeline.check_batch_size(micro)
    activations = estimate_activations(job, config, dims, device, objective, micro)
    return (
        config,
        dims,
        micro,
        rank_memory(dims.rank, parts.model, job, activations.bytes),
        activations,
    )


def rank_memory(rank: int, model: nn.Module, job: JobConfig, activations: int | None) -> RankMemory:
    """This rank's bytes of parameters, gradients and optimizer state for ``model`` (on meta)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    state = OPTIMIZER_STATE_BYTES[job.optimizer.name](model, job.optimizer)
    # --optimizer.grad_dtype bf16 holds the linear weights' gradients in half the bytes.
    halved = {id(w) for w in linear_weights(model)} if job.optimizer.grad_dtype == "bf16" else ()
    return RankMemory(
        rank,
        params=sum(local_bytes(p) for p in params),
        grads=sum(local_bytes(p) // (2 if id(p) in halved else 1) for p in trainable),
        optimizer=state,
        activations=activations,
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
    )


# -- activations ----------------------------------------------------------------------------


def estimate_activations(
    job: JobConfig,
    config: DecoderConfig,
    dims: ParallelDims,
    device: torch.device,
    objective: Objective,
    micro: int,
) -> Activations:
    """The activation estimate for one micro-batch on this rank, or why there is none."""
    split = [name for name in ("tp", "cp", "pp") if getattr(dims.degrees, name) > 1]
    if split:
        reason = "the estimate covers ranks running whole blocks on whole sequences"
        return Activations(None, f"n/a with {' and '.join(split)} > 1 ({reason})")
    if job.remat.mode == "budget":
        return Activations(None, "n/a with --remat.mode budget (the compiler picks what to keep)")
    if tuple(objective.fields) != ("labels",):
        return Activations(None, f"n/a for an objective reading {objective.fields}")
    dtype, autocast = _compute_dtypes(job, dims, device)
    try:
        total = _probe(job, config, device, objective, micro, dtype, autocast)
    except Exception as err:  # an op without a fake-tensor kernel: say so rather than guess
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        return Activations(None, f"n/a: the fake forward failed ({type(err).__name__}: {reason})")
    compute = str(autocast or dtype).removeprefix("torch.")
    note = (
        f"estimate of what autograd keeps from one micro-batch's forward for its backward "
        f"({micro} x {job.training.seq_len} tokens, {compute} compute, remat {job.remat.mode}"
        + (", eager blocks: compiled ones may keep less" if job.compile.enabled else "")
        + (
            f"; ep {dims.degrees.ep}: as many expert rows per rank as without, which holds when "
            "the routing is balanced"
            if dims.degrees.ep > 1
            else ""
        )
        + "); excludes allocator overhead, temporary buffers and gathered FSDP parameters"
    )
    return Activations(total, note)


def _compute_dtypes(
    job: JobConfig, dims: ParallelDims, device: torch.device
) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype of the parameters the blocks compute with, autocast dtype or None), as the
    trainer runs: FSDP's mixed-precision policy when there is FSDP, else bf16 autocast when
    asked for (auto: on the GPU)."""
    if dims.fsdp_mesh is not None:
        return mixed_precision_policy(dims.degrees, device.type).param_dtype, None
    return torch.float32, autocast_dtype(job, dims, device)


def _probe(
    job: JobConfig,
    config: DecoderConfig,
    device: torch.device,
    objective: Objective,
    micro: int,
    dtype: torch.dtype,
    autocast: torch.dtype | None,
) -> int:
    """Bytes a forward keeps for backward: measured on a model with one block of each kind, plus
    for each kind the further blocks times what a second one of that kind adds."""
    with torch.device("meta"):
        model = build_model(config)
    apply_remat(model.layers, job.remat, job.compile.enabled)
    kinds: dict[tuple, list[int]] = defaultdict(list)
    specs = config.layer_specs()
    for name, block in model.layers.items():
        recomputed = "forward" in vars(block)  # apply_remat patched this block's forward
        kinds[(specs[int(name)], recomputed)].append(int(name))
    firsts = [ids[0] for ids in kinds.values()]
    # Shells sharing the model's modules: one block of each kind, then each with a second block
    # of one kind. Adding a block measures what one more costs; what the blocks share (the
    # RoPE tables, the head) is in the first shell once.
    once = stage_model(model, firsts, True, True)
    repeats = [ids for ids in kinds.values() if len(ids) > 1]
    twice = [stage_model(model, sorted([*firsts, ids[1]]), True, True) for ids in repeats]
    used = stage_model(model, sorted({*firsts, *(ids[1] for ids in repeats)}), True, True)
    for shell in (once, *twice, used):
        # What stage_model leaves out of a shell besides the blocks (deepseek_v3's multi-token
        # prediction depths): shared too, else it stays on meta and the fake forward fails.
        for name, child in model.named_children():
            if name != "layers":
                setattr(shell, name, child)
    used.to(dtype)  # still meta: nothing allocated
    with FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False):
        used.to_empty(device=device)  # fake tensors on the device: shapes and dtypes only
        kept = functools.partial(
            kept_by_forward,
            job=job,
            device=device,
            objective=objective,
            micro=micro,
            autocast=autocast,
        )
        base = kept(once)
        return base + sum(
            (len(ids) - 1) * (kept(shell) - base) for ids, shell in zip(repeats, twice)
        )


class _NewTensors(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op creates."""

    supports_higher_order_operators = True  # e.g. Triton kernels (the chunked loss on CUDA)

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.append((StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        """Bytes of the recorded storages still alive, each counted once."""
        alive = {ref.cdata: n for ref, n in self.storages if not ref.expired()}
        return sum(n for cdata, n in alive.items() if cdata not in exclude)


def kept_by_forward(
    model: nn.Module,
    *,
    job: JobConfig,
    device: torch.device,
    objective: Objective,
    micro: int,
    autocast: torch.dtype | None,
) -> int:
    """Bytes of the tensors one forward of ``model`` leaves alive for its backward (fake or
    real tensors alike), on inputs shaped like the loader's (``micro`` x seq_len)."""
    T = job.training.seq_len
    tokens = torch.zeros(micro, T, dtype=torch.long, device=device)
    positions = torch.arange(T, device=device).expand(micro, T)
    # The loader's batches carry document ids unless --data.document_mask false (text only).
    doc_ids = torch.zeros_like(tokens) if job.data.document_mask else None
    inputs = [tokens, positions, *([] if doc_ids is None else [doc_ids])]
    # Views of parameters and inputs share their storage: not activations.
    existing = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *inputs]}
    context = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    record = _NewTensors()
    with record, context:
        out = model(tokens, positions, doc_ids, objective=objective, targets={"labels": tokens})
    kept = record.alive_bytes(existing)
    del out
    return kept


# -- the report -----------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def model_bytes(config: DecoderConfig) -> tuple[int, int, str]:
    """(parameters, bytes, dtype) of the whole model as built (before any sharding)."""
    with torch.device("meta"):
        params = list(build_model(config).parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    return sum(p.numel() for p in params), sum(p.nbytes for p in params), "/".join(dtypes)


def format_report(
    job: JobConfig,
    config: DecoderConfig,
    dims: ParallelDims,
    micro: int,
    rows: list[RankMemory],
    activations: Activations,
    simulated: bool = False,
) -> str:
    """The lines rank 0 prints (``simulated``: ``rows`` are some ranks of a simulated world)."""
    t, d = job.training, dims.degrees
    count, nbytes, dtype = model_bytes(config)
    name = job.checkpoint.initial_load_hf or f"{job.model.name}/{job.model.flavor}"
    accum = t.global_batch_sequences // (micro * dims.dp_size)
    lines = [
        f"dry run: {name}, {_count(count)} parameters = {_gib(nbytes)} ({nbytes} bytes, "
        f"{dtype}) on {dims.world_size} "
        + ("simulated rank(s)" if simulated else "process(es)")
        + f": dp_replicate {d.dp_replicate} x dp_shard "
        f"{d.dp_shard} x cp {d.cp} x tp {d.tp} x pp {d.pp}"
        + (f"; ep {d.ep} (from dp_shard x cp)" if d.ep > 1 else ""),
        f"layout: the model divides over this mesh (checked: tensor-parallel split, pipeline "
        f"stages, sequence lengths, micro-batches); {t.global_batch_sequences} x {t.seq_len} "
        f"tokens per step = {accum} micro-batch(es) of {micro} on each of {dims.dp_size} data "
        "rank(s)" + (f"; layers per stage {layers_per_stage(config, d)}" if d.pp > 1 else ""),
        "not checked: the tokenizer's vocabulary against the model's (a dry run loads no data)",
        "",
        _table(rows),
        "",
        ("sum over the reported ranks: " if simulated else "sum over ranks: ")
        + ", ".join(
            f"{label} {_gib(n)} ({n} bytes)"
            for label, n in (
                ("parameters", sum(r.params for r in rows)),
                ("gradients", sum(r.grads for r in rows)),
                ("optimizer state", sum(r.optimizer for r in rows)),
                ("total", sum(r.total for r in rows)),
            )
        ),
    ]
    largest = max(rows, key=lambda r: r.total)
    lines.append(
        f"largest per-rank total: rank {largest.rank}, {_gib(largest.total)} "
        f"({largest.total} bytes)"
        + (
            f"; {_gib(largest.total + largest.activations)} with activations"
            if largest.activations is not None
            else ""
        )
    )
    lines.append(f"activations: {activations.note}")
    if t.memory_limit_gib:
        need = largest.total + (largest.activations or 0)
        fits = "fits under it" if need <= t.memory_limit_gib * GiB else "does NOT fit under it"
        lines.append(
            f"--training.memory_limit_gib {t.memory_limit_gib:g}: the largest rank's "
            f"{_gib(need)} (no allocator overhead) {fits}"
        )
    return "\n".join(lines)


_COLUMNS = ("parameters", "gradients", "optimizer", "total", "activations")


def _table(rows: list[RankMemory]) -> str:
    """Per rank: each size in GiB (and the process's peak RSS), then in bytes."""

    def cells(r: RankMemory) -> list[int | None]:
        return [r.params, r.grads, r.optimizer, r.total, r.activations]

    head = f"{'rank':>4}" + "".join(f"{c:>13}" for c in _COLUMNS)
    lines = [head + f"{'peak RSS':>10}   (GiB)"]
    for r in rows:
        sizes = "".join(f"{'n/a' if n is None else f'{n / GiB:.2f}':>13}" for n in cells(r))
        lines.append(f"{r.rank:>4}{sizes}{r.peak_rss / GiB:>10.2f}")
    lines.append(f"{'rank':>4}" + "".join(f"{c:>16}" for c in _COLUMNS) + "   (bytes)")
    for r in rows:
        lines.append(f"{r.rank:>4}" + "".join(f"{'n/a' if n is None else n:>16}" for n in cells(r)))
    return "\n".join(lines)
