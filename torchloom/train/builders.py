"""What a Trainer is made of, each part built by a replaceable function: the data, the
objective, the model (built on the meta device, parallelized, then materialized), the optimizer
and its schedule, and the registry of what a checkpoint holds. A new family or objective plugs
in here; the trainer's loop does not change.

The model's path is the same for every layout and source of weights: build on ``meta`` (no
memory), apply pipeline / tensor / data parallelism (still no memory), ``to_empty`` on the
device (each rank allocates its shards only), then initialize each shard from the seed
(layout-invariant, see models/components/param_init.py) or read it from a Hugging Face folder.
No rank ever holds the whole model unless its layout gives it the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.checkpoint.hf import load_hf_weights, model_config_from_hf
from torchloom.checkpoint.stateful import ModelState, OptimizerState, Stateful
from torchloom.config.errors import ConfigError
from torchloom.data import build_dataloaders
from torchloom.data.config import DataConfig
from torchloom.data.multimodal import resolve_image_processing, resolve_media_layout
from torchloom.data.multimodal_format import MediaTokens
from torchloom.kernels.delta_rule import fla_runs
from torchloom.kernels.flash_attention4 import check_fa4_device
from torchloom.kernels.float8 import check_float8_device
from torchloom.kernels.triton_support import cuda_index
from torchloom.models import (
    Attention,
    DecoderConfig,
    build_model,
    get_model_spec,
    resolve_model_config,
)
from torchloom.parallel import ParallelDims, parallelize
from torchloom.parallel.pipeline import Pipeline, build_pipeline
from torchloom.train.compile import compile_regions
from torchloom.train.job import JobConfig
from torchloom.train.loss import CrossEntropy, Objective
from torchloom.train.optim import build_lr_scheduler, build_optimizer
from torchloom.train.remat import apply_remat, memory_budget, recompute_weight_casts


@dataclass
class ModelParts:
    """The model as this rank holds it."""

    config: DecoderConfig
    """What the run computes (component slots and float8 included)."""
    model: nn.Module
    """The parallelized model, or (pipeline parallelism) a ModuleList of this rank's stages:
    what the optimizer, clipping and train/eval modes see."""
    pipeline: Pipeline | None = None
    state_model: nn.Module | None = None
    """What checkpoints save, under single-process names (default: ``model``)."""

    @property
    def saved_config(self) -> DecoderConfig:
        """What saved models record: float8 is how this run computes, not part of the model."""
        return replace(self.config, float8="none")


def build_model_config(job: JobConfig) -> DecoderConfig:
    """The architecture: the family flavor with the job's overrides, or an HF folder's."""
    hf_dir = job.checkpoint.initial_load_hf
    if hf_dir:
        return model_config_from_hf(Path(hf_dir), job.model)
    return resolve_model_config(job.model)


def build_model_parts(
    job: JobConfig,
    config: DecoderConfig,
    dims: ParallelDims,
    device: torch.device,
    objective: Objective,
    *,
    allocate: bool = True,
) -> ModelParts:
    """Meta build, parallelize (pipeline stages, TP, recompute and compile, FSDP), then
    materialize every module this rank holds (``materialize``). ``allocate=False`` stops
    before materializing: every parameter stays on the meta device (the dry run)."""
    check_float8_device(config.float8, device)
    check_fa4_device(config.attn_backend, device)
    spec = get_model_spec(job.model.name)
    if dims.tp_enabled and spec.tp_plan is None:
        raise ConfigError(
            f"Model '{spec.name}' declares no tensor-parallel plan; set --parallel.tp 1."
        )
    with torch.device("meta"):
        model = build_model(config)
    check_layout(model, dims)
    seq_len, wrap = job.training.seq_len, block_wrapper(job, dims)
    if dims.degrees.pp > 1:
        pipeline = build_pipeline(
            model, dims, seq_len=seq_len, tp_plan=spec.tp_plan, device=device,
            objective=objective, wrap_blocks=wrap,
        )  # fmt: skip
        if allocate:
            check_memory(list(pipeline.stages), job, device)
            for stage in pipeline.stages:
                materialize(stage, job, device)
        return ModelParts(config, pipeline.stages, pipeline, pipeline.local_model())
    parallelize(model, dims, seq_len=seq_len, tp_plan=spec.tp_plan, wrap_blocks=wrap)
    if allocate:
        check_memory([model], job, device)
        materialize(model, job, device)
    return ModelParts(config, model)


GiB = 2**30
_TOO_LARGE_FIXES = (
    "plan a layout that fits with --dry-run, pick a smaller --model.flavor, or shard the model "
    "with FSDP over more ranks (torchrun --nproc-per-node N)"
)


def local_bytes(param: torch.Tensor) -> int:
    """Bytes of this rank's shard of ``param`` (the whole tensor when it is not a DTensor)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


