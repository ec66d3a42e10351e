"""The fused decode step's inner loop alone: how fast can one Triton loop stream a strip of a
weight's rows into their dot products with one input row (batch-1 decode's only real work)?

    python3 benchmarks/strip_loop.py                       # on a GPU: TB/s of each form
    python3 benchmarks/strip_loop.py --compile-only        # sm_90 builds, no GPU needed
    TRITON_INTERPRET=1 python3 benchmarks/strip_loop.py --check   # every form, CPU

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
On an H200 (benchmarks/RESULTS.md, thirty-ninth session) ``whole`` streamed 4.19 TB/s, above
``torch.mv`` and every ``seg`` configuration, while the fused step as a whole streams about
half that: its programs run 127 short tasks each. The task forms measure what a task costs
beside its streaming, as the fused step's tasks do it and as they might: programs take tasks of
B row blocks (the fused step's strips are mostly 1 to 4 blocks) from a counter, and
- ``bare``: a task streams its blocks through the pipelined loop, nothing else;
- ``peeled``: the fused step's task: the first block loaded, then a wait for the input (on a
  flag already set: one acquire round trip), the input loaded, the first block summed, the
  rest through the loop, then a barrier and a release increment (what publishing costs);
- ``inloop``: the same work with every block in the loop and the wait and input at its first
  iteration, so that the loop's prologue asks for the first PIPELINE - 1 blocks before the wait
  (a candidate for the fused step: its first block alone is in flight during a wait today);
- ``flow``: tasks assigned to programs in turn (no counter), a program's tasks one stream of
  row blocks through one pipelined loop, each task's wait at its first block and its publishing
  after its last: the loop never drains between tasks (at one block a task Triton leaves it
  unpipelined: the wait is then unconditional). On an H100 (benchmarks/RESULTS.md, fortieth
  session) it gained 6% over ``peeled`` at 2 blocks a task and nothing at 4, and the whole
  step built this way (commit ``ff12c18``) was 14% slower: the round trips of the wait, the
  input and the publishing, not the loop's drain, are what a task costs.
- ``waiting`` and ``publishing``: ``inloop``'s two costs alone, its wait and input without
  its publishing, and its publishing without the wait and input.
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

from torchloom.kernels.fused_decode import _publish, _wait
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


@jit
def _task_strips(w_ptr, x_ptr, y_ptr, counters_ptr, waits_ptr, N, K, num_tasks,
                 ROWS: tl.constexpr, KB: tl.constexpr, PIPELINE: tl.constexpr,
                 BLOCKS: tl.constexpr, WAIT: tl.constexpr, PUBLISH: tl.constexpr):  # fmt: skip
    """Programs take tasks of BLOCKS row blocks of ROWS whole rows from a counter (the next one
    as they start one, as the fused step does) until none is left; each task streams its blocks
    through the pipelined loop. WAIT 0: no wait (x loaded once a program); WAIT 1 (the fused
    step's old task): the first block's weights loaded, then the wait for the input, the input,
    the first block summed, the rest through the loop; WAIT 2 (its task now): every block in the
    loop, the wait and the input at its first iteration, so the loop's prologue asks for the
    first blocks' copies before the wait. PUBLISH: then a barrier and a release increment (its
    publishing). The wait and the publishing are the fused step's own (kernels/fused_decode.py's
    ``_wait`` on wait 0 of ``waits_ptr``, met from the start: one acquire round trip;
    ``_publish`` of stage 0: counter 1)."""
    K = tl.multiple_of(K, 16)
    cols = tl.arange(0, KB)
    col_ok = cols < K
    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    task = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    while task < num_tasks:
        following = tl.atomic_add(counters_ptr, 1, sem="relaxed")
        first = task * BLOCKS
        count = tl.minimum(BLOCKS, tl.cdiv(N, ROWS) - first)
        start = 0
        if WAIT == 1:
            rows = first * ROWS + tl.arange(0, ROWS)
            ok = (rows < N)[:, None] & col_ok[None, :]
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok,
                        other=0.0, eviction_policy="evict_first")  # fmt: skip
            _wait(counters_ptr, waits_ptr, 0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)
            start = 1
        for i in tl.range(start, count, num_stages=PIPELINE):
            rows = (first + i) * ROWS + tl.arange(0, ROWS)
            ok = (rows < N)[:, None] & col_ok[None, :]
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok,
                        other=0.0, eviction_policy="evict_first")  # fmt: skip
            if WAIT == 2:  # noqa: SIM102 (a constexpr test: compiled out of the other forms)
                if i == 0:
                    _wait(counters_ptr, waits_ptr, 0)
                    x = tl.load(x_ptr + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)
        if PUBLISH:
            _publish(counters_ptr, 0)
        task = following


@jit
def _flow_strips(w_ptr, x_ptr, y_ptr, counters_ptr, waits_ptr, N, K, num_tasks,
                 ROWS: tl.constexpr, KB: tl.constexpr, PIPELINE: tl.constexpr,
                 BLOCKS: tl.constexpr, ASM_BARRIER: tl.constexpr):  # fmt: skip
    """Program p of P: tasks p, p + P, p + 2P, ... of BLOCKS row blocks, as one stream of row
    blocks through one pipelined loop: a task's wait and input at its first block, its
    publishing after its last. The blocks' addresses follow from the loop's index alone, so
    the loop asks for the next task's weights while this one waits and publishes: tasks
    pipelined across their boundaries (the fused step's ``peeled`` and ``inloop`` tasks drain
    their loop at every task's end and refill it at the next one's start)."""
    K = tl.multiple_of(K, 16)
    cols = tl.arange(0, KB)
    col_ok = cols < K
    program, programs = tl.program_id(0), tl.num_programs(0)
    mine = tl.cdiv(num_tasks - program, programs)
    x = tl.zeros((KB,), tl.float32)
    for i in tl.range(0, mine * BLOCKS, num_stages=PIPELINE):
        step = i % BLOCKS
        block = (program + (i // BLOCKS) * programs) * BLOCKS + step
        rows = block * ROWS + tl.arange(0, ROWS)
        ok = (rows < N)[:, None] & col_ok[None, :]
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=ok, other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        if step == 0:
            _wait(counters_ptr, waits_ptr, 0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)
        if step == BLOCKS - 1:  # publish: the block's stores, a barrier, a release increment
            if ASM_BARRIER:  # tl.debug_barrier would keep Triton from pipelining the loop
                tl.inline_asm_elementwise("bar.sync 0; mov.u32 $0, 0;", "=r,r", [step],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
            else:  # Triton's interpreter (no inline PTX; programs run one after another)
                tl.debug_barrier()
            tl.atomic_add(counters_ptr + 1, 1, sem="release", scope="gpu")


# The forms that take tasks from a counter: (WAIT, PUBLISH) of _task_strips. ``waiting`` and
# ``publishing`` are ``inloop``'s two costs alone.
COUNTER_FORMS = {"bare": (0, False), "peeled": (1, True), "inloop": (2, True),
                 "waiting": (2, False), "publishing": (0, True)}  # fmt: skip
TASK_FORMS = (*COUNTER_FORMS, "flow")
PUBLISHING_FORMS = {form for form, (_, publish) in COUNTER_FORMS.items() if publish} | {"flow"}


def parse(spec: str) -> dict:
    """A configuration from "whole-RxWxPxS" (rows a block, warps, programs an SM, pipeline
    depth), "seg-RxGxWxPxS" (G: segment width) or "TASK-RxWxPxSxB" (TASK: one of TASK_FORMS;
    B: row blocks a task); ValueError if malformed."""
    form, _, numbers = spec.partition("-")
    parts = numbers.split("x")
    task = ("rows", "warps", "per_sm", "pipeline", "blocks")
    names = {"whole": ("rows", "warps", "per_sm", "pipeline"),
             "seg": ("rows", "seg", "warps", "per_sm", "pipeline"),
             **dict.fromkeys(TASK_FORMS, task)}.get(form)  # fmt: skip
    if (
        names is None
        or len(parts) != len(names)
        or not all(p.isdigit() and int(p) > 0 for p in parts)
    ):
        raise ValueError(f"{spec!r}: want whole-RxWxPxS, seg-RxGxWxPxS or TASK-RxWxPxSxB "
                         f"(TASK: {', '.join(TASK_FORMS)}), e.g. whole-4x4x2x3, "
                         "seg-16x256x4x2x3 or peeled-4x4x2x3x2")  # fmt: skip
    return {"form": form, **dict(zip(names, map(int, parts)))}


def launch(config: dict, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, programs: int,
           counters: torch.Tensor | None = None) -> None:  # fmt: skip
    """One pass of ``config``'s kernel over ``w`` (``programs`` persistent programs); a task
    form takes its tasks from ``counters`` ([3] int32: the task counter, the publishing
    counter, the input's counter, already 1; default a fresh one)."""
    n, k = w.shape
    kb = triton.next_power_of_2(k)
    blocks = -(-n // config["rows"])
    strip = -(-blocks // programs)
    common = {"ROWS": config["rows"], "KB": kb, "PIPELINE": config["pipeline"],
              "num_warps": config["warps"]}  # fmt: skip
    if config["form"] in TASK_FORMS:
        if counters is None:
            counters = torch.tensor([0, 0, 1], dtype=torch.int32, device=w.device)
        tasks = -(-blocks // config["blocks"])
        waits = torch.tensor([2, 1], dtype=torch.int32, device=w.device)  # counter 2 at 1
        if config["form"] == "flow":
            _flow_strips[(programs,)](w, x, y, counters, waits, n, k, tasks,
                                      BLOCKS=config["blocks"], ASM_BARRIER=w.is_cuda, **common)  # fmt: skip
        else:
            wait, publish = COUNTER_FORMS[config["form"]]
            _task_strips[(programs,)](w, x, y, counters, waits, n, k, tasks,
                                      BLOCKS=config["blocks"], WAIT=wait, PUBLISH=publish,
                                      **common)  # fmt: skip
    elif config["form"] == "whole":
        _whole_rows[(programs,)](w, x, y, n, k, strip, **common)
    else:
        _segmented_rows[(programs,)](w, x, y, n, k, strip, SEG=config["seg"], **common)


def stream(config: dict, weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
           programs: int, counters: torch.Tensor) -> None:  # fmt: skip
    """One pass of ``config``'s kernel over each of ``weights`` (``counters``: [len(weights),
    3], reset first: one memset, the same for every form)."""
    counters[:, :2] = 0
    for w, row in zip(weights, counters):
        launch(config, w, x, y, programs, row)


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
            counters = torch.tensor([0, 0, 1], dtype=torch.int32)
            launch(small, w, x, y, programs, counters)
            error = (y - w @ x).abs().max().item()
            assert error < 1e-4, f"{small} with {programs} programs: max |diff| {error:.1e}"
            if config["form"] in PUBLISHING_FORMS:  # every task published once
                blocks = -(-203 // small["rows"])
                tasks = -(-blocks // small["blocks"])
                assert counters[1].item() == tasks, (small, counters.tolist(), tasks)
    print(f"check passed: {len(configs)} configurations x 1, 3, 7 programs")


def compile_only(configs: list[dict], specs: list[str]) -> dict:
    """Each configuration's sm_90 build at K = 2,048 (bf16 weights), no GPU needed."""
    from torchloom.kernels.triton_support import compile_for_hopper, compile_sm90

    rows = {}
    for spec, config in zip(specs, configs):
        types = {"w_ptr": "*bf16", "x_ptr": "*fp32", "y_ptr": "*fp32", "N": "i32", "K": "i32",
                 "strip": "i32"}  # fmt: skip
        kernel = _whole_rows if config["form"] == "whole" else _segmented_rows
        constants = {"ROWS": config["rows"], "KB": K_WIDTH, "PIPELINE": config["pipeline"]}
        if config["form"] == "seg":
            constants["SEG"] = config["seg"]
        if config["form"] in TASK_FORMS:
            kernel = _flow_strips if config["form"] == "flow" else _task_strips
            types = {"w_ptr": "*bf16", "x_ptr": "*fp32", "y_ptr": "*fp32",
                     "counters_ptr": "*i32", "waits_ptr": "*i32", "N": "i32", "K": "i32",
                     "num_tasks": "i32"}  # fmt: skip
            constants["BLOCKS"] = config["blocks"]
            if config["form"] == "flow":
                constants["ASM_BARRIER"] = True
            else:
                constants["WAIT"], constants["PUBLISH"] = COUNTER_FORMS[config["form"]]
        args = (kernel, types, constants, config["warps"])
        usage = compile_for_hopper(*args, divisible=["w_ptr", "x_ptr", "y_ptr", "K"]).split()
        compiled = compile_sm90(*args[:3], num_warps=config["warps"],
                                divisible=["w_ptr", "x_ptr", "y_ptr", "K"])  # fmt: skip
        ptx = compiled.asm["ptx"]
        if config["form"] in TASK_FORMS:  # the task loop's code holds the strip loop
            rows[spec] = {"registers": usage[0], "spills": usage[-1],
                          "shared_kb": compiled.metadata.shared // 1024,
                          "async_copies": ptx.count("cp.async.cg"),
                          "acquire_loads": ptx.count(".acquire")}  # fmt: skip
            print(f"sm_90 {spec}", rows[spec], flush=True)
            continue
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
            counters = torch.tensor([[0, 0, 1]] * copies, dtype=torch.int32, device=device)
            one_pass = partial(stream, config, weights, x, y, programs, counters)
            report[spec] = {"TB_per_s": rate(one_pass), "relative_error": round(error, 6)}
        except Exception as exc:  # a configuration that does not compile or fit: say which
            report[spec] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(spec, report[spec], flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", metavar="SPEC",
                        default=["whole-4x4x2x3", "seg-32x256x4x2x3"]
                        + [f"{form}-4x4x2x3x{blocks}" for form in TASK_FORMS
                           for blocks in (1, 2, 4, 16)],
                        help="whole-RxWxPxS (rows a block x warps x programs an SM x pipeline "
                             "depth), seg-RxGxWxPxS (G: the segment width) or "
                             f"TASK-RxWxPxSxB (tasks of B row blocks; TASK: "
                             f"{', '.join(TASK_FORMS)})")  # fmt: skip
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
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("strip_loop.py --compile-only builds for sm_90: run it without "
                     "TRITON_INTERPRET=1")  # fmt: skip
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
