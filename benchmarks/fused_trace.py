"""Where the fused decode step's time goes inside its one launch (kernels/fused_decode.py).

The step runs once with ``FusedDecodeStep(trace=True)``: every task stamps the multiprocessor's
cycle counter at its start, before and after its wait, when its input has arrived, when its
strip of weights is summed and at its end (and the global timer at its start and end). From
them, for each kind of task (q/k/v, attention, o, gate/up, down, head, log-probabilities):
how long a task spends on its table rows and first copies, waiting, reading its input,
streaming its strip and publishing, and what that adds up to for a program; and each stage's
period on the step's timeline (from the previous stage's last task's end to its own), with
the TB/s its weights stream at over it, and its hand-off (its first wait's end after the
previous stage's last end). ``--stamps DIR`` also keeps the raw stamps and tables. Needs a
CUDA GPU.

    python3 benchmarks/fused_trace.py                      # Llama-3.2-1B shape, bf16
    python3 benchmarks/fused_trace.py --fused 8192x4x2x1x3 --position 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from decode_step import build, fused_tiling, tiling_argument
from gpu_bench import ms_per_call, write_report

from torchloom.generate.fused_step import decode_weights
from torchloom.kernels.fused_decode import (
    ATTEND,
    EMBED,
    MATVEC,
    TRACE_FIELDS,
    FusedDecodeStep,
    Stamp,
)

START_NS, START, WAITED, INPUT, STRIP, END, SM, END_NS, WAIT = Stamp  # the stamps' columns
# A matrix task's phases, between its stamps in this order.
MATRIX_PHASES = {"table and first copies": (START, WAIT), "wait": (WAIT, WAITED),
                 "input": (WAITED, INPUT), "strip": (INPUT, STRIP), "finish": (STRIP, END)}  # fmt: skip
ATTEND_PHASES = {"table and first keys": (START, WAIT), "wait": (WAIT, WAITED),
                 "attend": (WAITED, END)}  # fmt: skip
OTHER_PHASES = {"whole": (START, END)}


def task_labels(step: FusedDecodeStep) -> tuple[list[str], list[int], list[int]]:
    """Each task's kind ("q/k/v", "attention", "o", "gate/up", "down", "head", "embed",
    "logprob"), stage and bytes of weights read."""
    tasks, matrices = step.tasks.tolist(), step.matrices.tolist()
    layers = step.layers.tolist()
    element = step.base.element_size()
    labels, stages, weight_bytes = [], [], []
    for kind, index, tile in tasks:
        if kind == MATVEC:
            m = matrices[index]
            n, k, gated, chunks, strip, blocks = m[1], m[2], m[10] >= 0, m[11], m[14], m[15]
            label = ("head" if m[9] else "gate/up" if gated else "down" if chunks > 1
                     else "o" if m[5] >= 0 else "q/k/v")  # fmt: skip
            rows = step.gated_rows if gated else step.rows
            first, chunk = (tile // chunks) * strip, tile % chunks
            count = min(strip, blocks - first)
            out = min(n, (first + count) * rows) - first * rows
            width = min(step.chunk, k - chunk * step.chunk)
            labels.append(label)
            stages.append(m[8])
            weight_bytes.append(out * width * element * (2 if gated else 1))
        elif kind == ATTEND:
            labels.append("attention")
            stages.append(layers[index][6])
            weight_bytes.append(0)
        else:
            labels.append("embed" if kind == EMBED else "logprob")
            stages.append(0 if kind == EMBED else len(step.stages))  # after every stage
            weight_bytes.append(0)
    return labels, stages, weight_bytes


def summarize(step: FusedDecodeStep, stamps: torch.Tensor) -> dict:
    """The trace ``stamps`` ([tasks, TRACE_FIELDS] int64 of one traced call) as per-kind phase
    times (microseconds: a task's mean, and the sum over tasks divided by the programs, so that
    a kind's phases add up to the share of a program's time it takes) and per-kind stage
    periods on the step's timeline."""
    rows = stamps.view(-1, TRACE_FIELDS).double()
    # Cycles a nanosecond, from each multiprocessor's span in both clocks (median over them).
    rates = []
    for sm in rows[:, SM].unique():
        mine = rows[rows[:, SM] == sm]
        span_ns = mine[:, END_NS].max() - mine[:, START_NS].min()
        if span_ns > 0:
            rates.append(float((mine[:, END].max() - mine[:, START].min()) / span_ns))
    per_ns = statistics.median(rates)
    labels, stages, weight_bytes = task_labels(step)
    kinds: dict[str, dict] = {}
    for label in dict.fromkeys(labels):
        mine = torch.tensor([lab == label for lab in labels])
        phases = (MATRIX_PHASES if label in ("q/k/v", "o", "gate/up", "down", "head")
                  else ATTEND_PHASES if label == "attention" else OTHER_PHASES)  # fmt: skip
        row = {"tasks": int(mine.sum())}
        for name, (a, b) in phases.items():
            us = (rows[mine, b] - rows[mine, a]) / per_ns / 1e3
            row[name] = {"mean_us": round(float(us.mean()), 3),
                         "per_program_us": round(float(us.sum()) / step.programs, 2)}  # fmt: skip
        if "strip" in row:
            strip_s = ((rows[mine, STRIP] - rows[mine, INPUT]) / per_ns / 1e9).sum()
            total = sum(b for b, keep in zip(weight_bytes, mine.tolist()) if keep)
            row["strip_GB_per_s_a_program"] = round(total / float(strip_s) / 1e9, 2)
        kinds[label] = row
    # Stage periods: from the previous stage's last end to this one's (global ns).
    ends: dict[int, float] = {}
    for stage, end in zip(stages, rows[:, END_NS].tolist()):
        ends[stage] = max(ends.get(stage, 0.0), end)
    order = sorted(ends, key=ends.get)
    start = float(rows[:, START_NS].min())
    periods: dict[str, list[float]] = {}
    stage_bytes: dict[int, int] = {}
    stage_label: dict[int, str] = {}
    for stage, label, b in zip(stages, labels, weight_bytes):
        stage_bytes[stage] = stage_bytes.get(stage, 0) + b
        stage_label[stage] = label
    # Each task's wait's end on the global timer (its start's, plus the cycles since over the
    # rate): a stage's first release after the previous stage's last end is the hand-off's
    # latency (negative: a reader of some rows started before the rest were written).
    released = rows[:, START_NS] + (rows[:, WAITED] - rows[:, START]) / per_ns
    first_release: dict[int, float] = {}
    for stage, label, at in zip(stages, labels, released.tolist()):
        if label not in ("embed", "logprob"):
            first_release[stage] = min(first_release.get(stage, at), at)
    previous = start
    period_bytes: dict[str, int] = {}
    handoffs: dict[str, list[float]] = {}
    for stage in order:
        label = stage_label[stage]
        periods.setdefault(label, []).append(ends[stage] - previous)
        period_bytes[label] = period_bytes.get(label, 0) + stage_bytes[stage]
        if stage in first_release:
            handoffs.setdefault(label, []).append(first_release[stage] - previous)
        previous = ends[stage]
    timeline = {}
    for label, spans in periods.items():
        total_ns = sum(spans)
        timeline[label] = {"stages": len(spans), "mean_us": round(total_ns / len(spans) / 1e3, 3),
                           "total_us": round(total_ns / 1e3, 1),
                           "first_release_after_previous_end_us": round(
                               sum(handoffs[label]) / len(handoffs[label]) / 1e3, 3)
                           if label in handoffs else None,
                           "TB_per_s": round(period_bytes[label] / total_ns / 1e3, 3)
                           if period_bytes[label] else None}  # fmt: skip
    return {"step_us": round((float(rows[:, END_NS].max()) - start) / 1e3, 1),
            "cycles_per_ns": round(per_ns, 3), "programs": step.programs, "kinds": kinds,
            "timeline": timeline}  # fmt: skip


