"""Run under torchrun (gloo): Qwen3-VL (a vision encoder in front of the decoder) and Kimi K2.5
(MoonViT in front of the DeepSeek-V3 decoder; flavors named ``kimi_k25/...``) under parallel
layouts against one process.

    torchrun --standalone --nproc-per-node 2 tests/parallel/vl_worker.py fsdp tp ep pp ...

Every row holds images (one of two frames, absent slots, padding places) between vision
start/end tokens, with M-RoPE positions [B, T, 3] (Kimi K2.5: single frames, 1-D positions). Each layout trains 3 AdamW steps with
clipping through the trainer's own step (train/step.py passes the media; the pipeline cuts them
into micro-batches) from weights initialized shard by shard after parallelizing; the reference,
one process, runs the same micro-batches (the MoE balance loss is a function of one). Rank 0
prints one ``RESULT`` line per (layout, flavor) with the largest differences in loss, gradient
norm and the final weights (gathered as the export does), and ``REFUSED`` lines for layouts
that must be refused at build.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchloom.config.errors import ConfigError
from torchloom.data.mrope import mrope_positions
from torchloom.data.packing import Batch
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.registry import list_models
from torchloom.parallel import (
    ParallelConfig,
    ParallelDims,
    build_parallel_dims,
    destroy,
    init_distributed,
    leave,
    parallelize,
)
from torchloom.parallel.pipeline import build_pipeline
from torchloom.parallel.state import full_state_items
from torchloom.parallel.tensor_parallel import apply_tensor_parallel
from torchloom.train.expert_balance import expert_balance
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy
from torchloom.train.step import StepParts, TrainStep

# layout name -> (parallel config, flavors, model overrides)
LAYOUTS: dict[str, tuple[dict, tuple[str, ...], dict]] = {
    "fsdp": ({"dp_shard": 2}, ("debug", "debug_moe"), {}),
    "tp": ({"tp": 2, "dp_shard": 1}, ("debug", "debug_moe"), {}),  # sequence parallel
    "ep": ({"dp_shard": 2, "ep": 2}, ("debug_moe",), {}),
    # Untied (pp refuses tied embeddings); both DeepStack layers on the first stage.
    "pp": (
        {"pp": 2, "dp_shard": 1, "pp_layers_per_stage": [2, 1]},
        ("debug",),
        {"tie_embeddings": False},
    ),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, ("debug", "debug_moe"), {}),
    "fsdp_tp_ep": ({"dp_shard": 2, "tp": 2, "ep": 2}, ("debug_moe",), {}),
    # Kimi K2.5: MoonViT split by heads, the image tokens scattered before the sequence cut.
    "k25_tp": ({"tp": 2, "dp_shard": 1}, ("kimi_k25/debug",), {}),
    "k25_fsdp_tp_ep": ({"dp_shard": 2, "tp": 2, "ep": 2}, ("kimi_k25/debug",), {}),
    "k25_pp": (
        {"pp": 2, "dp_shard": 1, "pp_layers_per_stage": [2, 1]},
        ("kimi_k25/debug",),
        {"tie_embeddings": False},
    ),
}
# Refused at build, in one line: DeepStack layer 1 would sit on the second stage.
REFUSALS: dict[str, tuple[dict, str, dict]] = {
    "pp_deepstack_split": (
        {"pp": 2, "dp_shard": 1, "pp_layers_per_stage": [1, 2]},
        "debug",
        {"tie_embeddings": False},
    ),
}
STEPS, BATCH, SEQ_LEN, MAX_NORM, ADAM_EPS = 3, 4, 32, 0.5, 1e-6
SLOTS, PLACES = 2, 32
# Per row: its images' (t, h, w) grids in patches (merge windows of 2 x 2).
GRIDS = [[(1, 4, 4), (1, 4, 8)], [(2, 4, 4)], [(1, 8, 4)], [(1, 4, 4), (1, 4, 4)]]
CPU = torch.device("cpu")


def make_batches(config) -> list[dict]:
    """Rows of text and images, fixed shapes; labels ignored on the image placeholders."""
    if config.media_layout == "kimi_k25":
        return make_kimi_batches(config)
    gen = torch.Generator().manual_seed(1234)
    image, start, end = config.image_token_id, config.vision_start_token_id, 4091
    patch_dim, merge = config.vision.patch_dim, config.vision.spatial_merge_size
    batches = []
    for step in range(STEPS):
        rows, pixels, grids = [], torch.zeros(BATCH, SLOTS, PLACES, patch_dim), []
        for b in range(BATCH):
            row_grids = GRIDS[(b + step) % len(GRIDS)]
            tokens = torch.randint(0, 4000, (3,), generator=gen).tolist()
            for slot, (t, h, w) in enumerate(row_grids):
                pixels[b, slot, : t * h * w] = torch.randn(t * h * w, patch_dim, generator=gen)
                tokens += [start] + [image] * (t * h * w // merge**2) + [end]
                tokens += torch.randint(0, 4000, (2,), generator=gen).tolist()
            tail = torch.randint(0, 4000, (SEQ_LEN - len(tokens),), generator=gen).tolist()
            rows.append(tokens + tail)
            grids.append(list(row_grids) + [(0, 0, 0)] * (SLOTS - len(row_grids)))
        tokens = torch.tensor(rows)
        grid = torch.tensor(grids)
        labels = torch.randint(0, 4000, (BATCH, SEQ_LEN), generator=gen)
        labels[(tokens == image) | (torch.rand(BATCH, SEQ_LEN, generator=gen) < 0.2)] = IGNORE_INDEX
        positions = torch.stack(
            [mrope_positions(t, g, image, start, merge) for t, g in zip(tokens, grid)]
        )
        batches.append({"tokens": tokens, "labels": labels, "positions": positions,
                        "pixel_values": pixels, "image_grid_thw": grid})  # fmt: skip
    return batches


def make_kimi_batches(config) -> list[dict]:
    """Kimi K2.5's rows: single-frame images of h x w patches, h * w / merge^2 placeholders
    between media begin/end tokens, 1-D positions."""
    gen = torch.Generator().manual_seed(1234)
    image, begin, end = (
        config.image_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    patch_values, merge = config.vision.patch_values, config.vision.merge
    batches = []
    for step in range(STEPS):
        rows, pixels, grids = [], torch.zeros(BATCH, SLOTS, PLACES, patch_values), []
        for b in range(BATCH):
            row_grids = [g for g in GRIDS[(b + step) % len(GRIDS)] if g[0] == 1] or [(1, 4, 4)]
            tokens = torch.randint(0, 4000, (3,), generator=gen).tolist()
            for slot, (_, h, w) in enumerate(row_grids):
                pixels[b, slot, : h * w] = torch.randn(h * w, patch_values, generator=gen)
                tokens += [begin] + [image] * (h * w // merge**2) + [end]
                tokens += torch.randint(0, 4000, (2,), generator=gen).tolist()
            tail = torch.randint(0, 4000, (SEQ_LEN - len(tokens),), generator=gen).tolist()
            rows.append(tokens + tail)
            grids.append(list(row_grids) + [(0, 0, 0)] * (SLOTS - len(row_grids)))
        tokens = torch.tensor(rows)
        labels = torch.randint(0, 4000, (BATCH, SEQ_LEN), generator=gen)
        labels[(tokens == image) | (torch.rand(BATCH, SEQ_LEN, generator=gen) < 0.2)] = IGNORE_INDEX
        positions = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN).clone()
        batches.append({"tokens": tokens, "labels": labels, "positions": positions,
                        "pixel_values": pixels, "image_grid_thw": torch.tensor(grids)})  # fmt: skip
    return batches


def rows_of(batch: dict, rows: slice) -> Batch:
    media = {k: batch[k][rows] for k in ("pixel_values", "image_grid_thw")}
    return Batch(batch["tokens"][rows], batch["labels"][rows], batch["positions"][rows],
                 media=media)  # fmt: skip


def config_of(flavor: str, overrides: dict):
    """``flavor`` of qwen3_vl, or ``family/flavor``."""
    family, _, flavor = flavor.rpartition("/")
    family = family or "qwen3_vl"
    return resolve_model_config(ModelConfig(name=family, flavor=flavor, overrides=overrides))


def tp_plan_of(config):
    """The family's own plan (the family whose config class this is)."""
    (spec,) = [s for s in list_models() if type(config) is s.config_cls]
    return spec.tp_plan