def surely_trained(name: str) -> bool:
    """Whether every training step gives the parameter ``name`` (as named in a model or a
    pipeline stage) a gradient: the embedding, the head and the decoder blocks, except
    sparse-attention indexers (trained in some phases only). Media encoders (no gradient on
    text batches) and the rest are left out."""
    top = name.split(".", 1)[0]
    return top in ("embed_tokens", "output", "norm", "layers") and ".indexer." not in name


def training_bytes_lower_bound(modules: list[nn.Module], job: JobConfig) -> tuple[int, int]:
    """(this rank's parameter bytes, the least training adds to them): the gradients of the
    parameters every step trains (``surely_trained``), shaped like their local shards, and
    with AdamW the two moments of each (what --dry-run reports for every parameter)."""
    params = grads = 0
    for module in modules:
        for name, param in module.named_parameters():
            params += local_bytes(param)
            if param.requires_grad and surely_trained(name):
                grads += local_bytes(param)
    moments = 2 * grads if job.optimizer.name == "adamw" else 0
    return params, grads + moments


def check_cap_device(gib: float, device_type: str) -> None:
    """ConfigError when ``--training.memory_limit_gib`` is set and the run's device (``auto``
    resolved here) is not a GPU: called before anything trains (rl's prerequisite models)."""
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if gib and device_type != "cuda":
        raise ConfigError(
            f"--training.memory_limit_gib {gib:g} caps the CUDA allocator, and this run is on "
            f"the {device_type}: drop the option or train on a GPU."
        )


def cap_device_memory(device: torch.device, gib: float) -> None:
    """``--training.memory_limit_gib``: cap this process's CUDA caching allocator at ``gib``
    GiB (0: no cap) before anything is allocated. Over the cap, torch's allocator frees its
    unused cached blocks and retries an allocation before raising out-of-memory."""
    check_cap_device(gib, device.type)
    if not gib:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * GiB > total:
        raise ConfigError(
            f"--training.memory_limit_gib {gib:g} is more than this GPU's {total / GiB:.1f} "
            "GiB; give at most that, or 0 for no cap."
        )
    index = cuda_index(device)
    torch.cuda.set_per_process_memory_fraction(gib * GiB / total, index)


def device_memory(device: torch.device) -> int | None:
    """The memory in bytes this process may use on the device (a GPU's total, or the cap
    ``cap_device_memory`` set; the machine's RAM for the CPU); None if unknown."""
    if device.type == "cuda":
        index = cuda_index(device)
        total = torch.cuda.mem_get_info(index)[1]
        return int(total * torch.cuda.get_per_process_memory_fraction(index))
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_memory(modules: list[nn.Module], job: JobConfig, device: torch.device) -> None:
    """ConfigError, before anything is allocated, when what training surely needs on this rank
    (``training_bytes_lower_bound``: no activations, no allocator overhead) exceeds the
    device's total memory: such a run cannot fit, and would otherwise grind or be killed."""
    total = device_memory(device)
    if total is None:
        return
    params, trained = training_bytes_lower_bound(modules, job)
    if params + trained > total:
        room = f"the {total / GiB:.1f} GiB of memory of this {device.type} device"
        if job.training.memory_limit_gib:
            room = f"the {total / GiB:.1f} GiB --training.memory_limit_gib allows"
        raise ConfigError(
            f"Training this model needs at least {(params + trained) / GiB:.1f} GiB per rank "
            f"(parameters {params / GiB:.1f} GiB, plus gradients and optimizer state), more "
            f"than {room}; {_TOO_LARGE_FIXES}."
        )


def _out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError)
        and ("can't allocate memory" in text or "out of memory" in text)
    )


