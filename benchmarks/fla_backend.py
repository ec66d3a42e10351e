"""torchloom's forms of fla's chunk-parallel gated delta-rule gradients
(torchloom/kernels/fla_backend.py: the PyTorch reference form, and the Triton kernel its fla
backend runs at 4 and 8 warps) against fla's own Triton kernel, one GPU: error and time.

    python benchmarks/fla_backend.py --shapes 1x32768 8x4096   # Qwen3-Next's Gated DeltaNet heads

fla 0.6 refuses its Triton ``chunk_bwd_dqkwg`` on Hopper with Triton >= 3.4, < 3.7.1 (fla issue
#640); this script lifts that refusal to call it anyway, for comparison only. Inputs: random,
bf16 (g fp32, the log2 decay summed within each 64-row chunk), 16 q/k heads and 32 value heads
of 128 as Qwen3-Next's Gated DeltaNet. Reference: the PyTorch form on fp32 copies of the same
inputs (its arithmetic is checked against autograd in tests/kernels/test_fla_backend.py).
Error: max |x - reference| / max |reference| per output. Time: median of --steps calls after
--warmup, CUDA events. Context row: fla's whole chunk_gated_delta_rule forward + backward at the
shape (through torchloom's backend where fla's kernel is refused). ``--gradients`` first runs
fla's whole rule with each form of the step against torchloom's chunked form (layer_gradients;
error there: norm of the difference over the reference's, as the GPU test). JSON to --json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from torchloom.kernels import fla_backend

OUTPUTS = ("dq", "dk", "dw", "dg")


def inputs(B: int, T: int, H: int, HV: int, D: int, BT: int, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16()

    NT = T // BT
    g = -0.05 * torch.rand(B, NT, BT, HV, generator=gen, device=device)
    return {
        "q": randn(B, T, H, D, scale=D**-0.5), "k": randn(B, T, H, D, scale=D**-0.5),
        "v": randn(B, T, HV, D), "do": randn(B, T, HV, D, scale=0.1),
        "h": randn(B, NT, HV, D, D), "dh": randn(B, NT, HV, D, D, scale=0.1),
        "w": randn(B, T, HV, D, scale=0.1), "g": g.cumsum(2).view(B, T, HV),
        "dv": randn(B, T, HV, D, scale=0.1), "scale": D**-0.5, "chunk_size": BT,
    }  # fmt: skip


def timed(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fla_triton_kernel():
    """fla's own chunk_bwd_dqkwg, past its dispatch and its Hopper refusal."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
    return inspect.unwrap(chunk_o.chunk_bwd_dqkwg)


def whole_rule(x: dict) -> Callable[[], None]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, T, HV = x["v"].shape[:3]
    q, k = (x[n].detach().clone().requires_grad_() for n in ("q", "k"))
    v = x["v"].detach().clone().requires_grad_()
    g = (-0.05 * torch.rand(B, T, HV, device=q.device)).requires_grad_()  # per-step log decay
    beta = torch.rand(B, T, HV, device=q.device).bfloat16().requires_grad_()

    def step() -> None:
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.sum().backward()

    return step


GRADS = ("o", "state", "dq", "dk", "dv", "dg", "dbeta")
STEP_FORMS = ("fla", "torchloom-triton", "torchloom-torch")


def gdn_case(device: torch.device, v_dtype: torch.dtype, documents: bool = True) -> tuple:
    """The GPU test's Gated DeltaNet case (tests/kernels/test_delta_rule.py, fla vs the chunked
    form): [q, k, v, g, beta] with q/k fp32 at half v's heads and v's values bf16 (held in
    ``v_dtype``), an initial state, and documents of 70 and 130 tokens per row (or none: 200
    tokens, the last chunk partial)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(5)
    B, T, H, D = 2, 200, 4, 64
    q, k = (torch.randn(B, T, H // 2, D, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=gen).bfloat16().to(v_dtype)
    g = -F.softplus(torch.randn(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, D, D, generator=gen) * 0.1
    docs = torch.cat([torch.zeros(B, 70), torch.ones(B, 130)], dim=1).long()
    inputs = [x.to(device) for x in (q, k, v, g, beta)]
    return inputs, state.to(device), docs.to(device) if documents else None


def use_step(form: str) -> None:
    """Make fla's gated backward run ``form`` of its dqkwg step on any device: fla's own kernel
    (its Hopper refusal lifted), or through torchloom's registered backend its Triton kernel or
    its PyTorch form. ``"default"``: back to what the backend decides by itself."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
    if form == "default":
        fla_backend.triton_miscompiles_dqkwg = _MISCOMPILES
    else:
        fla_backend.triton_miscompiles_dqkwg = lambda: form != "fla"  # the backend's verifier
    fla_backend.STEP_KERNEL = "torch" if form == "torchloom-torch" else "triton"