def build(config) -> torch.nn.Module:
    with torch.device("meta"):
        return build_model(config)


def train(parts: StepParts, micro_batches: list[list[Batch]]) -> list[dict]:
    step = TrainStep(parts, before_update=lambda: None)
    records = []
    for batches in micro_batches:
        loss, norm, _ = step(batches)
        records.append({"loss": loss.item(), "norm": norm.item()})
    return records


def _parts(model, pipeline, dims: ParallelDims, config, lr: float = 1e-3) -> StepParts:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, eps=ADAM_EPS)
    return StepParts(model, pipeline, CrossEntropy(), optimizer, dims, CPU, MAX_NORM,
                     expert_balance=expert_balance(model, config, dims, CPU))  # fmt: skip


def reference_run(
    config, batches: list[dict], pieces: int, rows=rows_of, lr: float = 1e-3
) -> tuple:
    """One process, each global batch as the ``pieces`` micro-batches the layout's forwards see
    (``rows(batch, slice)`` cuts them)."""
    model = build(config)
    model.to_empty(device=CPU)
    model.init_weights(0)
    dims = ParallelDims(ParallelConfig().resolve(1), 1, 0, "cpu")
    share = BATCH // pieces
    micro = [[rows(b, slice(r * share, (r + 1) * share)) for r in range(pieces)]
             for b in batches]  # fmt: skip
    records = train(_parts(model, None, dims, config, lr), micro)
    return records, {n: t.clone() for n, t in model.state_dict().items()}


