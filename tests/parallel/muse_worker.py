"""Run under torchrun (gloo): Muse Glimmer (images) and Muse Spark (images and audio) under tensor
parallelism against one process.

    torchrun --standalone --nproc-per-node 2 tests/parallel/muse_worker.py tp generation

Every row holds text, images (absent slots, padding places, windowed and full ViT layers) and,
for Spark, audio clips of several lengths, with 1-D positions. A training layout runs 3 AdamW
steps with clipping through the trainer's own step from weights initialized shard by shard
after parallelizing, against one process on the same micro-batches (Spark's balance loss on).
Rank 0 prints one ``RESULT`` line per (layout, flavor) with the largest differences in loss,
gradient norm and final weights, the encoders' weight matrices left whole, and the parameters
outside MoE layers that are no DTensor on the tp mesh. ``generation`` compares the logits of
the replicated-stream plan (``sequence_parallel=False``) with one process.

Both sides run in float64 (FSDP computing and reducing in the parameters' dtype), at lr 1e-4.
Muse amplifies rounding: padded audio samples make zero vectors whose RMSNorm gradient is
1/sqrt(eps), and each expert's tiny output is normed. In fp32 the single-process run is
itself ~1e-3 (Spark's gradient norm) off its float64 twin after 3 steps at lr 1e-3, so no
split (a tensor-parallel sum in another order) could be told from noise at 1e-5; in float64 only
the model's fp32 islands (the loss, the router) differ, and a wrong split still moves every
number by orders of magnitude more (lr-sized weight steps).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from tests.parallel.vl_worker import (
    compare,
    config_of,
    generation_run,
    parallel_run,
    reference_run,
)
from torchloom.data.packing import Batch
from torchloom.parallel import (
    data_parallel,
    destroy,
    init_distributed,
    leave,
)
from torchloom.parallel.expert_parallel import moe_layers
from torchloom.train.loss import IGNORE_INDEX

FLAVORS = ("muse_glimmer/debug", "muse_spark/debug")
# Spark balances its experts both ways: the balance loss and choice-bias updates.
OVERRIDES = {"muse_spark/debug": {"moe.balance_loss": "sequence", "moe.balance_loss_coef": 0.01,
                                  "moe.bias_update_rate": 0.01}}  # fmt: skip
# layout name -> (parallel config (sequence parallel, loss parallel), flavors)
LAYOUTS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "tp": ({"tp": 2, "dp_shard": 1}, FLAVORS),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, FLAVORS),
    "ep": ({"dp_shard": 2, "ep": 2}, ("muse_spark/debug",)),  # the latent MoE's experts
    "fsdp_tp_ep": ({"dp_shard": 2, "tp": 2, "ep": 2}, ("muse_spark/debug",)),
    # Two stages, the encoders on the first (untied: pp refuses tied embeddings).
    "pp": ({"pp": 2, "dp_shard": 1}, FLAVORS),
}
STEPS, BATCH, SEQ_LEN, LR = 3, 4, 48, 1e-4
SLOTS, PLACES, CLIP_SLOTS, SAMPLES = 2, 32, 2, 64
# Per row: its images' (t, h, w) grids in patches (2 x 2 merge windows, 4 x 4-patch ViT
# windows) and its clips' lengths in samples (16 per audio token, the last one padded).
GRIDS = [[(1, 4, 4), (1, 4, 8)], [(1, 8, 4)], [], [(1, 4, 4), (1, 4, 4)]]
CLIPS = [[40, 64], [17], [9, 33], []]
ENCODERS = ("vision_tower", "audio_tower")


def make_batches(config) -> list[dict]:
    """Rows of text, images and (Spark) clips at fixed shapes; labels ignored on the media."""
    gen = torch.Generator().manual_seed(1234)
    hears = hasattr(config, "audio")
    image, audio = config.image_token_id, getattr(config, "audio_token_id", -1)
    patch_dim, merge = config.vision.patch_dim, config.vision.merge_size
    per_token = config.audio.samples_per_token if hears else 1
    batches = []
    for step in range(STEPS):
        pixels = torch.zeros(BATCH, SLOTS, PLACES, patch_dim)
        waves = torch.zeros(BATCH, CLIP_SLOTS, SAMPLES, 1)
        lengths = torch.zeros(BATCH, CLIP_SLOTS, dtype=torch.long)
        grids, rows = [], []
        for b in range(BATCH):
            row_grids = GRIDS[(b + step) % len(GRIDS)]
            tokens = torch.randint(0, 4000, (3,), generator=gen).tolist()
            for slot, (t, h, w) in enumerate(row_grids):
                pixels[b, slot, : t * h * w] = torch.randn(t * h * w, patch_dim, generator=gen)
                tokens += [image] * (t * h * w // merge**2)
                tokens += torch.randint(0, 4000, (2,), generator=gen).tolist()
            for slot, samples in enumerate(CLIPS[(b + step) % len(CLIPS)] if hears else []):
                waves[b, slot, :samples, 0] = torch.randn(samples, generator=gen)
                lengths[b, slot] = samples
                tokens += [audio] * -(-samples // per_token)
                tokens += torch.randint(0, 4000, (2,), generator=gen).tolist()
            tail = torch.randint(0, 4000, (SEQ_LEN - len(tokens),), generator=gen).tolist()
            rows.append(tokens + tail)
            grids.append(list(row_grids) + [(0, 0, 0)] * (SLOTS - len(row_grids)))
        tokens = torch.tensor(rows)
        labels = torch.randint(0, 4000, (BATCH, SEQ_LEN), generator=gen)
        media_BT = (tokens == image) | (tokens == audio)
        labels[media_BT | (torch.rand(BATCH, SEQ_LEN, generator=gen) < 0.2)] = IGNORE_INDEX
        media = {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}
        if hears:
            media |= {"audio_values": waves, "audio_lengths": lengths}
        positions = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN).clone()
        batches.append({"tokens": tokens, "labels": labels, "positions": positions, "media": media})
    return batches


def rows_of(batch: dict, rows: slice) -> Batch:
    media = {key: value[rows] for key, value in batch["media"].items()}
    return Batch(batch["tokens"][rows], batch["labels"][rows], batch["positions"][rows],
                 media=media)  # fmt: skip


def layout_report(model: torch.nn.Module) -> dict:
    """The encoders' weight matrices tensor parallelism left whole, and the parameters outside
    MoE layers (whose weights are data-parallel over tp) that are no DTensor on the tp mesh."""
    in_moe = {id(p) for layer in moe_layers(model) for p in layer.parameters()}
    whole, off_mesh = [], []
    for name, param in model.named_parameters():
        axes = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
        if "tp" not in axes:
            off_mesh += [] if id(param) in in_moe else [name]
        elif name.split(".")[0] in ENCODERS and param.ndim == 2:
            whole += [] if param.placements[axes.index("tp")].is_shard() else [name]
    return {"whole_encoder_matrices": whole, "off_tp_mesh": off_mesh}


def main(names: list[str]) -> None:
    init_distributed("cpu")
    torch.set_default_dtype(torch.float64)  # see the module docstring
    data_parallel.mixed_precision_policy = lambda config, device_type: MixedPrecisionPolicy()
    torch.manual_seed(0)
    rank0 = dist.get_rank() == 0
    for name in names:
        for flavor in FLAVORS if name == "generation" else LAYOUTS[name][1]:
            begin = time.perf_counter()
            config = config_of(flavor, OVERRIDES.get(flavor, {}))
            batches = make_batches(config)
            if name == "generation":
                first = batches[0]
                logits = generation_run(config, first["tokens"], first["positions"], first["media"])
                result = {"layout": name, "flavor": flavor} | logits
            else:
                records, state, dims, held = parallel_run(
                    config, LAYOUTS[name][0], batches, rows_of, LR
                )
                report = layout_report(held) if "tp" in name else {}
                pieces = dims.dp_size * (2 if dims.degrees.pp > 1 else 1)  # pp: 2 microbatches
                reference = reference_run(config, batches, pieces, rows_of, LR)
                result = compare(name, flavor, reference, (records, state), 0.0) | report
                biases = [
                    t.abs().max().item() for n, t in state.items() if n.endswith("expert_bias")
                ]
                result["expert_bias_max"] = max(biases, default=0.0)
            result["seconds"] = round(time.perf_counter() - begin, 2)
            if rank0:
                print("RESULT " + json.dumps(result), flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
    leave(0)  # skips the interpreter teardown, where gloo can abort a finished rank
