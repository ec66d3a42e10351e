"""The fused decode step's inner loop alone: how fast can one Triton loop stream a strip of a
weight's rows into their dot products with one input row (batch-1 decode's only real work)?

    python3 benchmarks/strip_loop.py                       # on a GPU: TB/s of each form
    python3 benchmarks/strip_loop.py --compile-only        # sm_90 builds, no GPU needed
    TRITON_INTERPRET=1 python3 benchmarks/strip_loop.py --check   # both forms, CPU

Each persistent program streams one strip of consecutive row blocks of a [N, K] bf16 weight
(K = 2,048, the Llama-3.2-1B width, in one slice) through a loop Triton pipelines, in one of two
forms:
- ``whole``: a block is ROWS whole rows ([ROWS, K]); its sums are taken every iteration. With
  4 warps Triton spreads each row over all of them, so every iteration also reduces across
  warps through shared memory (kernels/fused_decode.py's strips do this; benchmarks/RESULTS.md,
  thirty-eighth session: 4 ``bar.sync`` an iteration in its sm_90 build);
- ``seg``: a block is ROWS rows by one SEG-wide segment of K ([ROWS, SEG]; at SEG = 256, 8
  bf16 a lane x 32 lanes, one warp spans a segment, so the warps hold whole rows); products
  accumulate elementwise over the row block's K / SEG segments and are summed (inside each
  warp) once a row block.
Reported: the weights' rate (TB/s) of each form and configuration, against ``torch.mv`` and
``F.linear`` on the same weight; ``--compile-only`` gives registers, spills, shared memory and
the barriers, shuffles and shared-memory loads in the loop's code, header to exit (read from
the PTX; the ``seg`` form's summing branch among them runs once a row block, not every
iteration).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from torchloom.kernels.triton_support import jit, tl, triton

K_WIDTH = 2048


@jit
def _whole_rows(w_ptr, x_ptr, y_ptr, N, K, strip, ROWS: tl.constexpr, KB: tl.constexpr,
                PIPELINE: tl.constexpr):  # fmt: skip
    """Program p: row blocks [p * strip, (p + 1) * strip) of ROWS whole rows, summed each
    iteration."""
    K = tl.multiple_of(K, 16)
    cols = tl.arange(0, KB)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    first = tl.program_id(0) * strip
    count = tl.minimum(strip, tl.cdiv(N, ROWS) - first)
    for i in tl.range(0, count, num_stages=PIPELINE):
        rows = (first + i) * ROWS + tl.arange(0, ROWS)
        ok = (rows < N)[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok, other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)


@jit
def _segmented_rows(w_ptr, x_ptr, y_ptr, N, K, strip, ROWS: tl.constexpr, SEG: tl.constexpr,
                    KB: tl.constexpr, PIPELINE: tl.constexpr):  # fmt: skip
    """Program p: the same row blocks, each as KB / SEG segments of [ROWS, SEG] whose products
    accumulate elementwise; a row block's sums are taken once, after its last segment."""
    K = tl.multiple_of(K, 16)
    SEGMENTS: tl.constexpr = KB // SEG
    first = tl.program_id(0) * strip
    count = tl.minimum(strip, tl.cdiv(N, ROWS) - first)
    offsets = tl.arange(0, SEG)
    acc = tl.zeros((ROWS, SEG), tl.float32)
    for i in tl.range(0, count * SEGMENTS, num_stages=PIPELINE):
        rows = (first + i // SEGMENTS) * ROWS + tl.arange(0, ROWS)
        segment = i % SEGMENTS
        cols = segment * SEG + offsets
        ok = (rows < N)[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok, other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if segment == SEGMENTS - 1:
            tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=rows < N)
            acc = tl.zeros((ROWS, SEG), tl.float32)


def parse(spec: str) -> dict:
    """A configuration from "whole-RxWxPxS" (rows a block, warps, programs an SM, pipeline
    depth) or "seg-RxGxWxPxS" (G: segment width); ValueError if malformed."""
    form, _, numbers = spec.partition("-")
    parts = numbers.split("x")
    names = {"whole": ("rows", "warps", "per_sm", "pipeline"),
             "seg": ("rows", "seg", "warps", "per_sm", "pipeline")}.get(form)  # fmt: skip
    if (
        names is None
        or len(parts) != len(names)
        or not all(p.isdigit() and int(p) > 0 for p in parts)
    ):
        raise ValueError(f"{spec!r}: want whole-RxWxPxS or seg-RxGxWxPxS, e.g. whole-4x4x2x3 or "
                         "seg-16x256x4x2x3")  # fmt: skip
    return {"form": form, **dict(zip(names, map(int, parts)))}


def launch(config: dict, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, programs: int):
    """One pass of ``config``'s kernel over ``w`` (``programs`` persistent programs)."""
    n, k = w.shape
    kb = triton.next_power_of_2(k)
    blocks = -(-n // config["rows"])
    strip = -(-blocks // programs)
    common = {"ROWS": config["rows"], "KB": kb, "PIPELINE": config["pipeline"],
              "num_warps": config["warps"]}  # fmt: skip
    if config["form"] == "whole":
        _whole_rows[(programs,)](w, x, y, n, k, strip, **common)
    else:
        _segmented_rows[(programs,)](w, x, y, n, k, strip, SEG=config["seg"], **common)


def stream(config: dict, weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
           programs: int) -> None:  # fmt: skip
    """One pass of ``config``'s kernel over each of ``weights``."""
    for w in weights:
        launch(config, w, x, y, programs)


def check(configs: list[dict]) -> None:
    """Each form against ``w @ x`` (fp32; the interpreter), uneven strips and a ragged last
    row block."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(203, 64, generator=gen)
    x = torch.randn(64, generator=gen)
    for config in configs:
        small = config | {"seg": min(config.get("seg", 16), 16)}
        for programs in (1, 3, 7):
            y = torch.full((203,), float("nan"))
            launch(small, w, x, y, programs)
            error = (y - w @ x).abs().max().item()
            assert error < 1e-4, f"{small} with {programs} programs: max |diff| {error:.1e}"
    print(f"check passed: {len(configs)} configurations x 1, 3, 7 programs")


def compile_only(configs: list[dict], specs: list[str]) -> dict:
    """Each configuration's sm_90 build at K = 2,048 (bf16 weights), no GPU needed."""
    from torchloom.kernels.triton_support import compile_for_hopper, compile_sm90

    types = {"w_ptr": "*bf16", "x_ptr": "*fp32", "y_ptr": "*fp32", "N": "i32", "K": "i32",
             "strip": "i32"}  # fmt: skip
    rows = {}
    for spec, config in zip(specs, configs):
        kernel = _whole_rows if config["form"] == "whole" else _segmented_rows
        constants = {"ROWS": config["rows"], "KB": K_WIDTH, "PIPELINE": config["pipeline"]}
        if config["form"] == "seg":
            constants["SEG"] = config["seg"]
        args = (kernel, types, constants, config["warps"])
        usage = compile_for_hopper(*args, divisible=["w_ptr", "x_ptr", "y_ptr", "K"]).split()
        compiled = compile_sm90(*args[:3], num_warps=config["warps"],
                                divisible=["w_ptr", "x_ptr", "y_ptr", "K"])  # fmt: skip
        ptx = compiled.asm["ptx"]
        start = ptx.index("Loop Header")
        loop = ptx[start : ptx.index("._crit_edge", start)]  # the loop's code, not its exit
        # Bytes of weights an iteration: the pipelined loop's body runs once a block / segment.
        per_iteration = (
            config["rows"] * (K_WIDTH if config["form"] == "whole" else config["seg"]) * 2
        )
        rows[spec] = {
            "registers": usage[0], "spills": usage[-1],
            "shared_kb": compiled.metadata.shared // 1024,
            "weight_kb_an_iteration": per_iteration // 1024,
            **{f"{name}_in_loop": len(re.findall(pattern, loop)) for name, pattern in (
                ("bar_sync", r"\bbar\.sync"), ("shuffles", r"\bshfl\.sync"),
                ("shared_loads", r"\bld\.shared"), ("async_copies", r"cp\.async\.cg"))},
        }  # fmt: skip
        print(f"sm_90 {spec}", rows[spec], flush=True)
    return rows


def time_on_gpu(configs: list[dict], specs: list[str], rows_n: int, copies: int) -> dict:
    """TB/s of each configuration and of torch.mv / F.linear over ``copies`` [rows_n, 2048]
    bf16 weights (separate, so L2 holds none between passes)."""
    from gpu_bench import ms_per_call

    device = torch.device("cuda")
    weights = [torch.randn(rows_n, K_WIDTH, device=device, dtype=torch.bfloat16)
               for _ in range(copies)]  # fmt: skip
    x = torch.randn(K_WIDTH, device=device)
    y = torch.empty(rows_n, device=device)
    x_bf16 = x.to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gigabytes = copies * rows_n * K_WIDTH * 2 / 1e9
    want = weights[0].float() @ x
    report = {}

    def rate(fn) -> float:
        ms_per_call(fn, 3)
        return round(gigabytes / ms_per_call(fn, 10) / 1e-3 / 1e3, 3)  # TB/s

    baselines = {"torch.mv": lambda: [torch.mv(w, x_bf16) for w in weights],
                 "F.linear": lambda: [F.linear(x_bf16[None], w) for w in weights]}  # fmt: skip
    for name, fn in baselines.items():
        report[name] = {"TB_per_s": rate(fn)}
        print(name, report[name], flush=True)
    for spec, config in zip(specs, configs):
        programs = config["per_sm"] * sms
        try:
            launch(config, weights[0], x, y, programs)
            error = ((y - want).abs().max() / want.abs().max()).item()
            report[spec] = {"TB_per_s": rate(partial(stream, config, weights, x, y, programs)),
                            "relative_error": round(error, 6)}  # fmt: skip
        except Exception as exc:  # a configuration that does not compile or fit: say which
            report[spec] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(spec, report[spec], flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", metavar="SPEC",
                        default=["whole-4x4x2x3", "whole-8x8x1x3", "seg-16x256x4x2x3",
                                 "seg-32x256x4x2x3", "seg-16x256x4x2x4", "seg-32x256x8x1x3"],
                        help="whole-RxWxPxS (rows a block x warps x programs an SM x pipeline "
                             "depth) or seg-RxGxWxPxS (G: the segment width)")  # fmt: skip
    parser.add_argument("--rows", type=int, default=131072, help="rows of each weight (GPU)")
    parser.add_argument("--copies", type=int, default=2, help="weights streamed a pass (GPU)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="each form against w @ x (run with TRITON_INTERPRET=1 on a CPU)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="each configuration's sm_90 build, no GPU needed",
    )
    parser.add_argument("--json", type=Path, default=Path("outputs/strip_loop.json"))
    args = parser.parse_args()
    if triton is None:
        sys.exit("strip_loop.py needs triton: pip install triton")
    try:
        configs = [parse(spec) for spec in args.configs]
    except ValueError as error:
        parser.error(str(error))
    if args.check:
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            sys.exit("strip_loop.py --check runs Triton's interpreter: set TRITON_INTERPRET=1")
        check(configs)
        return
    if args.compile_only:
        compile_only(configs, args.configs)
        return
    if not torch.cuda.is_available():
        sys.exit("strip_loop.py times kernels on a CUDA GPU; without one run --compile-only, or "
                 "--check with TRITON_INTERPRET=1")  # fmt: skip
    from gpu_bench import write_report

    report = time_on_gpu(configs, args.configs, args.rows, args.copies)
    write_report(args.json, [{"name": name, **row} for name, row in report.items()])


if __name__ == "__main__":
    main()
