"""Training speed side by side: torchloom's training step and a Hugging Face loop, one GPU.

Every row runs in this process on the same device and the same random-token batches: forward,
token-mean cross-entropy, backward, clip to norm 1.0, AdamW (lr 3e-4, betas 0.9/0.95, weight
decay 0.1), zero_grad; no gradient accumulation. One table, JSON to --json.

    python benchmarks/train.py                                          # 1B, all rows, one GPU
    python benchmarks/train.py --shapes 1B 8B --remat selective --batch 2
    python benchmarks/train.py --shapes tiny --device cpu --no-compile --steps 3 --warmup 1

Rows. torchloom-eager: the trainer's default on a GPU (fp32 weights under bf16 autocast; no FSDP,
compile or recomputation). torchloom: FSDP at world size 1 (--parallel.fsdp_always: bf16
compute, fp32 master weights and reduction), each block compiled, recomputation --remat.
torchloom-chunked: that with the chunked fused output head + cross-entropy (--model.loss_impl
chunked: no [B, T, V] logits; a Triton kernel per chunk on the GPU). torchloom-autocast:
torchloom-chunked without FSDP, i.e. the trainer's own single-GPU mixed precision (bf16 autocast
over fp32 weights; FSDP at world size 1 only adds copies). torchloom-flex: torchloom-autocast
attending with FlexAttention (--model.attn_backend flex, causal block mask built once per
forward) instead of SDPA. torchloom-fused: torchloom-chunked plus
the Triton RMSNorm / RoPE / SwiGLU kernels (--model.transforms '["triton_kernels"]').
torchloom-float8 / torchloom-float8-tensorwise: torchloom-chunked with torchao float8 linears in
the blocks (--model.float8 rowwise / tensorwise). torchloom-graphs: torchloom-eager's step
captured once as a CUDA graph and replayed (--training.cuda_graph true; GPU only). hf:
transformers' LlamaForCausalLM, its config written by torchloom's HF adapter from the same
flavor, sdpa attention, use_cache off, torch.compile(model), fused AdamW, bf16 autocast over
fp32 weights, loss = model(input_ids=..., labels=...).loss. hf-layers: that loop with each
decoder layer compiled (layer.compile()) and the rest eager. The difference matters: with
torch < 2.14 transformers never skips its causal mask under torch.compile (its masking_utils
says so), so compiling the whole model hands SDPA a dense [T, T] mask and it runs masked
attention; built eagerly, the mask is skipped and SDPA runs its causal kernel (is_causal).
Shapes with bf16 weights (8B) cast
every row's model to bf16 with neither autocast nor FSDP (at world size 1 FSDP only supplies
mixed precision); AdamW state is then bf16. On the CPU all is fp32 and AdamW is foreach.
--optimizer triton steps the compiled torchloom rows with --optimizer.implementation triton
(one Triton AdamW kernel per parameter with the clip folded in; benchmarks/optimizer.py) instead
of torch's fused AdamW after an in-place clip.
HF shifts the labels inside the model (T inputs give T-1 losses); torchloom's labels ignore the
last position, so every row computes the same T-1 token losses from the same T inputs.

FLOPs, one formula for every row: TransformerConfig.flops_per_token(seq) = 6 * N_matmul +
6 * layers * heads * head_dim * seq (N_matmul: every weight used in a matmul, output head
included, embedding lookup not; the second term: causal QK^T and AV, forward + backward).
TFLOP/s = tokens/s * that / 1e12; MFU against the data-sheet bf16 peak (device_peak_tflops) and
against a bf16 8192^3 matmul measured in this run. Step time: median of --steps steps after
--warmup steps (compile happens there), CUDA events on GPUs. Memory: max_memory_allocated.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import torch
import transformers
from torch import nn
from torch.profiler import ProfilerActivity, profile

from torchloom.data.packing import IGNORE_INDEX, Batch
from torchloom.models import (
    ModelConfig,
    TransformerConfig,
    build_model,
    get_model_spec,
    resolve_model_config,
)
from torchloom.parallel import (
    ParallelConfig,
    ParallelDims,
    build_parallel_dims,
    destroy,
    parallelize,
)
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.cuda_graph import StepGraph
from torchloom.train.loss import CrossEntropy
from torchloom.train.metrics import device_peak_tflops
from torchloom.train.optim import OptimizerConfig, build_optimizer, clip_gradients
from torchloom.train.profiling import format_kernel_summary, kernel_summary
from torchloom.train.remat import RematConfig, RematMode, apply_remat, memory_budget

SHAPES = {  # name: (llama3 flavor, default sequence length, weight dtype)
    "tiny": ("debug", 256, torch.float32),
    "1B": ("1B", 4096, torch.float32),
    "8B": ("8B", 4096, torch.bfloat16),
}
CHUNKED = {"loss_impl": "chunked"}
ROW_SLOTS = {  # the model-config slots of each torchloom row that differ from the defaults
    "torchloom-eager": {},
    "torchloom": {},
    "torchloom-chunked": CHUNKED,
    "torchloom-autocast": CHUNKED,
    "torchloom-flex": {**CHUNKED, "attn_backend": "flex"},
    "torchloom-fused": {**CHUNKED, "norm_impl": "triton", "rope_impl": "triton",
                        "mlp_impl": "triton"},
    "torchloom-float8": {**CHUNKED, "float8": "rowwise"},
    "torchloom-float8-tensorwise": {**CHUNKED, "float8": "tensorwise"},
    "torchloom-graphs": {},
}  # fmt: skip
ROWS = (*ROW_SLOTS, "hf", "hf-layers")
# Rows with the trainer's single-GPU autocast instead of FSDP at world size 1 (hf: neither).
NO_FSDP = ("torchloom-eager", "torchloom-graphs", "torchloom-autocast", "torchloom-flex", "hf",
           "hf-layers")  # fmt: skip
ROW_WIDTH = max(map(len, ROWS))
SEED = 0

Step = Callable[[torch.Tensor], torch.Tensor]  # one training step on tokens [B, T+1] -> loss


def _mark(device: torch.device) -> torch.cuda.Event | float:
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1000


def matmul_tflops(device: torch.device) -> tuple[float, str]:
    """Measured matmul ceiling: bf16 8192^3 on a GPU (fp32 1024^3 on the CPU), median of 10."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    marks = []
    for _ in range(10):
        start = _mark(device)
        a @ b
        marks.append((start, _mark(device)))
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    seconds = statistics.median(_seconds(s, e) for s, e in marks)
    return 2 * n**3 / seconds / 1e12, f"{str(dtype).removeprefix('torch.')} {n}^3"