def parallel_run(
    config, layout: dict, batches: list[dict], rows=rows_of, lr: float = 1e-3
) -> tuple:
    """(records, full state, dims, what this rank holds: the model or its pipeline stages)."""
    dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
    model, pipeline = build(config), None
    if dims.degrees.pp > 1:
        pipeline = build_pipeline(model, dims, seq_len=SEQ_LEN, tp_plan=tp_plan_of(config),
                                  device=CPU, objective=CrossEntropy())  # fmt: skip
        for stage in pipeline.stages:
            stage.to_empty(device=CPU)
            stage.init_weights(0)
        held = pipeline.stages
    else:
        parallelize(model, dims, seq_len=SEQ_LEN, tp_plan=tp_plan_of(config))
        model.to_empty(device=CPU)
        model.init_weights(0)
        held = model
    share = BATCH // dims.dp_size
    micro = [[rows(b, slice(dims.dp_rank * share, (dims.dp_rank + 1) * share))]
             for b in batches]  # fmt: skip
    records = train(_parts(held, pipeline, dims, config, lr), micro)
    state = dict(pipeline.full_state_items() if pipeline else full_state_items(held))
    return records, state, dims, held


def encoder_split(held, dims: ParallelDims) -> int:
    """How many of the vision encoder's weight matrices tensor parallelism split."""
    if dims.degrees.tp == 1 or isinstance(held, list):
        return 0
    tp_dim = dims.mesh("tp").mesh_dim_names[0]
    count = 0
    for name, param in held.named_parameters():
        if name.split(".")[0] in ("visual", "vision_tower") and isinstance(param, DTensor):
            placement = param.placements[param.device_mesh.mesh_dim_names.index(tp_dim)]
            count += param.ndim == 2 and placement.is_shard()
    return count


