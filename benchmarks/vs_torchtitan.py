"""TorchTitan's own trainer and `torchloom train` on one shape, one after the other on the same
GPU with the same data, batch and recomputation: tokens/s, peak GPU memory and the ratio in one
table, JSON to --json (TorchTitan 0.2.2 must be installed; it is not a dependency).

    python3 benchmarks/vs_torchtitan.py --flavor 1B --batch 8                          # one H200
    python3 benchmarks/vs_torchtitan.py --flavor 8B --batch 2 --recompute every_2nd
    python3 benchmarks/vs_torchtitan.py --flavor 8B --batch 2 --recompute every_2nd --float8
    python3 benchmarks/vs_torchtitan.py --model deepseek_v3 --batch 4                  # 16B, 6 layers
    python3 benchmarks/vs_torchtitan.py --flavor debug --seq 128 --batch 2 --steps 4 \\
        --sides torchloom --device cpu                                                # CPU check

The inputs are written once under --workdir (benchmarks/torchtitan_anchor.py's helpers) and read
by both trainers: a word-level tokenizer over the model's vocabulary and documents of --words
random words, longer than a sequence; torchloom runs with --data.document_mask false, so both
attend plain causal. Each side runs as its users run it:

- TorchTitan: compile of model and loss, fused AdamW, bf16 autocast over fp32 weights (its
  mixed precision on one GPU).
- torchloom: the fast settings of docs/performance.md (compile, chunked loss, Triton AdamW; bf16
  autocast over fp32 weights) and an untied head, as TorchTitan's llama3 has.

Both run with PYTORCH_ALLOC_CONF=expandable_segments:True (--allocator), as TorchTitan's own
launcher (run_train.sh) sets it: the CUDA allocator then maps memory in growable segments and
holds less that it cannot reuse, which the nvidia-smi figure below counts.

Both log every --log-interval steps (10: TorchTitan's default), and both read the loss back to
the host only there, so each logged tokens/s covers the steps since the previous log. Tokens/s:
the mean of the logged windows after the first two (step 1, and the window holding the compile),
the same rule for both.

--model deepseek_v3 is the 16B flavor (DeepSeek-V2-Lite's shape) cut to --layers layers, without
multi-token prediction, on both sides. --titan-args and --torchloom-args add flags to either
trainer (one string each), to try a side's other settings. --fa4 runs torchloom's attention
through FlashAttention 4 (`--model.attn_backend fa4`; on the device, installed by
benchmarks/fa4_wheels.sh).

--recompute every_2nd is TorchTitan's default `selective` mode (its option "2": every second
block recomputed whole) and torchloom's `--remat.mode every_k` (k = 2). Peak memory is measured
the same way for both: the most memory nvidia-smi shows in use on the GPU while the trainer runs
alone on it (sampled every 0.5 s, less what was in use before), CUDA context and allocator cache
included. Each trainer's own figure is its allocator's reserved peak (tensors and cache; torchloom
logs it as mem_reserved_gib beside the allocated peak, mem_gib); both are recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_anchor import write_documents, write_tokenizer

from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, resolve_model_config
from torchloom.train.metrics import read_records

ROOT = Path(__file__).resolve().parents[1]
_TITAN_STEP = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")


def titan_windows(log: str) -> list[dict]:
    """TorchTitan's logged steps: {"step", "reserved_gib", "tps"} (its tps covers the steps
    since the previous logged one)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)  # its colours
    return [
        {"step": int(step), "reserved_gib": float(mem), "tps": int(tps.replace(",", ""))}
        for step, mem, tps in _TITAN_STEP.findall(plain)
    ]


def windows_tokens_per_s(windows: list[dict]) -> float | None:
    """The mean tokens/s of the logged windows after the first two (step 1, and the window
    holding the compile), or None with fewer than three. Both trainers log every
    ``--log-interval`` steps and each logged tps covers the steps since the previous log."""
    timed = windows[2:]
    return statistics.mean(w["tps"] for w in timed) if timed else None


def gpu_memory_gib() -> float:
    """Memory in use on the GPU the trainers run on, by nvidia-smi, in GiB (0 without it). The
    whole GPU's, not per process: process ids inside a container need not match nvidia-smi's,
    and each trainer runs alone (``run`` subtracts what was in use before it started)."""
    index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", index],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0.0


