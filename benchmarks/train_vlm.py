"""Vision-language training speed on one device: a Qwen3-VL SFT step with images beside the
text-only step of the same decoder on the same tokens, one table, JSON to --json.

    python benchmarks/train_vlm.py                                  # Qwen3-VL 2B, 4 x 4096
    python benchmarks/train_vlm.py --images-per-row 4 --image-side 448
    python benchmarks/train_vlm.py --shape debug --device cpu --no-compile --steps 2 --warmup 1

Rows (the same weights, tokens, labels and optimizer in each):
- multimodal: forward with `media` (the encoder on every row's images, the image tokens
  gathered into the placeholders, DeepStack), backward, clip, AdamW;
- text-only: the same token rows (the placeholders embedded as ordinary tokens) without media;
- encoder: the vision encoder's forward and backward alone on the same images (its share of
  the multimodal step).

Images are generated on the device (random pixels at a fixed grid, `--image-side` pixels
square): each row holds `--images-per-row` images of side/16 x side/16 patches, each written
into the row as <|vision_start|> + patches/4 image pads + <|vision_end|>, the rest random text.

FLOPs. Text: DecoderConfig.flops_per_token x tokens. Vision: MultimodalDecoder.media_flops on
the batch's grids (per patch: 6 x the encoder's matmul weights a patch uses, attention within
each image, the mergers per merged token). `mfu` uses both; `mfu_per_token_vision` bills the
encoder's parameters per decoder token instead (the count some trainers report), for contrast.
bf16 autocast over fp32 weights, each decoder Block and VisionBlock compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from gpu_bench import median_seconds, write_report

from torchloom.data.mrope import mrope_positions
from torchloom.data.packing import IGNORE_INDEX
from torchloom.models import build_model
from torchloom.models.qwen3_vl.config import QWEN3_VL_FLAVORS, Qwen3VLConfig
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.loss import CrossEntropy
from torchloom.train.metrics import device_peak_tflops
from torchloom.train.optim import OptimizerConfig, build_optimizer, clip_gradients

SEED = 0


def vl_config(shape: str, layers: int | None) -> Qwen3VLConfig:
    cfg = QWEN3_VL_FLAVORS[shape]
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    cfg.validate()
    return cfg


def make_batch(
    cfg: Qwen3VLConfig, batch: int, seq: int, images: int, side: int, device: torch.device,
    generator: torch.Generator,
) -> dict:  # fmt: skip
    """Random rows with ``images`` square images each: tokens, labels, M-RoPE positions, media."""
    v = cfg.vision
    grid = side // v.patch_size
    if grid % v.spatial_merge_size:
        raise SystemExit(f"--image-side {side}: side/patch must be a multiple of the merge")
    patches = grid * grid
    merged = patches // v.spatial_merge_size**2
    if images * (merged + 2) >= seq:
        raise SystemExit(f"{images} images of {merged} tokens do not fit in {seq} tokens")
    special = {cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator)
    tokens[torch.isin(tokens, torch.tensor(sorted(special)))] = 0
    stride = seq // images
    for b in range(batch):
        for i in range(images):
            at = i * stride + 1
            tokens[b, at] = cfg.vision_start_token_id
            tokens[b, at + 1 : at + 1 + merged] = cfg.image_token_id
            tokens[b, at + 1 + merged] = cfg.vision_end_token_id
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
    labels[torch.isin(labels, torch.tensor(sorted(special)))] = IGNORE_INDEX
    grids = torch.tensor([1, grid, grid]).expand(batch, images, 3).contiguous()
    positions = torch.stack([
        mrope_positions(row, grids[b], cfg.image_token_id, cfg.vision_start_token_id,
                        v.spatial_merge_size)
        for b, row in enumerate(inputs)
    ])  # fmt: skip
    pixels = torch.randn(batch, images, patches, v.patch_dim, generator=generator)
    return {
        "tokens": inputs.to(device), "labels": labels.to(device),
        "positions": positions.to(device), "text_positions": None,
        "media": {"pixel_values": pixels.to(device), "image_grid_thw": grids.to(device)},
    }  # fmt: skip


def build(cfg: Qwen3VLConfig, device: torch.device, compile_: bool) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device=device)
    model.init_weights(SEED)
    compile_regions(model, CompileConfig(enabled=compile_, regions=["Block", "VisionBlock"]))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="2B", choices=sorted(QWEN3_VL_FLAVORS))
    parser.add_argument("--layers", type=int, default=None, help="cut the decoder to N layers")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--images-per-row", type=int, default=2)
    parser.add_argument("--image-side", type=int, default=448, help="pixels (square)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/train_vlm.json"))
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    torch.manual_seed(SEED)
    cfg = vl_config(args.shape, args.layers)
    generator = torch.Generator().manual_seed(SEED)
    data = make_batch(cfg, args.batch, args.seq, args.images_per_row, args.image_side, device,
                      generator)  # fmt: skip
    model = build(cfg, device, not args.no_compile)
    optimizer = build_optimizer(model, OptimizerConfig(), device)
    objective = CrossEntropy()
    autocast = device.type == "cuda"
    labels = data["labels"]
    num_labels = int((labels != IGNORE_INDEX).sum())

    def step(media: dict | None) -> None:
        positions = data["positions"] if media else data["positions"][..., 0]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(data["tokens"], positions, objective=objective,
                        targets={"labels": labels}, media=media)  # fmt: skip
        (out.loss / num_labels).backward()
        clip_gradients(optimizer, model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def encoder_only() -> None:
        media = data["media"]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            merged, deepstack = model.visual(media["pixel_values"], media["image_grid_thw"])
            total = merged.float().sum() + sum(d.float().sum() for d in deepstack)
        total.backward()
        model.zero_grad(set_to_none=True)

    tokens = args.batch * args.seq
    text_flops = cfg.flops_per_token(args.seq) * tokens
    media_flops = model.media_flops(data["media"])
    vision_params = sum(p.numel() for p in model.visual.parameters())
    peak, device_name = device_peak_tflops(device)
    rows = []
    for name, fn, flops in (
        ("multimodal", lambda: step(data["media"]), text_flops + media_flops),
        ("text-only", lambda: step(None), text_flops),
        ("encoder", encoder_only, media_flops),
    ):
        seconds = median_seconds(fn, args.steps, args.warmup, cuda=device.type == "cuda")
        row = {
            "row": name, "step_s": seconds, "tokens_per_s": tokens / seconds,
            "tflops": flops / seconds / 1e12,
            "mfu": 100 * flops / seconds / 1e12 / peak if peak else None,
        }  # fmt: skip
        if name == "multimodal":
            naive = text_flops + 6 * vision_params * tokens
            row["mfu_per_token_vision"] = 100 * naive / seconds / 1e12 / peak if peak else None
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        rows.append(row)
    by = {r["row"]: r for r in rows}
    by["multimodal"]["vs_text_only"] = by["text-only"]["step_s"] / by["multimodal"]["step_s"]
    by["multimodal"]["encoder_share"] = by["encoder"]["step_s"] / by["multimodal"]["step_s"]

    print(f"{device_name}: qwen3_vl {args.shape}" + (f" cut to {args.layers} layers" if
          args.layers else "") + f", {args.batch} x {args.seq} tokens, {args.images_per_row} "
          f"images of {args.image_side}px per row; text {text_flops / 1e12:.1f} TFLOP, vision "
          f"{media_flops / 1e12:.2f} TFLOP per step")  # fmt: skip
    print(f"{'row':<12}{'step s':>9}{'tok/s':>11}{'TFLOP/s':>9}{'MFU %':>8}")
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1f}"
        print(f"{r['row']:<12}{r['step_s']:>9.4f}{r['tokens_per_s']:>11.0f}{r['tflops']:>9.1f}"
              f"{mfu:>8}")  # fmt: skip
    mm = by["multimodal"]
    print(
        f"multimodal tokens/s = {mm['vs_text_only']:.3f} x text-only; encoder share of the "
        f"step {100 * mm['encoder_share']:.1f}%"
    )
    if device.type == "cuda":
        write_report(args.json, rows)


if __name__ == "__main__":
    main()