def generation_run(config, tokens, positions, media: dict) -> dict:
    """Logits of generation's replicated-stream plan (``sequence_parallel=False``) at tp 2
    against one process (eval, no grad), on one batch with media."""
    reference = build(config)
    reference.to_empty(device=CPU)
    reference.init_weights(0)
    dims = build_parallel_dims(ParallelConfig(tp=2, dp_shard=1), "cpu")
    model = build(config)
    plan = tp_plan_of(config)(model, 2, False, sequence_parallel=False)
    apply_tensor_parallel(model, dims.mesh("tp"), plan)
    model.to_empty(device=CPU)
    model.init_weights(0)
    with torch.no_grad():
        want = reference.eval()(tokens, positions, media=media)
        got = model.eval()(tokens, positions, media=media)
    return {"logits_diff": (want - got).abs().max().item(), "logits_scale": want.abs().max().item()}


def compare(layout: str, flavor: str, ref: tuple, run: tuple, seconds: float) -> dict:
    (ref_steps, ref_state), (steps, state) = ref, run
    common = [n for n in ref_state if n in state]
    diff, worst = max(((ref_state[n] - state[n]).abs().max().item(), n) for n in common)
    return {
        "layout": layout, "flavor": flavor, "seconds": round(seconds, 2),
        "loss_diff": max(abs(r["loss"] - p["loss"]) for r, p in zip(ref_steps, steps)),
        "norm_diff": max(abs(r["norm"] - p["norm"]) for r, p in zip(ref_steps, steps)),
        "losses": [p["loss"] for p in steps], "norms": [p["norm"] for p in steps],
        "param_diff": diff, "worst_param": worst,
        "missing": sorted(set(ref_state) ^ set(state)),
    }  # fmt: skip


def main(names: list[str]) -> None:
    init_distributed("cpu")
    torch.manual_seed(0)
    rank0 = dist.get_rank() == 0
    references: dict[tuple, tuple] = {}
    for name in names:
        if name in REFUSALS:
            layout, flavor, overrides = REFUSALS[name]
            dims = build_parallel_dims(ParallelConfig(**layout), "cpu")
            try:
                config = config_of(flavor, overrides)
                build_pipeline(build(config), dims, seq_len=SEQ_LEN, tp_plan=tp_plan_of(config),
                               device=CPU, objective=CrossEntropy())  # fmt: skip
                message = None
            except ConfigError as error:
                message = str(error)
            if rank0:
                print("REFUSED " + json.dumps({"layout": name, "message": message}), flush=True)
            continue
        if name == "generation":
            for flavor in ("debug", "kimi_k25/debug"):
                config = config_of(flavor, {})
                first = make_batches(config)[0]
                media = {k: first[k] for k in ("pixel_values", "image_grid_thw")}
                logits = generation_run(config, first["tokens"], first["positions"], media)
                if rank0:
                    result = {"layout": name, "flavor": flavor} | logits
                    print("RESULT " + json.dumps(result), flush=True)
            continue
        layout, flavors, overrides = LAYOUTS[name]
        for flavor in flavors:
            begin = time.perf_counter()
            config = config_of(flavor, overrides)
            batches = make_batches(config)
            records, state, dims, held = parallel_run(config, layout, batches)
            split = encoder_split(held, dims)
            pieces = dims.dp_size * (2 if dims.degrees.pp > 1 else 1)  # pp: 2 microbatches
            key = (flavor, json.dumps(overrides, sort_keys=True), pieces)
            if key not in references:
                references[key] = reference_run(config, batches, pieces)
            result = compare(name, flavor, references[key], (records, state),
                             time.perf_counter() - begin) | {"encoder_split": split}  # fmt: skip
            if rank0:
                print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