def save_tables(step: FusedDecodeStep, path: Path) -> None:
    """``step``'s stamps and the tables that say what each task was (tasks, matrices, layers,
    stages, waits; its programs and row counts) at ``path`` (``torch.save``), for analyses
    ``summarize`` does not make."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = ("stamps", "tasks", "matrices", "layers", "stages", "waits")
    tables = {name: getattr(step, name).cpu() for name in names}
    sizes = {"programs": step.programs, "rows": step.rows, "gated_rows": step.gated_rows,
             "chunk": step.chunk}  # fmt: skip
    torch.save(tables | sizes, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--position", type=int, default=200, help="the step's cache position")
    parser.add_argument(
        "--fused",
        nargs="*",
        default=["8192x4x2x1x3"],
        type=tiling_argument,
        metavar="TxWxP[xV[xS[xL[xC[xD[xR[xA[xT]]]]]]]]",
        help="tilings, as decode_step.py's",
    )
    parser.add_argument("--json", type=Path, default=Path("outputs/fused_trace.json"))
    parser.add_argument(
        "--stamps",
        type=Path,
        default=None,
        help="also save each tiling's raw stamps and the step's tables here "
        "(torch.save; one file a tiling, the tiling in its name)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_trace.py reads the GPU's clocks: it needs a CUDA GPU.")
    device = torch.device("cuda")
    model, _ = build(args.flavor, device)
    weights = decode_weights(model, model.new_cache(1, args.max_len, device, torch.bfloat16))
    token = torch.zeros(1, dtype=torch.long, device=device)
    position = torch.zeros(1, dtype=torch.long, device=device)

    def at_position(step: FusedDecodeStep):
        def call():
            position.fill_(args.position)
            step()

        return call

    report = {}
    for spec in args.fused:
        tiling = fused_tiling(spec)
        per_sm = tiling.pop("programs_per_sm")
        programs = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
        row = {}
        for trace in (False, True):
            step = FusedDecodeStep(weights, token, position, programs=programs, trace=trace,
                                   **tiling)  # fmt: skip
            call = at_position(step)
            ms_per_call(call, 5)
            row["traced_ms" if trace else "ms"] = round(ms_per_call(call, 50), 4)
        call()  # the traced step once more: its stamps
        torch.cuda.synchronize()
        row |= summarize(step, step.stamps.cpu())
        if args.stamps is not None:  # for analyses the summary does not make
            save_tables(step, args.stamps / f"stamps_{spec}.pt")
        report[spec] = row
        print(
            f"fused {spec}: {row['ms']} ms a call ({row['traced_ms']} traced), the traced "
            f"step {row['step_us']} us on its own clocks, {programs} programs",
            flush=True,
        )
        print(f"  {'kind':10} {'tasks':>6} " + " ".join(f"{p[:14]:>15}" for p in MATRIX_PHASES)
              + "   strip GB/s a program  (phase: mean us a task / us a program)")  # fmt: skip
        for label, kind in row["kinds"].items():
            cells = " ".join(f"{v['mean_us']:>6.2f}/{v['per_program_us']:>7.1f}"
                             for v in kind.values() if isinstance(v, dict))  # fmt: skip
            print(f"  {label:10} {kind['tasks']:>6} {cells}  "
                  f"{kind.get('strip_GB_per_s_a_program', '')}")  # fmt: skip
        print("  timeline (stage periods):", row["timeline"], flush=True)
    write_report(args.json, [{"tiling": spec, **row} for spec, row in report.items()])


if __name__ == "__main__":
    main()
