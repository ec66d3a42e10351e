"""Mixture-of-experts training speed on one device: torchloom's training step on MoE shapes,
the same step as benchmarks/train.py (whose helpers it reuses), one table, JSON to --json.

    python benchmarks/train_moe.py --optimizer triton                # DeepSeek-V3 16B cut to 6 layers
    python benchmarks/train_moe.py --shapes qwen3-30B-A3B-6L --batch 4
    python benchmarks/train_moe.py --shapes tiny --device cpu --no-compile --steps 2 --warmup 1

Shapes. dsv3-16B-6L: the deepseek_v3 "16B" flavor (DeepSeek-V2-Lite's shape: MLA with
kv_lora_rank 512, 64 routed + 2 shared experts, top-6, vocab 102400) cut to 6 layers (1 dense +
5 MoE), seq 4096, the shape TorchTitan's deepseek_v3 16B debug run uses; qwen3-30B-A3B-6L:
Qwen3-30B-A3B (128 experts, top-8) cut to 6 layers; tiny / dsv3-tiny: the debug flavors, for
the CPU. benchmarks/torchtitan_anchor.py runs TorchTitan's own trainer on dsv3-16B-6L for a
side-by-side (benchmarks/RESULTS.md).

Rows. torchloom: FSDP at world size 1 (fp32 master weights, bf16 compute, fp32 gradient
reduction), each block compiled, experts as grouped GEMMs (torch._grouped_mm on sm90+);
torchloom-chunked: that with the chunked fused output head + cross-entropy (no [B, T, V]
logits); torchloom-autocast: bf16 autocast over fp32 weights, no FSDP, compiled (gradients and
AdamW in fp32 as with FSDP, without its world-size-1 copies); torchloom-autocast-chunked: that
with the chunked head;
torchloom-eager: autocast, nothing compiled. Random tokens, AdamW, clip 1.0, as train.py.

FLOPs on active parameters: DecoderConfig.flops_per_token (each layer's own count: attention,
the router, the top_k routed and the shared experts a token uses, the output head), so MFU is
comparable with dense models and with TorchTitan's own MoE MFU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
from train import (
    SEED,
    _fmt,
    _free,
    add_step_options,
    bench_device,
    matmul_tflops,
    measure,
    profile_steps,
    torchloom_step,
)

from torchloom.models import ModelConfig, resolve_model_config
from torchloom.parallel import ParallelConfig, build_parallel_dims, destroy
from torchloom.train.loss import CrossEntropy
from torchloom.train.metrics import device_peak_tflops
from torchloom.train.profiling import format_kernel_summary

SHAPES = {  # name: (family, flavor, architecture overrides, default sequence length)
    "tiny": ("qwen3_moe", "debug", {}, 256),
    "dsv3-tiny": ("deepseek_v3", "debug", {}, 256),
    "dsv3-16B-6L": ("deepseek_v3", "16B", {"num_layers": 6, "mtp_layers": 0}, 4096),
    "qwen3-30B-A3B-6L": ("qwen3_moe", "30B-A3B", {"num_layers": 6}, 4096),
}
ROWS = (
    "torchloom",
    "torchloom-chunked",
    "torchloom-autocast",
    "torchloom-autocast-chunked",
    "torchloom-eager",
)
ROW_WIDTH = max(map(len, ROWS))


def run_row(row: str, shape: str, args: argparse.Namespace, device: torch.device, dims,
            batches: list[torch.Tensor]) -> dict:  # fmt: skip
    family, flavor, overrides, _ = SHAPES[shape]
    loss_impl = "chunked" if row.endswith("-chunked") else "full"
    model_cfg = ModelConfig(name=family, flavor=flavor, overrides=overrides, loss_impl=loss_impl)
    cfg = resolve_model_config(model_cfg)
    seq = batches[0].shape[1] - 1
    record = {"row": row, "shape": shape, "family": family, "flavor": flavor,
              "overrides": overrides, "batch": args.batch, "seq": seq, "error": None,
              "active_params": cfg.flops_per_token(0) // 6, "params": cfg.num_params()}  # fmt: skip
    try:
        fsdp = dims if row in ("torchloom", "torchloom-chunked") else None
        compile_ = not args.no_compile and row != "torchloom-eager"
        step = torchloom_step(cfg, CrossEntropy(loss_impl), device, torch.float32, seq, fsdp,
                              compile_, args.remat, args.optimizer)  # fmt: skip
        seconds, losses = measure(step, batches, args.warmup, device)
        if args.profile_steps and device.type == "cuda":
            record["profile"] = profile_steps(step, batches[: args.profile_steps], device)
            print(format_kernel_summary(f"{row} {shape}", record["profile"]), flush=True)
    except Exception as err:  # an OOM (or anything else) becomes this row's error
        record["error"] = (
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
        )
        print(f"  {row} {shape}: {record['error']}", flush=True)
        return record
    tokens_per_s = args.batch * seq / seconds
    record |= {"step_s": seconds, "tokens_per_s": tokens_per_s,
               "tflops": tokens_per_s * cfg.flops_per_token(seq) / 1e12, "losses": losses}  # fmt: skip
    if device.type == "cuda":
        record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"  {row} {shape}: {seconds:.3f} s/step, loss {losses[-1]:.4f}", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["dsv3-16B-6L"], choices=list(SHAPES))
    default_rows = ["torchloom-autocast-chunked", "torchloom-chunked"]
    parser.add_argument("--rows", nargs="+", default=default_rows,
                        choices=ROWS)  # fmt: skip
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    add_step_options(parser)
    parser.add_argument("--json", type=Path, default=Path("outputs/train_moe_bench.json"))
    args = parser.parse_args()
    device = bench_device(args.device)
    peak, device_name = device_peak_tflops(device)
    ceiling, matmul = matmul_tflops(device)
    print(f"{device_name}: matmul ceiling {ceiling:.1f} TFLOP/s ({matmul})", flush=True)
    dims = build_parallel_dims(ParallelConfig(fsdp_always=True), device.type)
    rows = []
    for shape in dict.fromkeys(args.shapes):
        family, flavor, _, seq = SHAPES[shape]
        vocab = resolve_model_config(ModelConfig(name=family, flavor=flavor)).vocab_size
        generator, size = torch.Generator().manual_seed(SEED), (args.batch, (args.seq or seq) + 1)
        batches = [torch.randint(0, vocab, size, generator=generator).to(device)
                   for _ in range(args.warmup + args.steps)]  # fmt: skip
        for row in args.rows:
            rows.append(run_row(row, shape, args, device, dims, batches))
            _free(device)
    print(f"\n{'row':<{ROW_WIDTH}} {'shape':<16} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'mem GiB':>8} {'last loss':>9}")  # fmt: skip
    for r in rows:
        if r["error"]:
            print(f"{r['row']:<{ROW_WIDTH}} {r['shape']:<16} error: {r['error'][:80]}")
            continue
        r["mfu"] = 100 * r["tflops"] / peak if peak else None
        print(f"{r['row']:<{ROW_WIDTH}} {r['shape']:<16} {r['tokens_per_s']:>10,.0f} "
              f"{r['tflops']:>8.2f} {_fmt(r['mfu'], '.1f', '%'):>6} "
              f"{_fmt(r.get('peak_mem_gib'), '.2f'):>8} {r['losses'][-1]:>9.4f}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": device_name, "peak_tflops": peak, "matmul_tflops": ceiling,
        "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "optimizer": args.optimizer,
        "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")
    destroy()


if __name__ == "__main__":
    main()