def check_layout(model: nn.Module, dims: ParallelDims) -> None:
    """ConfigError for layouts the model's parts cannot take yet: pipeline parallelism of a
    model whose blocks pass more than one hidden state (refused first: without multi-token
    prediction it would still be), multi-token prediction under pipeline or context
    parallelism (its blocks follow the last stage and shift tokens along the whole sequence),
    a vision encoder under context parallelism (its image tokens fill placeholders anywhere in
    the sequence), and token mixers other than grouped-query attention under context
    parallelism (which swaps the kernel of Attention layers only)."""
    pp, cp = dims.degrees.pp, dims.degrees.cp
    if pp > 1 and not getattr(model, "supports_pipeline", True):
        raise ConfigError(
            f"--parallel.pp {pp} cannot split a {type(model).__name__} yet: its stages would "
            "pass one hidden state, not the residual streams its blocks keep. Set "
            "--parallel.pp 1."
        )
    if getattr(model, "mtp", None) is not None and (pp > 1 or cp > 1):
        axis = "pp" if pp > 1 else "cp"
        raise ConfigError(
            f"--parallel.{axis} {pp if pp > 1 else cp} with multi-token prediction is not "
            "supported yet; set --model.overrides '{\"mtp_layers\": 0}' or "
            f"--parallel.{axis} 1."
        )
    if cp > 1 and getattr(model, "media_encoder", None) is not None:
        raise ConfigError(
            f"--parallel.cp {cp} cannot split a model with a vision encoder yet: an image's "
            "tokens are scattered into the embedding across the whole sequence, which cp cuts "
            "between ranks (not implemented). Set --parallel.cp 1."
        )
    if cp > 1:
        kinds = sorted({type(b.attention).__name__ for b in model.layers.values()
                        if not isinstance(b.attention, Attention)})  # fmt: skip
        if kinds:
            raise ConfigError(
                f"--parallel.cp {cp} supports grouped-query attention layers only; this "
                f"model's {', '.join(kinds)} layers would attend within each rank's share of "
                "the sequence. Set --parallel.cp 1."
            )


def materialize(model: nn.Module, job: JobConfig, device: torch.device) -> None:
    """Allocate ``model``'s shards on ``device`` and fill them: from the Hugging Face folder of
    --checkpoint.initial_load_hf (each rank reads only its shards), else from the seed. Running
    out of memory is a ConfigError naming the size and the fixes."""
    hf_dir = job.checkpoint.initial_load_hf
    try:
        model.to_empty(device=device)
        if hf_dir:
            load_hf_weights(model, Path(hf_dir))
        else:
            model.init_weights(job.training.seed)
    except RuntimeError as err:
        if not _out_of_memory(err):
            raise
        size = sum(local_bytes(p) for p in model.parameters()) / GiB
        raise ConfigError(
            f"The {device.type} device ran out of memory while allocating the model's "
            f"parameters ({size:.1f} GiB on this rank); {_TOO_LARGE_FIXES}."
        ) from None


DELTA_RULE_MIXERS = ("GatedDeltaNet", "KimiDeltaAttention")
"""The token mixers that call ``delta_rule`` (fla's kernels on CUDA when installed)."""


def block_wrapper(job: JobConfig, dims: ParallelDims) -> Callable[[nn.Module], None]:
    """Recomputation, then regional compile: what parallelize applies between TP and FSDP."""

    def wrap(model: nn.Module) -> None:
        apply_remat(model.layers, job.remat, job.compile.enabled)
        # Measured on torch 2.13 (gloo, inductor and aot_eager): with FSDP x TP, compiled
        # sequence-parallel norms give wrong weight gradients (grad norm 0.41 instead of 0.53),
        # so there the norms stay eager and the rest of each block is compiled.
        fsdp_tp = dims.tp_enabled and dims.fsdp_mesh is not None
        # fla's delta-rule kernels are hidden from Dynamo (torch.compiler.disable): the blocks
        # of these mixers compile in pieces around them.
        fla = fla_runs(dims.device_type)
        compile_regions(model, job.compile, eager_types=("RMSNorm",) if fsdp_tp else (),
                        memory_budget=memory_budget(job.remat),
                        recompute_casts=recompute_weight_casts(job.remat),
                        graph_break_types=DELTA_RULE_MIXERS if fla else ())  # fmt: skip

    return wrap


def build_objective(job: JobConfig) -> Objective:
    """Next-token cross-entropy, full or chunked as --model.loss_impl says."""
    return CrossEntropy(job.model.loss_impl)