_MISCOMPILES = fla_backend.triton_miscompiles_dqkwg


def relative_errors(got: list[torch.Tensor], reference: list[torch.Tensor]) -> dict[str, float]:
    """Per output: the norm of the difference over the reference's (as the GPU test)."""
    return {n: float((a.float() - b.float()).norm() / b.float().norm())
            for n, a, b in zip(GRADS, got, reference)}  # fmt: skip


def layer_gradients(device: torch.device) -> list[dict]:
    """``gdn_case``, with and without documents, through fla's whole gated delta rule with each
    form of the dqkwg step: outputs and gradients against the fp32 chunked form (impl "torch").
    Tells which step an error comes from (benchmarks/fla_bf16_emulation.py: the same on the
    CPU, with bf16 storage emulated)."""
    from torchloom.kernels.delta_rule import delta_rule

    def run(impl: str, inputs: list, state: torch.Tensor, docs) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, s = delta_rule(*leaves, state, impl=impl, doc_ids_BT=docs, normalize_qk=True)
        (o.float().square().sum() + s.square().sum()).backward()
        return [o, s] + [x.grad for x in leaves]

    rows = []
    for layout in ("documents", "whole"):
        case = gdn_case(device, torch.bfloat16, documents=layout == "documents")
        reference = run("torch", *case)
        for form in STEP_FORMS:
            use_step(form)
            rows.append({"row": form, "layout": layout,
                         "rel_error": relative_errors(run("fla", *case), reference)})  # fmt: skip
            print(rows[-1], flush=True)
    use_step("default")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x32768"], help="BxT")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("outputs/fla_backend_bench.json"))
    parser.add_argument("--gradients", action="store_true",
                        help="first, fla's whole rule with each form of the step against the "
                        "chunked form (layer_gradients)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda")
    fla_backend.register()
    gradients = layer_gradients(device) if args.gradients else []
    if gradients:
        print(f"\n{'row':<20} {'layout':>10}  " + "  ".join(f"{n:>7}" for n in GRADS))
        for r in gradients:
            print(f"{r['row']:<20} {r['layout']:>10}  "
                  + "  ".join(f"{r['rel_error'][n]:>7.1e}" for n in GRADS))  # fmt: skip
    fla_kernel = fla_triton_kernel()
    rows = []
    for shape in args.shapes:
        B, T = (int(n) for n in shape.split("x"))
        x = inputs(B, T, 16, 32, 128, 64, device)
        reference = fla_backend.chunk_bwd_dqkwg(**{
            n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in x.items()
        })  # fmt: skip
        variants = (("torchloom", fla_backend.chunk_bwd_dqkwg, 0),
                    *((f"torchloom-triton-w{warps}", functools.partial(
                        fla_backend.chunk_bwd_dqkwg, kernel="triton"), warps) for warps in (4, 8)),
                    ("fla-triton", fla_kernel, 0))  # fmt: skip
        for name, fn, warps in variants:
            fla_backend.TRITON_WARPS = warps or fla_backend.TRITON_WARPS
            got = fn(**x)
            error = {
                o: float((a.float() - b).abs().max() / b.abs().max())
                for o, a, b in zip(OUTPUTS, got, reference)
            }
            ms = timed(lambda fn=fn, x=x: fn(**x), args.steps, args.warmup)
            rows.append({"row": name, "shape": shape, "ms": ms, "rel_error": error})
            print(rows[-1], flush=True)
        ms = timed(whole_rule(x), args.steps, args.warmup)
        rows.append({"row": "whole-rule", "shape": shape, "ms": ms, "rel_error": None})
        print(rows[-1], flush=True)
        del x, reference
        torch.cuda.empty_cache()
    print(
        f"\n{'row':<20} {'B x T':>8} {'ms':>8}  " + "  ".join(f"{o + ' err':>9}" for o in OUTPUTS)
    )
    for r in rows:
        errors = "  ".join(f"{r['rel_error'][o]:>9.2e}" for o in OUTPUTS) if r["rel_error"] else ""
        print(f"{r['row']:<20} {r['shape']:>8} {r['ms']:>8.2f}  {errors}")
    print("whole-rule: fla's chunk_gated_delta_rule forward + backward (its dqkwg step: "
          f"{'torchloom' if fla_backend.triton_miscompiles_dqkwg() else 'fla-triton'})")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "rows": rows,
        "gradients": gradients,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