def _torchloom_model(cfg: TransformerConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The llama3 model every torchloom row starts from: built on meta, the same init."""
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device=device)
    model.init_weights(SEED)
    return model.to(dtype)


def _inputs_and_labels(x_BT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, T] and next-token labels, the last position ignored (HF's shift drops it), so
    every row computes the same T-1 token losses."""
    labels_BT = x_BT1[:, 1:].clone()
    labels_BT[:, -1] = IGNORE_INDEX
    return x_BT1[:, :-1], labels_BT


def torchloom_step(
    cfg: TransformerConfig, objective: CrossEntropy, device: torch.device, dtype: torch.dtype,
    seq: int,
    dims: ParallelDims | None, compile_: bool, remat: str, optimizer_impl: str = "fused",
) -> Step:  # fmt: skip
    """The model (same init for every torchloom row) and Trainer.train_step's work on it."""
    model = _torchloom_model(cfg, device, dtype)

    def wrap_blocks(m: nn.Module) -> None:  # as Trainer._wrap_blocks
        remat_config = RematConfig(mode=remat)  # type: ignore[arg-type]
        apply_remat(m.layers, remat_config, compile_)
        compile_regions(
            m, CompileConfig(enabled=compile_), memory_budget=memory_budget(remat_config)
        )

    if dims is not None:
        model = parallelize(model, dims, seq_len=seq, wrap_blocks=wrap_blocks)
    else:
        wrap_blocks(model)
    impl = optimizer_impl if device.type == "cuda" else "auto"
    optimizer = build_optimizer(model, OptimizerConfig(implementation=impl), device)
    autocast = dims is None and dtype == torch.float32 and device.type == "cuda"

    def step(x_BT1: torch.Tensor) -> torch.Tensor:
        tokens_BT, labels_BT = _inputs_and_labels(x_BT1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            # the trainer's loss path
            loss_sum = model(tokens_BT, objective=objective, targets={"labels": labels_BT}).loss
        loss = loss_sum / labels_BT[:, :-1].numel()  # T-1 each
        loss.backward()
        clip_gradients(optimizer, model.parameters(), 1.0)  # as the Trainer does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def graphed_step(
    cfg: TransformerConfig, device: torch.device, dtype: torch.dtype, objective: CrossEntropy
) -> Step:
    """torchloom-eager's step replayed from one CUDA graph (--training.cuda_graph's StepGraph:
    forward, backward, clipping and the fused AdamW captured together)."""
    model = _torchloom_model(cfg, device, dtype)
    optimizer = build_optimizer(model, OptimizerConfig(), device)
    autocast = dtype == torch.float32

    def step_fn(batches: list[Batch], num_tokens: torch.Tensor):
        (batch,) = batches
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            targets = {"labels": batch.labels}
            loss_sum = model(
                batch.tokens, batch.positions, objective=objective, targets=targets
            ).loss
        (loss_sum / num_tokens).backward()
        grad_norm = clip_gradients(optimizer, model.parameters(), 1.0)
        optimizer.step()
        return loss_sum.detach(), grad_norm

    graph = StepGraph(step_fn, optimizer)

    def step(x_BT1: torch.Tensor) -> torch.Tensor:
        tokens_BT, labels_BT = _inputs_and_labels(x_BT1)
        positions_BT = torch.arange(tokens_BT.shape[1], device=device).expand_as(tokens_BT)
        count = labels_BT[:, :-1].numel()
        batch = Batch(tokens_BT, labels_BT, positions_BT, None)
        loss_sum, _ = graph([batch], torch.tensor(float(count), device=device))
        return loss_sum / count

    return step


def hf_step(
    cfg: TransformerConfig, device: torch.device, dtype: torch.dtype, compile_: bool,
    layers_only: bool = False,
) -> Step:  # fmt: skip
    """LlamaForCausalLM as users train it: torch.compile(model), fused AdamW, autocast. With
    ``layers_only`` each decoder layer is compiled instead and the rest runs eager."""
    hf_config = get_model_spec("llama3").hf_adapter.config_to_hf(cfg)
    config = transformers.LlamaConfig(
        **{**hf_config, "use_cache": False}, attn_implementation="sdpa"
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=fused, foreach=not fused)  # fmt: skip
    forward = torch.compile(model) if compile_ and not layers_only else model
    if compile_ and layers_only:
        for layer in model.model.layers:
            layer.compile()
    autocast = dtype == torch.float32 and device.type == "cuda"

    def step(x_BT1: torch.Tensor) -> torch.Tensor:
        tokens_BT = x_BT1[:, :-1]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=tokens_BT, labels=tokens_BT).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(
    step: Step, batches: list[torch.Tensor], warmup: int, device: torch.device
) -> tuple[float, list[float]]:
    """(median seconds of the timed steps, every step's loss). Peak memory counts from here:
    the weights and what training allocates, not a transient copy made while building."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)  # counts allocator retries from here
    marks, losses = [], []
    for batch in batches:
        start = _mark(device)
        losses.append(step(batch))
        marks.append((start, _mark(device)))
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    seconds = statistics.median(_seconds(s, e) for s, e in marks[warmup:])
    return seconds, [loss.item() for loss in losses]


def profile_steps(step: Step, batches: list[torch.Tensor], device: torch.device) -> dict:
    """Kernel time of a few more steps under torch.profiler (kernel_summary): GPU busy vs wall
    time, time by kernel kind, the top kernels."""
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for batch in batches:
            step(batch)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    return kernel_summary(prof, len(batches), wall)


def run_row(
    row: str, shape: str, args: argparse.Namespace, device: torch.device,
    dims: ParallelDims | None, batches: list[torch.Tensor],
) -> dict:  # fmt: skip
    flavor, _, dtype = SHAPES[shape]
    model_cfg = ModelConfig(name="llama3", flavor=flavor, **ROW_SLOTS.get(row, {}))
    cfg, objective = resolve_model_config(model_cfg), CrossEntropy(model_cfg.loss_impl)
    seq = batches[0].shape[1] - 1
    record = {"row": row, "shape": shape, "flavor": flavor, "batch": args.batch, "seq": seq,
              "weights": str(dtype).removeprefix("torch."), "error": None}  # fmt: skip
    try:
        compile_ = not args.no_compile
        if row in ("hf", "hf-layers"):
            step = hf_step(cfg, device, dtype, compile_, layers_only=row == "hf-layers")
        elif row == "torchloom-graphs":
            step = graphed_step(cfg, device, dtype, objective)
        elif row != "torchloom-eager":
            # bf16 weights (8B): no FSDP, whose only job at world size 1 is mixed precision
            fsdp = dims if dtype == torch.float32 and row not in NO_FSDP else None
            step = torchloom_step(
                cfg, objective, device, dtype, seq, fsdp, compile_, args.remat, args.optimizer
            )
        else:
            step = torchloom_step(cfg, objective, device, dtype, seq, None, False, "none")
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
    tflops = tokens_per_s * cfg.flops_per_token(seq) / 1e12
    record |= {"step_s": seconds, "tokens_per_s": tokens_per_s, "tflops": tflops,
               "losses": losses, "final_loss": losses[-1]}  # fmt: skip
    retries = ""
    if device.type == "cuda":
        record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        # Each retry freed the allocator's cache to fit an allocation: a device-wide sync.
        record["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        retries = f", {record['alloc_retries']} allocator retries"
    print(f"  {row} {shape}: {seconds:.3f} s/step, loss {losses[-1]:.4f}{retries}", flush=True)
    return record


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled code holds on to the modules it was traced with
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """The options of how the training step is timed and built (shared with train_moe.py)."""
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    parser.add_argument("--remat", default="none", choices=get_args(RematMode),
                        help="recomputation of the torchloom rows")  # fmt: skip
    parser.add_argument("--no-compile", action="store_true", help="compile nothing")
    parser.add_argument("--optimizer", default="fused", choices=["fused", "triton"],
                        help="the torchloom rows' AdamW (--optimizer.implementation)")  # fmt: skip
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after timing, profile this many steps per row (GPU kernel table)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def bench_device(name: str) -> torch.device:
    """The device to time on (a CUDA device made current)."""
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    return device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1B"], choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    add_step_options(parser)
    parser.add_argument("--json", type=Path, default=Path("outputs/train_bench.json"))
    args = parser.parse_args()
    device = bench_device(args.device)
    peak, device_name = device_peak_tflops(device)
    ceiling, matmul = matmul_tflops(device)
    print(f"{device_name}: matmul ceiling {ceiling:.1f} TFLOP/s ({matmul}), data-sheet peak "
          f"{_fmt(peak, '.1f')} TFLOP/s", flush=True)  # fmt: skip
    dims = None
    if set(args.rows) - set(NO_FSDP):  # FSDP on one process: a one-rank process group
        dims = build_parallel_dims(ParallelConfig(fsdp_always=True), device.type)
    rows = []
    args.shapes = list(dict.fromkeys(args.shapes))  # each shape once: rows pair up by shape
    for shape in args.shapes:
        flavor, seq, _ = SHAPES[shape]
        vocab = get_model_spec("llama3").flavor(flavor).vocab_size
        generator, size = torch.Generator().manual_seed(SEED), (args.batch, (args.seq or seq) + 1)
        batches = [torch.randint(0, vocab, size, generator=generator).to(device)
                   for _ in range(args.warmup + args.steps)]  # fmt: skip
        for row in args.rows:
            rows.append(run_row(row, shape, args, device, dims, batches))
            _free(device)

    def find(row: str, shape: str) -> dict:
        return next((r for r in rows if r["row"] == row and r["shape"] == shape), {})

    def ratio(r: dict, baseline: str) -> float | None:
        base = find(baseline, r["shape"]).get("tokens_per_s")
        return r["tokens_per_s"] / base if base else None

    for r in rows:
        if r.get("tflops") is not None:
            r["mfu"] = 100 * r["tflops"] / peak if peak else None
            r["pct_of_matmul"] = 100 * r["tflops"] / ceiling
            r["vs_hf"], r["vs_hf_layers"] = ratio(r, "hf"), ratio(r, "hf-layers")
    print(f"\n{'row':<{ROW_WIDTH}} {'shape':<5} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'% matmul':>8} {'mem GiB':>8} {'last loss':>9} {'vs hf':>6} {'vs hf-layers':>12}")  # fmt: skip
    for r in rows:
        if r["error"]:
            print(f"{r['row']:<{ROW_WIDTH}} {r['shape']:<5} error: {r['error'][:80]}")
            continue
        print(f"{r['row']:<{ROW_WIDTH}} {r['shape']:<5} {r['tokens_per_s']:>10,.0f} {r['tflops']:>8.2f} "
              f"{_fmt(r['mfu'], '.1f', '%'):>6} {r['pct_of_matmul']:>7.1f}% "
              f"{_fmt(r.get('peak_mem_gib'), '.2f'):>8} {r['final_loss']:>9.4f} "
              f"{_fmt(r['vs_hf'], '.2f', 'x'):>6} {_fmt(r['vs_hf_layers'], '.2f', 'x'):>12}")  # fmt: skip
    checks: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:  # every torchloom row's losses against the un-optimised (eager) step's
        eager = find("torchloom-eager", r["shape"]).get("losses")
        if r["row"] in ("torchloom-eager", "hf", "hf-layers") or not eager or not r.get("losses"):
            continue
        diff = [abs(a - b) for a, b in zip(eager, r["losses"])]
        checks.setdefault(r["shape"], {})[r["row"]] = {
            "step_1": diff[0],
            "first_timed_step": diff[args.warmup],
        }
        print(f"|loss diff| {r['row']} vs torchloom-eager, {r['shape']}: step 1 {diff[0]:.2e}, "
              f"first timed step {diff[args.warmup]:.2e} (bf16 tolerance ~1e-2)")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": device_name, "peak_tflops": peak, "matmul_tflops": ceiling, "matmul": matmul,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "optimizer": args.optimizer,
        "loss_diff": checks, "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")
    destroy()


if __name__ == "__main__":
    main()
