"""What a compiled block keeps for its backward pass, with the weights' bf16 copies kept or
recast (``--remat.weight_casts``), and what every_k recomputation then leaves for activations.

    python benchmarks/block_memory.py --flavor 8B --batch 2 --seq 4096     # on the CPU, ~2 min
    python benchmarks/block_memory.py --flavor 8B --device cuda
    python benchmarks/block_memory.py --flavor 1B --float8 --probe-tokens 384   # float8 linears
    python benchmarks/block_memory.py --flavor 8B --budgets 0.9 0.5   # and --remat.mode budget

Two blocks of a llama3 flavor (its widths; a small vocabulary, which no block sees), bf16
autocast over fp32 weights and each block compiled with inductor, as ``torchloom train
--compile.enabled true --remat.mode every_k --remat.every_k 2`` builds them on one GPU: block 0
recomputes in backward, block 1 keeps its activations. One forward of --probe-tokens tokens
runs under saved-tensor hooks that count, per block, the bytes autograd keeps (parameters
themselves excluded: they live anyway). Tensors in bf16 with a weight's shape are the
weights' copies, the same at any token count; the rest grows with the tokens (activations,
RoPE's tables, attention's log-sum-exp: all linear in tokens), so it is scaled to --batch x
--seq. Then, for the model's layers, the activations every_k keeps with each setting, beside
what does not depend on them: fp32 weights and AdamW's two moments, 12 bytes a parameter
before the backward allocates gradients (the embedding, the head's chunked loss and allocator
slack are not counted). A table, and JSON to --json.

``--budgets`` adds ``--remat.mode budget`` (the min-cut partitioner keeps a memory budget's worth
of each block's tensors): one compiled block probed at the step's own tokens, since the
partitioner weighs activations against the block's inputs (its fp32 weights among them) and so
chooses differently at other token counts. Its budget is not a fraction of the block's
activations: at 8B and 2 x 4096 tokens a block keeps 0.41 GiB at 0.5 and 0.66 at 0.9, against
1.54 GiB with nothing recomputed (benchmarks/RESULTS.md, twenty-seventh session).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
from torch import nn

from torchloom.kernels.float8 import convert_linears_to_float8
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.compile import CompileConfig, compile_regions
from torchloom.train.remat import RematConfig, apply_remat, memory_budget, recompute_weight_casts

GIB = 2**30


def kept_bytes(
    flavor: str,
    casts: str,
    tokens: int,
    device: str,
    float8: bool = False,
    budget: float | None = None,
) -> dict[str, dict[str, int]]:
    """Per block (0: recomputed, 1: kept): bytes of weight copies (any narrower-than-fp32
    tensor of a weight's shape or its transpose) and of the rest. With ``budget``: one block
    under ``--remat.mode budget`` (key "budget")."""
    torch._dynamo.reset()
    config = resolve_model_config(ModelConfig(
        name="llama3", flavor=flavor, overrides={"num_layers": 1 if budget else 2, "vocab_size": 256}
    ))  # fmt: skip
    with torch.device(device):
        model = build_model(config)
    model.init_weights(0)
    if float8:
        convert_linears_to_float8(model, "tensorwise")
    remat = RematConfig(mode="every_k", every_k=2, weight_casts=casts)
    if budget is not None:
        remat = RematConfig(mode="budget", memory_budget=budget, weight_casts=casts)
    apply_remat(model.layers, remat, compile_enabled=True)
    compile_regions(model, CompileConfig(enabled=True), memory_budget=memory_budget(remat),
                    recompute_casts=recompute_weight_casts(remat))  # fmt: skip
    shapes = {tuple(p.shape) for p in model.layers.parameters() if p.dim() == 2}
    shapes |= {shape[::-1] for shape in shapes}  # a copy may be kept transposed (float8)
    if any(tokens in shape for shape in shapes):  # [tokens, width] activations would count
        raise SystemExit(f"--probe-tokens {tokens} is a weight's dimension; pick another")
    counts = {name: {"weight_copies": 0, "rest": 0} for name in model.layers}
    inside: list[str] = []
    for name, block in model.layers.items():
        block.register_forward_pre_hook(lambda module, args, name=name: inside.append(name))
        block.register_forward_hook(lambda module, args, out: inside.pop() and None)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside and not isinstance(t, nn.Parameter):
            copy = t.element_size() < 4 and tuple(t.shape) in shapes
            counts[inside[-1]]["weight_copies" if copy else "rest"] += t.numel() * t.element_size()
        return t

    tokens_ = torch.randint(0, 256, (1, tokens), device=device)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast(device, dtype=torch.bfloat16):
        model(tokens_)
    kinds = {"budget": counts["0"]} if budget else {"recomputed": counts["0"], "kept": counts["1"]}
    return kinds, sum(p.numel() for p in model.layers["0"].parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--probe-tokens", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--float8", action="store_true",
                        help="convert the blocks' linears to torchao's Float8Linear (tensorwise)")  # fmt: skip
    parser.add_argument("--budgets", type=float, nargs="*", default=[],
                        help="also --remat.mode budget with these memory budgets, each probed "
                             "at the step's tokens (the partitioner's choice depends on them)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("outputs/block_memory.json"))
    args = parser.parse_args()
    tokens = args.batch * args.seq
    scale = tokens / args.probe_tokens
    layers = resolve_model_config(ModelConfig(name="llama3", flavor=args.flavor)).num_layers
    config = resolve_model_config(ModelConfig(name="llama3", flavor=args.flavor))
    params = sum(p.numel() for p in build_model_meta(config).parameters())
    blocks = {}
    for casts in ("keep", "recompute"):
        measured, block_params = kept_bytes(
            args.flavor, casts, args.probe_tokens, args.device, args.float8
        )
        blocks[casts] = {
            kind: {"weight_copies": c["weight_copies"], "per_token": c["rest"] / args.probe_tokens,
                   "at_step": c["weight_copies"] + c["rest"] * scale}
            for kind, c in measured.items()
        }  # fmt: skip
    print(f"llama3 {args.flavor}: {layers} blocks of {block_params / 1e6:.1f}M parameters, "
          f"{params / 1e9:.2f}B in all; {args.batch} x {args.seq} tokens; bf16 autocast"
          f"{', float8 tensorwise linears' if args.float8 else ''}, "
          f"compiled (inductor, {args.device}), probed at {args.probe_tokens} tokens")  # fmt: skip
    print("\nkept for backward, one block (GiB at the step's tokens)")
    print(f"{'weight_casts':<12} {'block':<11} {'weight copies':>14} {'the rest':>10} {'total':>8}")
    for casts, kinds in blocks.items():
        for kind, b in kinds.items():
            rest = b["at_step"] - b["weight_copies"]
            print(f"{casts:<12} {kind:<11} {b['weight_copies'] / GIB:>14.3f} "
                  f"{rest / GIB:>10.3f} {b['at_step'] / GIB:>8.3f}")  # fmt: skip
    fixed = 12 * params
    rows = []
    print(
        f"\nthe model's activations with every_k (fixed: fp32 weights + AdamW, {fixed / GIB:.1f} GiB)"
    )
    print(
        f"{'weight_casts':<12} {'every_k':>7} {'recomputed':>10} {'activations':>12} {'+ fixed':>8}"
    )
    for casts, kinds in blocks.items():
        for k in (1, 2, 3, 4, 6, 8, 0):
            recomputed = 0 if k == 0 else -(-layers // k)
            total = (recomputed * kinds["recomputed"]["at_step"]
                     + (layers - recomputed) * kinds["kept"]["at_step"])  # fmt: skip
            rows.append({"weight_casts": casts, "every_k": k or None, "recomputed": recomputed,
                         "activations_bytes": total, "with_fixed_bytes": total + fixed})  # fmt: skip
            label = "none" if k == 0 else str(k)
            print(f"{casts:<12} {label:>7} {recomputed:>10} {total / GIB:>12.2f} "
                  f"{(total + fixed) / GIB:>8.2f}")  # fmt: skip
    budgets = []
    if args.budgets:
        print(f"\n--remat.mode budget, every block (probed at {tokens} tokens)")
        print(f"{'budget':>6} {'weight copies':>14} {'the rest':>10} {'block':>8} "
              f"{'activations':>12} {'+ fixed':>8}")  # fmt: skip
    for budget in args.budgets:
        measured, _ = kept_bytes(args.flavor, "keep", tokens, args.device, args.float8, budget)
        c = measured["budget"]
        block = c["weight_copies"] + c["rest"]
        budgets.append({"budget": budget, "weight_copies": c["weight_copies"], "block_bytes": block,
                        "activations_bytes": layers * block,
                        "with_fixed_bytes": layers * block + fixed})  # fmt: skip
        print(f"{budget:>6} {c['weight_copies'] / GIB:>14.3f} {c['rest'] / GIB:>10.3f} "
              f"{block / GIB:>8.3f} {layers * block / GIB:>12.2f} "
              f"{(layers * block + fixed) / GIB:>8.2f}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "device": args.device, "command": shlex.join([sys.executable, *sys.argv]),
        "flavor": args.flavor, "float8": args.float8, "tokens": tokens, "layers": layers, "parameters": params,
        "blocks": blocks, "rows": rows, "budgets": budgets,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


def build_model_meta(config) -> nn.Module:
    with torch.device("meta"):
        return build_model(config)


if __name__ == "__main__":
    main()
