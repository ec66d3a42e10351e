"""DeepSeek-V4-Flash-shaped training on one GPU, and the hyper-connections' share of its step:
one table, JSON to --json.

    python benchmarks/deepseek_v4.py                      # one H200: the deepseek_v4_flash4 recipe
    python benchmarks/deepseek_v4.py --small              # the CPU: debug flavor, 2 steps, eager
    python benchmarks/deepseek_v4.py --parts hc-compiled --profile-steps 3   # mHC's top kernels

Parts (each catches its own failure, an OOM included, and records it in the JSON):

- train: the deepseek_v4_flash4 recipe (DeepSeek-V4-Flash's first 4 layers, 16 routed experts
  each; compiled blocks, bf16 autocast over fp32 weights, full recomputation) through
  ``torchloom train`` in a subprocess for --steps steps; the median tokens/s, TFLOP/s, MFU (the
  trainer's: FLOPs on active parameters, DeepSeekV4.flops_per_token) and step time over the
  steps after --warmup, and the peak memory, read from its metrics.jsonl.
- hc: every hyper-connection call of one micro-batch (each block's two HyperConnections with
  their ``join``, the HyperHead) at the recipe's shapes ([B, T, 4, 4096] fp32 streams, bf16
  branch outputs under autocast, as in the trainer), forward + backward, compiled as the trainer
  compiles (compile_regions, fullgraph) and eager. Its share of the step is that time (plus one
  more forward of the blocks' calls when the recipe recomputes) times the micro-batches per
  step, over the train part's median step time. Compiled alone, the calls cannot fuse with
  the norms and projections around them as they do inside a compiled block, so the share is an
  upper bound of what they cost there.

Shapes are the job's: the recipe with the --extra flags that the train part gets too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from train import _fmt, _free, bench_device, measure, profile_steps

from torchloom.cli import resolve_job
from torchloom.models import resolve_model_config
from torchloom.models.components.hyper_connections import HyperConnection, HyperHead
from torchloom.models.components.param_init import ParamInit
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.metrics import device_peak_tflops
from torchloom.train.profiling import format_kernel_summary

ROOT = Path(__file__).resolve().parents[1]
RECIPE, SMALL_RECIPE = "deepseek_v4_flash4", "deepseek_v4_debug"
PARTS = ("train", "hc-compiled", "hc-eager")  # train first: on a GPU no other part has run


class HyperConnectionCall(nn.Module):
    """One branch's hyper-connection as a block runs it: collapse the streams into the branch
    input, then ``join`` the branch output back (the branch itself is a given tensor)."""

    def __init__(self, hc: HyperConnection) -> None:
        super().__init__()
        self.hc = hc

    def forward(self, streams_BTND: torch.Tensor, branch_BTD: torch.Tensor) -> torch.Tensor:
        post_BTN, comb_BTNN, x_BTD = self.hc(streams_BTND)
        # In the model x feeds the branch: the stand-in output passes x a gradient too (one
        # multiply-add more than the block runs).
        branch_BTD = branch_BTD + 0 * x_BTD.to(branch_BTD.dtype)
        return HyperConnection.join(streams_BTND, branch_BTD, post_BTN, comb_BTNN)


class HyperConnections(nn.Module):
    """Every hyper-connection call of a forward: two per block, then the head."""

    def __init__(self, cfg, device: torch.device) -> None:
        super().__init__()
        hc = dict(streams=cfg.hc_streams, sinkhorn_iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                  norm_eps=cfg.norm_eps, init_std=cfg.init_std)  # fmt: skip
        with torch.device(device):
            calls = [HyperConnectionCall(HyperConnection(cfg.dim, **hc)) for _ in range(2 * cfg.num_layers)]  # fmt: skip
            self.calls = nn.ModuleList(calls)
            self.head = HyperHead(cfg.dim, cfg.hc_streams, cfg.hc_eps, cfg.norm_eps, cfg.init_std)
        init = ParamInit(self, seed=0)  # as the model's: fn normal, base 0, scale 1
        with torch.no_grad():
            for call in self.calls:
                call.hc.init_weights(init)
            self.head.init_weights(init)

    def forward(self, streams_BTND: torch.Tensor, branches_LBTD: torch.Tensor) -> torch.Tensor:
        for call, branch_BTD in zip(self.calls, branches_LBTD.unbind(0), strict=True):
            streams_BTND = call(streams_BTND, branch_BTD)
        return self.head(streams_BTND)


def run_hc(args: argparse.Namespace, cfg, device: torch.device, micro: int, seq: int,
           autocast: torch.dtype | None, compiled: bool) -> dict:  # fmt: skip
    """Forward and forward + backward seconds of one micro-batch's hyper-connection calls."""
    record: dict = {"part": "hc-compiled" if compiled else "hc-eager", "error": None}
    try:
        module = HyperConnections(cfg, device)
        blocks = module.calls
        if compiled:
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            compile_regions(module, CompileConfig(enabled=True, regions=["HyperConnectionCall", "HyperHead"]))  # fmt: skip
        generator = torch.Generator(device).manual_seed(0)
        shape = (micro, seq, cfg.hc_streams, cfg.dim)
        streams = torch.randn(shape, device=device, generator=generator).requires_grad_(True)
        branch_dtype = autocast or torch.float32
        branches = torch.randn((len(blocks), micro, seq, cfg.dim), device=device,
                               generator=generator, dtype=branch_dtype).requires_grad_(True)  # fmt: skip
        context = torch.autocast(device.type, autocast) if autocast else contextlib.nullcontext()

        def forward(_: object) -> torch.Tensor:
            with torch.no_grad(), context:
                return module(streams, branches).float().sum()

        def forward_backward(_: object) -> torch.Tensor:
            with context:
                loss = module(streams, branches).float().sum()
            loss.backward()
            streams.grad = branches.grad = None
            module.zero_grad(set_to_none=True)
            return loss.detach()

        inputs = [None] * (args.hc_warmup + args.hc_iters)
        record["fwd_s"], _ = measure(forward, inputs, args.hc_warmup, device)
        record["fwd_bwd_s"], _ = measure(forward_backward, inputs, args.hc_warmup, device)
        if args.profile_steps and device.type == "cuda":  # where the forward + backward goes
            record["profile"] = profile_steps(forward_backward, inputs[: args.profile_steps], device)  # fmt: skip
            print(format_kernel_summary(record["part"], record["profile"]), flush=True)
        if compiled:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            record["compiled_graphs"] = graphs
            record["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        if device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"  {record['part']}: forward {record['fwd_s'] * 1e3:.2f} ms, forward + backward "
              f"{record['fwd_bwd_s'] * 1e3:.2f} ms", flush=True)  # fmt: skip
    except Exception as err:  # an OOM (or anything else) becomes this part's error
        record["error"] = (
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
        )
        print(f"  {record['part']}: {record['error']}", flush=True)
    return record