def run(command: list[str], log: Path, timeout: float, allocator: str = "") -> dict:
    """``command`` with its output to ``log``; the most GPU memory in use while it ran, less what
    was in use before it started."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if allocator:
        env["PYTORCH_ALLOC_CONF"] = allocator
    print("run: " + " ".join(command), flush=True)
    idle = gpu_memory_gib()
    started, peak, error = time.time(), 0.0, None
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        while proc.poll() is None:
            peak = max(peak, gpu_memory_gib() - idle)
            if time.time() - started > timeout:
                proc.kill()
                error = f"timed out after {timeout:.0f} s"
            time.sleep(0.5)
    if proc.returncode and error is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        error = f"exit {proc.returncode}: " + " | ".join(tail)[-400:]
    return {"error": error, "wall_s": time.time() - started, "gpu_gib": peak, "log": str(log)}


def titan_command(args: argparse.Namespace) -> list[str]:
    recompute = {"none": "none", "every_2nd": "selective"}[args.recompute]
    command = [
        sys.executable, str(ROOT / "benchmarks" / "torchtitan_anchor.py"), "--model", args.model,
        "--flavor", args.flavor, "--layers", str(args.layers), "--workdir", str(args.workdir), "--vocab", str(args.vocab),
        "--docs", str(args.docs), "--words", str(args.words), "--",
        "--compile.enable", "--training.seq_len", str(args.seq),
        "--training.local_batch_size", str(args.batch), "--training.steps", str(args.steps),
        "--metrics.log_freq", str(args.log_interval), "--lr_scheduler.warmup_steps", "2",
        "--activation_checkpoint.mode", recompute, "--job.dump_folder", str(args.workdir / "tt"),
    ]  # fmt: skip
    if args.float8:
        command += ["--model.converters", "quantize.linear.float8",
                    "--quantize.linear.float8.recipe_name", "tensorwise"]  # fmt: skip
    return command + shlex.split(args.titan_args)


def torchloom_command(args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "torchloom", "train", "--recipe", "debug",
        "--model.name", args.model, "--model.flavor", args.flavor,
        "--model.overrides", json.dumps(model_overrides(args)),
        "--training.seq_len", str(args.seq), "--training.global_batch_size", str(args.batch),
        "--training.steps", str(args.steps), "--training.device", args.device,
        "--data.sources", json.dumps([str(args.workdir / "data")]),
        "--data.tokenizer", str(args.workdir / "tokenizer"), "--data.format", "text",
        "--data.streaming", "true", "--data.document_mask", "false", "--data.val_fraction", "0",
        "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
        "--metrics.log_interval", str(args.log_interval),
        "--checkpoint.save_final_model", "false", "--training.sample_tokens", "0",
        "--output.dir", str(args.workdir / "torchloom"), "--output.overwrite", "true",
    ]  # fmt: skip
    if args.device == "cuda":
        command += ["--compile.enabled", "true", "--model.loss_impl", "chunked",
                    "--optimizer.implementation", "triton"]  # fmt: skip
    if args.recompute == "every_2nd":
        command += ["--remat.mode", "every_k", "--remat.every_k", "2"]
    if args.float8:
        command += ["--model.float8", "tensorwise"]
    if args.fa4:
        command += ["--model.attn_backend", "fa4"]
    return command + shlex.split(args.torchloom_args)


def model_overrides(args: argparse.Namespace) -> dict:
    """torchloom's model to TorchTitan's: llama3 with its own output head; deepseek_v3 cut to
    ``--layers`` layers, no multi-token prediction."""
    if args.model == "llama3":
        return {"tie_embeddings": False}
    return {"num_layers": args.layers, "mtp_layers": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3", choices=["llama3", "deepseek_v3"])
    parser.add_argument(
        "--flavor",
        default=None,
        help="default 1B (llama3; TorchTitan has 1B and 8B) or 16B (deepseek_v3)",
    )
    parser.add_argument("--layers", type=int, default=6, help="deepseek_v3's layers")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="both trainers log (and read the loss back) every this many steps",
    )
    parser.add_argument(
        "--allocator",
        default="expandable_segments:True",
        help="PYTORCH_ALLOC_CONF for both trainers (TorchTitan's run_train.sh sets this one); "
        "'' leaves the environment's",
    )
    parser.add_argument("--recompute", default="none", choices=["none", "every_2nd"])
    parser.add_argument("--float8", action="store_true", help="float8 tensorwise linears")
    parser.add_argument("--fa4", action="store_true",
                        help="torchloom's attention through FlashAttention 4 "
                             "(--model.attn_backend fa4; bash benchmarks/fa4_wheels.sh)")  # fmt: skip
    parser.add_argument("--sides", nargs="+", default=["torchtitan", "torchloom"],
                        choices=["torchtitan", "torchloom"])  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: torchloom only, eager (the CPU check)")  # fmt: skip
    parser.add_argument(
        "--docs",
        type=int,
        default=None,
        help="documents (default: enough for every step's tokens, and 20%% more)",
    )
    parser.add_argument("--words", type=int, default=20000, help="words a document")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per trainer")
    parser.add_argument("--titan-args", default="", help="more TorchTitan flags, one string")
    parser.add_argument("--torchloom-args", default="", help="more `torchloom train` flags")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/vs_torchtitan"))
    parser.add_argument("--json", type=Path, default=Path("outputs/vs_torchtitan.json"))
    args = parser.parse_args()
    if args.device == "cpu" and "torchtitan" in args.sides:
        parser.error("TorchTitan's trainer needs CUDA: pass --sides torchloom with --device cpu")
    for name in ("words", "batch", "seq", "steps", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.workdir = args.workdir.resolve()
    args.flavor = args.flavor or {"llama3": "1B", "deepseek_v3": "16B"}[args.model]
    model = ModelConfig(name=args.model, flavor=args.flavor, overrides=model_overrides(args))
    try:
        args.vocab = resolve_model_config(model).vocab_size
    except ConfigError as err:  # an unknown flavor, say
        parser.error(str(err))
    tokens = args.steps * args.batch * (args.seq + 1)  # a word is a token
    args.docs = args.docs or -(-tokens * 6 // (5 * args.words))
    write_tokenizer(args.workdir / "tokenizer", args.vocab)
    write_documents(args.workdir / "data", args.vocab, args.docs, args.words)

    report: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "model": args.model, "flavor": args.flavor, "batch": args.batch, "seq": args.seq,
        "recompute": args.recompute, "float8": args.float8, "fa4": args.fa4, "allocator": args.allocator, "sides": {},
    }  # fmt: skip
    if "torchtitan" in args.sides:
        side = run(
            titan_command(args), args.workdir / "torchtitan.log", args.timeout, args.allocator
        )
        windows = titan_windows(Path(side["log"]).read_text(errors="replace"))
        side |= {"windows": windows, "tokens_per_s": windows_tokens_per_s(windows),
                 "own_memory_gib": max((w["reserved_gib"] for w in windows), default=None),
                 "own_memory": "allocator reserved peak"}  # fmt: skip
        report["sides"]["torchtitan"] = side
    if "torchloom" in args.sides:
        side = run(
            torchloom_command(args), args.workdir / "torchloom.log", args.timeout, args.allocator
        )
        metrics = args.workdir / "torchloom" / "metrics.jsonl"
        steps = [r for r in read_records(metrics) if "tps" in r] if metrics.exists() else []
        # The allocator's reserved peak where logged (TorchTitan's own figure), else allocated.
        key = "mem_reserved_gib" if any("mem_reserved_gib" in r for r in steps) else "mem_gib"
        side |= {"steps": steps, "tokens_per_s": windows_tokens_per_s(steps),
                 "own_memory_gib": max((r[key] for r in steps), default=None),
                 "own_memory": "allocator " + ("reserved" if key != "mem_gib" else "allocated")
                 + " peak"}  # fmt: skip
        report["sides"]["torchloom"] = side

    print(f"\n{report['device']}: {args.model} {args.flavor}, {args.batch} x {args.seq} tokens a step, "
          f"recompute {args.recompute}{', float8 tensorwise' if args.float8 else ''}"
          f"{', torchloom attention through FlashAttention 4' if args.fa4 else ''}")  # fmt: skip
    print(
        f"{'trainer':<12} {'tokens/s':>10} {'GPU GiB (nvidia-smi)':>21} {'own figure':>11}  error"
    )
    for name, side in report["sides"].items():
        tps, own = side["tokens_per_s"], side["own_memory_gib"]
        print(f"{name:<12} {f'{tps:,.0f}' if tps else 'n/a':>10} {side['gpu_gib']:>21.2f} "
              f"{f'{own:.2f}' if own else 'n/a':>11}  {side['error'] or ''}")  # fmt: skip
    sides = report["sides"]
    if any(not side["tokens_per_s"] and not side["error"] for side in sides.values()):
        print("n/a: fewer than 3 logged windows (the first two are warm-up); raise --steps or "
              "lower --log-interval")  # fmt: skip
    if all(sides.get(n, {}).get("tokens_per_s") for n in ("torchtitan", "torchloom")):
        report["ratio"] = sides["torchloom"]["tokens_per_s"] / sides["torchtitan"]["tokens_per_s"]
        print(f"torchloom / TorchTitan tokens/s: {report['ratio']:.3f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    if any(side["error"] for side in sides.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
