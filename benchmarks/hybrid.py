"""Hybrid linear-attention training speed on one GPU: a 3:1 Gated DeltaNet + gated attention
model against the same model with every layer full attention, and one Gated DeltaNet layer
against transformers' Qwen3NextGatedDeltaNet.

    python benchmarks/hybrid.py --rows hybrid full                      # the models, 4k and 32k
    python benchmarks/hybrid.py --rows layer layer-compiled hf-layer hf-layer-compiled  # layers
    python benchmarks/hybrid.py --rows hybrid full --compile graph-breaks --seq-lens 4096
    python benchmarks/hybrid.py --rows layer-compiled hf-layer --profile-steps 2   # kernel tables
    python benchmarks/hybrid.py --device cpu --shape tiny --compile none --steps 2 --warmup 1

Shape 1B: the qwen3_next family with Qwen3-Next's layer shapes at dim 2048 (gated attention:
16 query heads, 2 kv heads, head_dim 256, RoPE on a quarter of each head; Gated DeltaNet: 16
key heads, 32 value heads, 128 channels each, conv 4, fused in_proj_qkvz / in_proj_ba) and a
dense SwiGLU of 5120 in every layer, as Qwen3.5's dense models have; 16 layers, tied
embeddings, vocab 151936 (about 1.0B parameters without the embedding, 1.3B with). tiny: the
debug flavor with the SwiGLU, for the CPU. Each seq len runs --tokens tokens per step (32768:
8 x 4096, 1 x 32768), the same random batches for every row.

Rows. hybrid: every 4th layer gated attention, the rest Gated DeltaNet (full_attention_interval
4: 12 + 4). full: the same config with layer_types all 'full_attention'. Both take
benchmarks/train.py's torchloom-autocast step (its helpers are imported): fp32 weights under
bf16 autocast, chunked output head + token-mean cross-entropy, backward, clip to 1.0, AdamW
(--optimizer), SDPA attention (flash on the GPU), recomputation --remat (default full: at
32768 tokens a step an eager Gated DeltaNet block saves about 10 GiB for its backward, 12 of
them more than an H200 holds). --compile: blocks compiles each block whole as one graph
(train.py's torchloom rows; fla's kernels are torch.compiler.disable'd, so this fails where the
delta rule runs on fla); deltanet-eager compiles each block but leaves the Gated DeltaNet
mixers eager; graph-breaks (default; what `torchloom train --compile.enabled true` does when
fla runs) compiles each block whole, letting Dynamo break the graph around fla's kernels; none
compiles nothing.
The delta rule runs fla's Triton kernels on CUDA when fla-core is importable (on Hopper with
Triton >= 3.4, < 3.7.1 with torchloom's PyTorch form of the one backward step fla refuses there,
fla issue #640: kernels/fla_backend.py), else torch's chunked form: the layers call delta_rule
with impl "auto", there is no per-model switch (the JSON's delta_rule says which ran).

layer / layer-compiled: torchloom's GatedDeltaNet of that shape (taken from a one-layer model
of the same config), bf16 weights on the GPU (fp32 on the CPU), forward then backward of a
[B, T, dim] input with an input gradient; -compiled wraps it in torch.compile (graph breaks
allowed). hf-layer / hf-layer-compiled: transformers' Qwen3NextGatedDeltaNet of the same shape,
the same way; transformers uses fla's chunk_gated_delta_rule when fla imports and causal_conv1d
when installed (the JSON's hf_kernels records what it took). No weights are shared: timing only.

Times: median of --steps after --warmup (compile and Triton autotuning happen there), CUDA
events. TFLOP/s: DecoderConfig.flops_per_token (the delta rule's chunked work estimated by
GatedDeltaNet.flops_per_token; attention's causal QK^T and AV); MFU against the data-sheet peak.
Ratios: hybrid over full at the same seq len; each layer row over the hf-layer row compiled
alike. One table, JSON to --json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import inspect
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import get_args

import torch
import transformers
from torch import nn
from train import (
    SEED,
    Step,
    _fmt,
    _free,
    _inputs_and_labels,
    _torchloom_model,
    bench_device,
    matmul_tflops,
    measure,
    profile_steps,
)

from torchloom.kernels import fla_backend
from torchloom.kernels.delta_rule import fla_runs
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.linear_attention import GatedDeltaNet
from torchloom.models.qwen3_next.config import Qwen3NextConfig
from torchloom.train.builders import DELTA_RULE_MIXERS
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.loss import CrossEntropy
from torchloom.train.metrics import device_peak_tflops
from torchloom.train.optim import OptimizerConfig, build_optimizer, clip_gradients
from torchloom.train.profiling import format_kernel_summary
from torchloom.train.remat import RematConfig, RematMode, apply_remat, memory_budget

_SWIGLU = {"ffn": "swiglu", "tie_embeddings": True}
SHAPES = {  # name: (qwen3_next flavor, overrides, default seq lens, default tokens per step)
    "tiny": ("debug", {**_SWIGLU, "ffn_dim": 128}, (64, 128), 256),
    "1B": ("80B-A3B", {**_SWIGLU, "num_layers": 16, "ffn_dim": 5120}, (4096, 32768), 32768),
}
MODEL_ROWS = ("hybrid", "full")
LAYER_ROWS = ("layer", "layer-compiled", "hf-layer", "hf-layer-compiled")
ROWS = (*MODEL_ROWS, *LAYER_ROWS)
COMPILE_MODES = ("deltanet-eager", "blocks", "graph-breaks", "none")
ROW_WIDTH = max(map(len, ROWS))


def model_config(shape: str, row: str) -> Qwen3NextConfig:
    """The shape's hybrid config, or (row 'full') the same with every layer full attention."""
    flavor, overrides, _, _ = SHAPES[shape]
    cfg = resolve_model_config(ModelConfig(name="qwen3_next", flavor=flavor, overrides=overrides))
    if row == "full":
        cfg = replace(cfg, layer_types=("full_attention",) * cfg.num_layers)
    cfg.validate()
    return cfg