def run_train(args: argparse.Namespace, recipe: str, out: Path) -> dict:
    """The recipe through ``torchloom train`` in a subprocess; medians from its metrics.jsonl
    (whatever steps it logged, also when it failed or ran out of time)."""
    command = [
        sys.executable, "-m", "torchloom", "train", "--recipe", recipe,
        "--training.steps", str(args.steps), "--lr_schedule.warmup_steps", "2",
        "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
        "--checkpoint.save_final_model", "false", "--training.sample_tokens", "0",
        "--output.dir", str(out), "--output.overwrite", "true", *args.extra,
    ]  # fmt: skip
    record: dict = {"part": "train", "recipe": recipe, "command": command, "error": None}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    start = time.perf_counter()
    log = out.parent / f"{out.name}.log"
    shutil.rmtree(out, ignore_errors=True)  # no metrics of an earlier run read as this one's
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with log.open("w") as sink:
            proc = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=env, timeout=args.train_timeout)  # fmt: skip
        if proc.returncode != 0:
            lines = log.read_text().strip().splitlines()
            record["error"] = f"exit {proc.returncode}: " + " | ".join(lines[-3:])[-400:]
    except subprocess.TimeoutExpired:
        record["error"] = f"timed out after {args.train_timeout} s (see {log})"
    record["wall_s"] = time.perf_counter() - start
    record["log"] = str(log)
    metrics = out / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []  # fmt: skip
    logged = [r for r in steps if "tps" in r]
    timed = [r for r in logged if r["step"] > args.warmup] or logged[-1:]
    if record["error"]:
        print(f"  train: {record['error']}", flush=True)
    if timed:
        record |= {
            "timed_steps": [r["step"] for r in timed],
            "tokens_per_s": statistics.median(r["tps"] for r in timed),
            "tflops": statistics.median(r["tflops"] for r in timed),
            "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] else None,
            "step_s": statistics.median(r["step_s"] for r in timed),
            "peak_mem_gib": max(r["mem_gib"] for r in logged),
            "first_step_s": logged[0]["step_s"],
            "losses": [r["loss"] for r in logged],
        }
        print(f"  train: {record['tokens_per_s']:,.0f} tokens/s, step {record['step_s']:.3f} s",
              flush=True)  # fmt: skip
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help=f"the CPU check: {SMALL_RECIPE}, 2 steps, nothing compiled")  # fmt: skip
    parser.add_argument("--steps", type=int, default=12, help="training steps of the train part")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--parts", nargs="+", choices=PARTS,
                        help="default: all of them (--small: train and hc-eager)")  # fmt: skip
    parser.add_argument("--hc-iters", type=int, default=10, help="timed hyper-connection calls")
    parser.add_argument("--hc-warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="on a GPU: profile this many more hyper-connection forward + "
                        "backward calls and print their top kernels")  # fmt: skip
    parser.add_argument("--train-timeout", type=int, default=300, help="seconds for the train part")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("outputs/deepseek_v4_bench"))
    parser.add_argument("--json", type=Path, default=Path("outputs/deepseek_v4_bench.json"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more `torchloom train` flags for the train part (last argument)")  # fmt: skip
    args = parser.parse_args()
    recipe = RECIPE
    if args.small:
        recipe, args.steps, args.warmup, args.hc_iters, args.hc_warmup = SMALL_RECIPE, 2, 1, 2, 1
        args.parts = args.parts or ["train", "hc-eager"]
        args.extra = ["--training.device", "cpu", "--compile.enabled", "false",
                      "--training.seq_len", "128", "--data.val_fraction", "0", *args.extra]  # fmt: skip
    args.parts = args.parts or list(PARTS)
    device = bench_device(args.device)
    peak, device_name = device_peak_tflops(device)
    _, job = resolve_job(["--recipe", recipe, *args.extra])  # the job the train part runs
    seq = job.training.seq_len
    micro = job.training.micro_batch_size or job.training.global_batch_sequences
    micro_batches = job.training.global_batch_sequences // micro
    cfg = resolve_model_config(job.model)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    recompute = job.remat.mode == "full"
    print(f"{device_name}: {recipe}, {cfg.num_params() / 1e6:,.1f}M parameters, "
          f"{cfg.flops_per_token(0) / 6e6:,.1f}M active, {micro_batches} x {micro} x {seq} "
          f"tokens per step", flush=True)  # fmt: skip
    parts = []
    for part in args.parts:
        if part == "train":
            parts.append(run_train(args, recipe, args.out / "train"))
        else:
            parts.append(run_hc(args, cfg, device, micro, seq, autocast, part == "hc-compiled"))
        _free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    by_part = {p["part"]: p for p in parts}
    step_s = by_part.get("train", {}).get("step_s")
    for p in parts:
        if p["part"].startswith("hc") and not p["error"]:
            # Per step: each micro-batch's forward + backward, and with full recomputation the
            # blocks' calls run forward once more (the head is not recomputed).
            blocks_fwd = p["fwd_s"] * (2 * cfg.num_layers) / (2 * cfg.num_layers + 1)
            p["per_step_s"] = micro_batches * (p["fwd_bwd_s"] + (blocks_fwd if recompute else 0))
            p["share_of_step"] = p["per_step_s"] / step_s if step_s else None
    print(f"\n{'part':<12} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'ms/step':>9} "
          f"{'fwd+bwd ms':>10} {'share':>7} {'mem GiB':>8}")  # fmt: skip
    for p in parts:
        if p["error"] and "step_s" not in p and "fwd_bwd_s" not in p:
            print(f"{p['part']:<12} error: {p['error'][:90]}")
            continue
        step_ms = p.get("step_s", p.get("per_step_s", 0)) * 1e3
        fwd_bwd = p.get("fwd_bwd_s")
        share = p.get("share_of_step")
        print(f"{p['part']:<12} {_fmt(p.get('tokens_per_s'), ',.0f'):>10} "
              f"{_fmt(p.get('tflops'), '.1f'):>8} {_fmt(p.get('mfu'), '.1f', '%'):>6} "
              f"{step_ms:>9.1f} {_fmt(fwd_bwd and fwd_bwd * 1e3, '.2f'):>10} "
              f"{_fmt(share and 100 * share, '.1f', '%'):>7} "
              f"{_fmt(p.get('peak_mem_gib'), '.2f'):>8}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": device_name, "peak_tflops": peak, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join([sys.executable, *sys.argv]),
        "recipe": recipe, "params": cfg.num_params(), "active_params": cfg.flops_per_token(0) // 6,
        "flops_per_token": cfg.flops_per_token(seq), "seq": seq, "micro_batch": micro,
        "micro_batches": micro_batches, "remat": job.remat.mode, "parts": parts,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