def micro_batch_size(job: JobConfig, dims: ParallelDims) -> int:
    """Sequences per forward on one rank: --training.micro_batch_size, or the rank's share."""
    t = job.training
    return t.micro_batch_size or max(1, t.global_batch_sequences // dims.dp_size)


def autocast_dtype(job: JobConfig, dims: ParallelDims, device: torch.device) -> torch.dtype | None:
    """bf16 autocast when asked for (auto: on the GPU), unless FSDP's mixed-precision policy
    sets the compute dtype itself; None: no autocast."""
    mp = job.training.mixed_precision
    wanted = mp == "bf16" or (mp == "auto" and device.type == "cuda")
    return torch.bfloat16 if wanted and dims.fsdp_mesh is None else None


def check_seq_len(config: DecoderConfig, seq_len: int, loaded_from: str = "") -> None:
    """Sequences must fit the model's context. ``loaded_from``: the Hugging Face folder the
    model comes from (its config cannot be overridden), if any."""
    if seq_len > config.max_seq_len:
        fix = (
            f"lower seq_len (a model loaded from {loaded_from} keeps its own context)"
            if loaded_from
            else f"lower seq_len or set --model.overrides '{{\"max_seq_len\": {seq_len}}}'"
        )
        raise ConfigError(
            f"--training.seq_len {seq_len} exceeds the model's max_seq_len "
            f"{config.max_seq_len}; {fix}."
        )


def check_media_encoder(config: DecoderConfig, data: DataConfig) -> None:
    """The part of ``check_media_fits`` that needs no tokenizer (the trainer runs it before the
    data, which may take minutes): multimodal data needs a model with a media encoder, reading
    the layout the data is rendered in."""
    if data.format != "multimodal":
        return
    family = getattr(config, "media_layout", None)
    if family is None:
        raise ConfigError(
            f"--data.format multimodal needs a model with a media encoder; "
            f"{type(config).__name__} has none (use a family such as qwen3_vl or kimi_k25)."
        )
    if data.media_layout != family:
        raise ConfigError(
            f"--data.media_layout {data.media_layout} renders media for {data.media_layout} "
            f"models, but this model reads the {family} layout; set --data.media_layout {family}."
        )


def check_media_fits(config: DecoderConfig, tokenizer: Any, data: DataConfig) -> None:
    """ConfigError (one line) when multimodal data meets a model without a media encoder, data
    rendered for another family (--data.media_layout), or a model whose placeholder ids or
    patch size differ from the data's. A vision model may still train on text (its encoder then
    gets no gradient)."""
    if data.format != "multimodal":
        return
    check_media_encoder(config, data)
    layout = resolve_media_layout(data)
    tokens = MediaTokens.from_tokenizer(tokenizer, layout)
    start_id = getattr(config, "vision_start_token_id", tokens.image_start_token_id)
    tokens.check_model_ids(config.image_token_id, start_id)
    processing = resolve_image_processing(data, tokenizer, layout)
    vision = config.vision
    model_patch = getattr(vision, "patch_size", processing.patch_size)
    model_merge = getattr(vision, "spatial_merge_size", None) or getattr(
        vision, "merge_size", getattr(vision, "merge", processing.merge_size)
    )
    if (processing.patch_size, processing.merge_size) != (model_patch, model_merge):
        raise ConfigError(
            "The images become patches of (side, merge) = "
            f"{(processing.patch_size, processing.merge_size)} but the model's encoder reads "
            f'{(model_patch, model_merge)}; set --model.overrides \'{{"vision.patch_size": '
            "...}' to match, or use the model's own tokenizer folder (its "
            "preprocessor_config.json)."
        )


def build_data(job: JobConfig, dims: ParallelDims) -> tuple[Any, Any, Any]:
    """(tokenizer, train loader, validation loader or None) for this data rank."""
    t = job.training
    return build_dataloaders(
        job.data,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_sequences,
        micro_batch_size=micro_batch_size(job, dims),
        dp_rank=dims.dp_rank,
        dp_size=dims.dp_size,
        seed=t.seed,
    )


def build_state(
    parts: ModelParts, optimizer: torch.optim.Optimizer, scheduler: Any, loader: Any
) -> dict[str, Stateful]:
    """What a checkpoint holds (the manager adds the step and the RNG state); a job without
    a data loader (RL: its prompts are addressed by step) passes None."""
    model = parts.state_model or parts.model
    state: dict[str, Stateful] = {
        "model": ModelState(model),
        "optimizer": OptimizerState(model, optimizer),
        "lr_scheduler": scheduler,
    }
    if loader is not None:
        state["dataloader"] = loader
    return state


@dataclass
class TrainBuilders:
    """The functions a Trainer builds its parts with; replace any to change one part."""

    data: Callable[[JobConfig, ParallelDims], tuple[Any, Any, Any]] = build_data
    model_config: Callable[[JobConfig], DecoderConfig] = build_model_config
    objective: Callable[[JobConfig], Objective] = build_objective
    model: Callable[..., ModelParts] = build_model_parts
    optimizer: Callable[[nn.Module, Any, torch.device], torch.optim.Optimizer] = build_optimizer
    lr_scheduler: Callable[..., Any] = build_lr_scheduler
    state: Callable[..., dict[str, Stateful]] = build_state
    """What a checkpoint holds; an RL run adds its rollout buffer, a reference model..."""