def model_step(
    cfg: Qwen3NextConfig, device: torch.device, compile_mode: str, remat: str, optimizer: str
) -> Step:
    """train.py's torchloom-autocast step (Trainer.train_step on one GPU), with the choice of
    leaving the Gated DeltaNet mixers out of the compiled blocks."""
    model = _torchloom_model(cfg, device, torch.float32)
    remat_config = RematConfig(mode=remat)  # type: ignore[arg-type]
    apply_remat(model.layers, remat_config, compile_mode != "none")
    compile_regions(
        model,
        CompileConfig(enabled=compile_mode != "none"),
        eager_types=("GatedDeltaNet",) if compile_mode == "deltanet-eager" else (),
        memory_budget=memory_budget(remat_config),
        graph_break_types=DELTA_RULE_MIXERS if compile_mode == "graph-breaks" else (),
    )
    impl = optimizer if device.type == "cuda" else "auto"
    opt = build_optimizer(model, OptimizerConfig(implementation=impl), device)
    objective = CrossEntropy("chunked")

    def step(x_BT1: torch.Tensor) -> torch.Tensor:
        tokens_BT, labels_BT = _inputs_and_labels(x_BT1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss_sum = model(tokens_BT, objective=objective, targets={"labels": labels_BT}).loss
        loss = loss_sum / labels_BT[:, :-1].numel()
        loss.backward()
        clip_gradients(opt, model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def our_layer(cfg: Qwen3NextConfig, device: torch.device) -> GatedDeltaNet:
    """torchloom's Gated DeltaNet of ``cfg``'s shape: the mixer of a one-layer model of it,
    initialised as in training (on the meta device: unmaterialised, for counting)."""
    one_layer = replace(cfg, num_layers=1, layer_types=("linear_attention",))
    if device.type == "meta":
        with torch.device("meta"):
            model = build_model(one_layer)
    else:
        model = _torchloom_model(one_layer, device, torch.float32)
    return next(m for m in model.modules() if isinstance(m, GatedDeltaNet))


def hf_layer(cfg: Qwen3NextConfig, device: torch.device) -> nn.Module:
    """transformers' Qwen3NextGatedDeltaNet of the same shape (its own random init)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf_config = transformers.Qwen3NextConfig(
        hidden_size=cfg.dim, num_hidden_layers=1, layer_types=["linear_attention"],
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel, rms_norm_eps=cfg.norm_eps,
        hidden_act="silu", vocab_size=cfg.vocab_size,
    )  # fmt: skip
    torch.manual_seed(SEED)
    with torch.device(device):
        return Qwen3NextGatedDeltaNet(hf_config, layer_idx=0)


def hf_kernels(layer: nn.Module) -> dict[str, str]:
    """The delta rule and the convolution transformers' layer calls: an attribute of the layer
    (older transformers) or its modeling module's function, whose hub/fallback wrapper holds
    the implementation it picked at import ('implementation' in its closure)."""
    module = sys.modules[type(layer).__module__]
    slots = {"delta_rule": ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
             "conv": ("causal_conv1d_fn",)}  # fmt: skip
    found = {}
    for slot, names in slots.items():
        owner_names = [(o, n) for o in (layer, module) for n in names if hasattr(o, n)]
        fn = getattr(*owner_names[0]) if owner_names else None
        if fn is None:
            found[slot] = "none (transformers' torch path)"
            continue
        if inspect.isfunction(fn):
            fn = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
        found[slot] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    return found


def layer_step(layer: nn.Module) -> Step:
    """Forward then backward of the layer on an input [B, T, dim] that wants its gradient."""

    def step(x_BTD: torch.Tensor) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        x_BTD = x_BTD.detach().requires_grad_()
        out_BTD = layer(x_BTD)
        out_BTD.backward(torch.ones_like(out_BTD))
        return out_BTD.detach()[0, -1, 0].float().clone()

    return step


def run_row(
    row: str, shape: str, seq: int, batch: int, args: argparse.Namespace, device: torch.device
) -> dict:
    record = {"row": row, "shape": shape, "seq": seq, "batch": batch, "error": None}
    cfg = model_config(shape, row)
    generator = torch.Generator().manual_seed(SEED)
    try:
        if row in MODEL_ROWS:
            record |= {"params": cfg.num_params(), "layer_types": list(cfg.resolved_layer_types()),
                       "compile": args.compile, "remat": args.remat}  # fmt: skip
            flops = cfg.flops_per_token(seq)
            step = model_step(cfg, device, args.compile, args.remat, args.optimizer)
            inputs = [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator)
                      .to(device) for _ in range(args.warmup + args.steps)]  # fmt: skip
        else:
            layer = (hf_layer if row.startswith("hf") else our_layer)(cfg, device)
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            layer = layer.to(dtype)
            record["params"] = sum(p.numel() for p in layer.parameters())
            if row.startswith("hf"):
                record["hf_kernels"] = hf_kernels(layer)
            flops = our_layer(cfg, torch.device("meta")).flops_per_token(seq)
            step = layer_step(torch.compile(layer) if row.endswith("-compiled") else layer)
            x = torch.randn(batch, seq, cfg.dim, generator=generator).to(device, dtype)
            inputs = [x] * (args.warmup + args.steps)
        seconds, losses = measure(step, inputs, args.warmup, device)
        if args.profile_steps and device.type == "cuda":
            record["profile"] = profile_steps(step, inputs[: args.profile_steps], device)
            print(format_kernel_summary(f"{row} {seq}", record["profile"]), flush=True)
    except Exception as err:  # an OOM (or anything else) becomes this row's error
        record["error"] = (
            f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
        )
        print(f"  {row} {seq}: {record['error']}", flush=True)
        return record
    tokens_per_s = batch * seq / seconds
    record |= {"step_s": seconds, "tokens_per_s": tokens_per_s,
               "tflops": tokens_per_s * flops / 1e12}  # fmt: skip
    if row in MODEL_ROWS:
        record["losses"] = losses
    if device.type == "cuda":
        record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"  {row} {seq}: {seconds * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s", flush=True)
    return record


def baseline(row: str) -> str | None:
    """The row a row's tokens/s is divided by (None: none)."""
    if row == "hybrid":
        return "full"
    if row in ("layer", "layer-compiled"):
        return "hf-" + row
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1B", choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--seq-lens", nargs="+", type=int, help="default: the shape's")
    parser.add_argument("--tokens", type=int, help="tokens per step at every seq len "
                        "(batch = tokens / seq; default: the shape's)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    parser.add_argument("--compile", default="graph-breaks", choices=COMPILE_MODES,
                        help="how the model rows' blocks are compiled (docstring)")  # fmt: skip
    parser.add_argument("--remat", default="full", choices=get_args(RematMode),
                        help="recomputation of the model rows")  # fmt: skip
    parser.add_argument("--optimizer", default="fused", choices=["fused", "triton"],
                        help="the model rows' AdamW (--optimizer.implementation)")  # fmt: skip
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after timing, profile this many steps per row (GPU kernel table: "
                        "where a layer's time goes)")  # fmt: skip
    parser.add_argument("--fla-step", default=fla_backend.STEP_KERNEL, choices=["torch", "triton"],
                        help="where torchloom's fla backend runs fla's refused dqkwg step: its "
                        "batched-matmul form or its Triton kernel (kernels/fla_backend.py)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=Path("outputs/hybrid_bench.json"))
    args = parser.parse_args()
    fla_backend.STEP_KERNEL = args.fla_step
    shape = args.shape
    _, _, default_seqs, default_tokens = SHAPES[shape]
    seq_lens, tokens = args.seq_lens or default_seqs, args.tokens or default_tokens
    if any(tokens % seq for seq in seq_lens):
        parser.error(f"--tokens {tokens} must be a multiple of every seq len {seq_lens}")
    device = bench_device(args.device)
    peak, device_name = device_peak_tflops(device)
    ceiling, matmul = matmul_tflops(device)
    delta_rule = "fla" if fla_runs(device.type) else "torch"
    print(f"{device_name}: matmul ceiling {ceiling:.1f} TFLOP/s ({matmul}); delta rule: "
          f"{delta_rule}", flush=True)  # fmt: skip
    for row in MODEL_ROWS:
        cfg = model_config(shape, row)
        print(f"{row}: {cfg.num_params():,} parameters ({cfg.num_params(False):,} without the "
              f"embedding), layers {''.join(t[0] for t in cfg.resolved_layer_types())} "
              "(l: Gated DeltaNet, f: full attention)")  # fmt: skip
    rows = []
    for seq in seq_lens:
        for row in args.rows:
            start = time.perf_counter()
            rows.append(run_row(row, shape, seq, tokens // seq, args, device))
            _free(device)
            rows[-1]["wall_s"] = time.perf_counter() - start  # build, compile, warm-up, steps

    def find(row: str, seq: int) -> dict:
        return next((r for r in rows if r["row"] == row and r["seq"] == seq), {})

    print(f"\n{'row':<{ROW_WIDTH}} {'seq':>6} {'batch':>5} {'params':>13} {'ms/step':>9} "
          f"{'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8} {'ratio':>14}")  # fmt: skip
    for r in rows:
        if r["error"]:
            print(f"{r['row']:<{ROW_WIDTH}} {r['seq']:>6} error: {r['error'][:100]}")
            continue
        base_row = baseline(r["row"])
        base = find(base_row, r["seq"]).get("tokens_per_s") if base_row else None
        r["ratio"] = r["tokens_per_s"] / base if base else None
        r["ratio_over"] = base_row if base else None
        r["mfu"] = 100 * r["tflops"] / peak if peak else None
        ratio = f"{r['ratio']:.2f}x {base_row}" if base else ""
        print(f"{r['row']:<{ROW_WIDTH}} {r['seq']:>6} {r['batch']:>5} {r['params']:>13,} "
              f"{r['step_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10,.0f} {r['tflops']:>8.2f} "
              f"{_fmt(r['mfu'], '.1f', '%'):>6} {_fmt(r.get('peak_mem_gib'), '.2f'):>8} "
              f"{ratio:>14}")  # fmt: skip
    hf = next((r["hf_kernels"] for r in rows if "hf_kernels" in r), None)
    if hf:
        print(f"transformers' layer called: {hf}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": device_name, "peak_tflops": peak, "matmul_tflops": ceiling, "matmul": matmul,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "fla_core": _version("fla-core"), "delta_rule": delta_rule, "fla_step": args.fla_step,
        "hf_kernels": hf,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "shape": shape, "tokens": tokens,
        "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
