"""Where a batch-1 decode step's GPU time goes: the compiled Generator's captured step replayed
alone and profiled kernel by kernel, beside the step's weight matmuls alone (the floor cuBLAS
sets), and end-to-end `generate` tokens/s; optionally the same compiled with inductor's
programmatic dependent launch (``--pdl``), with the prefill run eagerly (``--eager-prefill``), or
with the generator's Triton kernels (``--kernels``:
kernels/decode_attention.py instead of the masked matmul softmax, kernels/log_softmax.py for the
log-softmax and argmax), the kernels with inductor's matmul autotuning (``--autotune``), and
the one-launch fused step (``--fused``: kernels/fused_decode.py, ``Generator(step_kernel=
"triton")``) at each tiling given. Needs a CUDA GPU.

    python3 benchmarks/decode_step.py                    # Llama-3.2-1B shape, bf16
    python3 benchmarks/decode_step.py --kernels --pdl --json outputs/decode_step.json
    python3 benchmarks/decode_step.py --kernels --autotune
    python3 benchmarks/decode_step.py --fused 16384x8x1 16384x8x1x2x4  # tile weights x warps
        # x programs an SM [x waves: strips of row blocks [x pipeline depth of the strips' loop]]
    python3 benchmarks/decode_step.py --compile-only --fused 16384x8x1x1  # sm_90 build, no GPU
    python3 benchmarks/decode_step.py --fused-only --fused 8192x4x2x1x3 8192x4x2x1x3,splits=2 \
        8192x4x2x1x3,prefetch=2,block_l=32  # named settings after the fields

Prints one line per setting and writes JSON with each kernel of one step in launch order
(name, duration, gap since the previous kernel ended, microseconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from gpu_bench import ms_per_call
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.generate.fused_step import decode_weights
from torchloom.kernels.fused_decode import FusedDecodeStep
from torchloom.models import ModelConfig, build_model, resolve_model_config


def build(flavor: str, device: torch.device) -> tuple[torch.nn.Module, object]:
    config = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    model.init_weights(0)
    return model.to(torch.bfloat16).eval(), config


def matmuls_alone(config, device: torch.device) -> dict:
    """The decode step's weight matmuls for one row (q/k/v and gate/up stacked, as the compiled
    Generator runs them, and the head), each weight its own tensor, replayed from one graph."""
    D, F, V = config.dim, config.ffn_dim, config.vocab_size
    head_dim = D // config.num_heads
    qkv = (config.num_heads + 2 * config.num_kv_heads) * head_dim
    shapes = [(qkv, D), (D, D), (2 * F, D), (D, F)] * config.num_layers + [(V, D)]
    weights = [torch.randn(o, i, device=device, dtype=torch.bfloat16) for o, i in shapes]
    inputs = {i: torch.randn(1, i, device=device, dtype=torch.bfloat16) for i in (D, F)}

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms_per_call(graph.replay, 5)
    ms = ms_per_call(graph.replay, 100)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {
        "ms": round(ms, 4),
        "GB": round(nbytes / 1e9, 3),
        "TB_per_s": round(nbytes / ms / 1e9, 3),
    }


def timed_generate(generator: Generator, prompt: list[int], new: int) -> tuple[list, list]:
    """Three timed greedy runs: tokens/s of each, and the last run's tokens."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    tokens_per_s = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        completion = generator.generate([Request(prompt, params)])[0]
        torch.cuda.synchronize()
        tokens_per_s.append(round(new / (time.perf_counter() - start), 1))
    return tokens_per_s, completion.tokens


# Settings a tiling may name after its fields (",name=value"): the least value each takes, and
# whether it must be a power of two.
NAMED = {"prefetch": (0, False), "splits": (1, True), "block_l": (1, True)}


def fused_tiling(spec: str) -> dict:
    """FusedDecodeStep's tiling arguments from "TxWxP[xV[xS[xL[xC[xD[xR[xA[xT]]]]]]]]" and any
    ",name=value" after it (``NAMED``); ValueError if malformed."""
    fields_spec, *named = spec.split(",")
    parts = fields_spec.split("x")
    settings = dict(item.partition("=")[::2] for item in named)
    if (
        len(parts) not in range(3, 12)
        or not all(p.isdigit() and int(p) > 0 for p in parts[:5] + parts[9:10])
        or not all(p in ("0", "1") for p in parts[5:9] + parts[10:])
        or len(settings) != len(named)
        or not all(
            name in NAMED
            and value.isdigit()
            and int(value) >= NAMED[name][0]
            and not (NAMED[name][1] and int(value) & (int(value) - 1))
            for name, value in settings.items()
        )
    ):
        raise ValueError(f"--fused {spec!r}: "
                         "want TxWxP[xV[xS[xL[xC[xD[xR[xA[xT]]]]]]]][,name=value...], e.g. "
                         "16384x8x1 (tile "
                         "weights x warps x programs an SM) or 16384x8x1x2x4x0 (2 waves of strips, "
                         "pipelined 4 deep, the wait before the loop: L 1 puts it inside, the "
                         "default; C 1 also counts q/k/v's and gate/up's tasks in their stages' "
                         "counters, which no wait reads; D 1 deals the tasks round-robin, D 0 "
                         "takes them from a counter, absent: round-robin where the programs can "
                         "all be resident; R 1 (absent too): the down projection's chunk "
                         "partials summed by the stream's readers, R 0: by its last chunk; A: "
                         "the tasks a program in the q/k/v and o stages, absent: V there "
                         "too; T 1 (absent too): each head task combines its strip's (max, sum, "
                         "argmax) first, T 0: the last one combines every block's); names, each "
                         "once: prefetch=F (row blocks of its next task each task asks L2 for), "
                         "splits=N and block_l=N (each query head's splits of the cache and "
                         "their blocks of positions, powers of two)")  # fmt: skip
    switch = "1".__eq__
    fields = (("tile_elements", int), ("num_warps", int), ("programs_per_sm", int),
              ("waves", int), ("pipeline", int), ("wait_in_loop", switch),
              ("count_signalled_stages", switch),
              ("schedule", lambda p: "static" if p == "1" else "dynamic"),
              ("reader_sums", switch), ("small_waves", int), ("strip_tops", switch))  # fmt: skip
    # no V: one tile a task; every field after the given ones keeps FusedDecodeStep's default
    return ({"waves": None} | {name: read(p) for (name, read), p in zip(fields, parts)}
            | {name: int(value) for name, value in settings.items()})  # fmt: skip


def tiling_argument(spec: str) -> str:
    """``spec`` when it is a well-formed "TxWxP[...]" tiling (argparse's ``type`` for
    ``--fused``), else argparse's error naming the form."""
    try:
        fused_tiling(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return spec


def compile_fused(flavor: str, max_len: int, specs: list[str], sms: int = 132) -> dict:
    """Each tiling's kernel at ``flavor``'s shape in bf16 compiled for sm_90 on any machine
    (no GPU): tasks a step, registers a thread, bytes spilled, shared memory, and the
    asynchronous copies of the strips' pipelined loop."""
    from torchloom.kernels.triton_support import compile_for_hopper, compile_sm90

    config = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    with torch.device("meta"):
        model = build_model(config).to(torch.bfloat16)
    cache = model.new_cache(1, max_len, "meta", torch.bfloat16)
    position = torch.zeros(1, dtype=torch.long, device="meta")
    rows = {}
    for spec in specs:
        tiling = fused_tiling(spec)
        per_sm = tiling.pop("programs_per_sm")
        step = FusedDecodeStep(decode_weights(model, cache), position, position,
                               programs=per_sm * sms, **tiling)  # fmt: skip
        usage = compile_for_hopper(*step.sm90_arguments()).split()
        compiled = compile_sm90(*step.sm90_arguments())
        rows[spec] = {"tasks": len(step.tasks), "registers": usage[0], "spills": usage[-1],
                      "shared_kb": compiled.metadata.shared // 1024,
                      "async_copies": compiled.asm["ptx"].count("cp.async.cg.shared.global")}  # fmt: skip
        print(f"sm_90 {spec}", rows[spec], flush=True)
    return rows


def fused(model, prompt: list[int], new: int, configs: list[str], reference: list[int],
          without_waits: bool = False) -> dict:  # fmt: skip
    """The compiled generator with the fused step, re-captured at each tiling
    "TxWxP[xV[xS[xL[xC[xD[xR[xA[xT]]]]]]]][,name=value...]" (tile elements x warps x programs
    per SM [x waves: a matrix task streams a strip of row blocks, about V tasks a program a stage [x pipeline:
    the strip's loop pipelined S deep [x the wait in the loop [x signalled stages counted [x
    tasks dealt round-robin [x the down projection's partials summed by their readers [x the
    attention stages' waves [x head strips combined first]]]]]]]], then ``NAMED`` settings):
    generate tokens/s, the step replayed alone, tasks a step, and how
    many greedy tokens match the compiled forward's (bf16 roundings differ: a near-tie may
    flip one, and every token after it follows the new prefix). ``without_waits``: the step
    also replayed with every wait's count set to zero (wrong numbers, right traffic): what
    the waits between tasks cost."""
    torch._dynamo.reset()
    generator = Generator(model, max_batch=1, max_len=len(prompt) + new, compile=True,
                          step_kernel="triton")  # fmt: skip
    graphs = generator.graphs
    rows = {}
    for spec in configs:
        try:
            graphs._fused = FusedDecodeStep(
                decode_weights(model, generator.cache), graphs._tokens_B1[:1],
                graphs._positions_B1[:1], **fused_tiling(spec),
            )  # fmt: skip
            graphs._capture(generator.device)
            timed_generate(generator, prompt, new)  # warm-up (the prefill compiles once)
            tokens_per_s, tokens = timed_generate(generator, prompt, new)
            agree = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), new)
            replay = graphs._graphs[1].replay
            ms_per_call(replay, 10)
            rows[spec] = {"tokens_per_s": tokens_per_s, "replay_ms": round(ms_per_call(replay, 300), 4),
                          "tasks": len(graphs._fused.tasks),
                          "tokens_agreeing_before_the_first_difference": agree}  # fmt: skip
            if without_waits:  # the graph reads the table when replayed: no re-capture
                graphs._fused.waits[:, 1].zero_()
                ms_per_call(replay, 10)
                rows[spec]["replay_ms_without_waits"] = round(ms_per_call(replay, 300), 4)
        except Exception as exc:  # a tiling that does not compile or fit: say which
            rows[spec] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"fused {spec}", rows[spec], flush=True)
    return rows


def decode(
    model, config, prompt: list[int], new: int, steps: int, patch: dict, kernels: str,
    eager_prefill: bool = False,
) -> dict:  # fmt: skip
    torch._dynamo.reset()
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    start = time.perf_counter()
    with inductor_config.patch(patch):  # read while the step compiles (the first generate)
        # step_kernel "torch": this times the forward's step, not the fused one-launch step
        generator = Generator(model, max_batch=1, max_len=len(prompt) + new, compile=True,
                              decode_attention=kernels, score_kernel=kernels,
                              step_kernel="torch")  # fmt: skip
        if eager_prefill:  # as before the thirty-fourth session: only the step compiled
            generator._compiled_prefill = None
        generator.generate([Request(prompt, params)])
    compile_s = time.perf_counter() - start
    tokens_per_s = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generator.generate([Request(prompt, params)])
        torch.cuda.synchronize()
        tokens_per_s.append(round(new / (time.perf_counter() - start), 1))
    replay = generator.graphs._graphs[1].replay  # the bucket of one row
    ms_per_call(replay, 10)
    replay_ms = ms_per_call(replay, 300)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)  # fmt: skip
    per_step = len(kernels) // steps
    one = kernels[per_step * (steps // 2) : per_step * (steps // 2 + 1)]  # a step mid-run
    rows, previous_end = [], one[0].time_range.start
    for k in one:
        rows.append([k.name[:120], round(k.time_range.end - k.time_range.start, 2),
                     round(k.time_range.start - previous_end, 2)])  # fmt: skip
        previous_end = k.time_range.end
    return {"compile_s": round(compile_s, 1), "tokens_per_s": tokens_per_s,
            "replay_ms": round(replay_ms, 4), "kernels_per_step": per_step,
            "busy_us": round(sum(r[1] for r in rows), 1), "gaps_us": round(sum(r[2] for r in rows), 1),
            "kernels": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--pdl", action="store_true",
                        help="also compile with inductor's triton.enable_pdl")  # fmt: skip
    parser.add_argument("--eager-prefill", action="store_true",
                        help="also the generator with its prefill run eagerly (only the step "
                             "compiled, as before the compiled prefill)")  # fmt: skip
    parser.add_argument("--kernels", action="store_true",
                        help="also the step with the generator's Triton kernels "
                             "(decode_attention and score_kernel 'auto')")  # fmt: skip
    parser.add_argument("--autotune", action="store_true",
                        help="also the step with the kernels compiled under inductor's "
                             "max_autotune_gemm (Triton matmul templates timed against cuBLAS "
                             "for each one-row shape)")  # fmt: skip
    parser.add_argument("--fused", nargs="*", default=[], type=tiling_argument,
                        metavar="TxWxP[xV[xS[xL[xC[xD[xR[xA[xT]]]]]]]][,name=value...]",
                        help="also the fused one-launch step (step_kernel 'triton') at each "
                             "tiling: tile elements x warps x programs per SM [x waves: matrix "
                             "tasks stream strips of row blocks, about V a program a stage [x "
                             "pipeline: the strips' loop pipelined S deep [x 0: the wait for the "
                             "input before the strip loop, 1: inside it [x 1: also count the "
                             "signalled stages' tasks (the old form) [x 1: tasks dealt "
                             "round-robin (program p: p, p + P, ...), 0: from a counter "
                             "(absent: round-robin where every program can be resident) [x 1 "
                             "(absent too): the down projection's chunk partials summed by the "
                             "stream's readers, 0: by its last chunk [x A: the tasks a program "
                             "in the q/k/v and o stages [x 1: each head task combines its "
                             "strip's (max, sum, argmax) first]]]]]]]], then any of "
                             "',prefetch=F' (row blocks of its next task each task asks L2 "
                             "for), ',splits=N', ',block_l=N' (the attention's splits of the "
                             "cache and their blocks of positions)")  # fmt: skip
    parser.add_argument("--fused-only", action="store_true",
                        help="with --fused: skip the profiled compiled step (the fused rows keep "
                             "their own compiled-forward baseline)")  # fmt: skip
    parser.add_argument("--compile-only", action="store_true",
                        help="with --fused: compile each tiling for sm_90 at --flavor's shape "
                             "(no GPU needed) and print its tasks, registers, spills and shared "
                             "memory")  # fmt: skip
    parser.add_argument("--without-waits", action="store_true",
                        help="with --fused: also time each tiling's step with its waits "
                             "between tasks made free (wrong numbers, the same traffic): what "
                             "they cost")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("outputs/decode_step.json"))
    args = parser.parse_args()
    if (args.fused_only or args.compile_only or args.without_waits) and not args.fused:
        parser.error("--fused-only, --compile-only and --without-waits need --fused TxWxP[...] ...")
    if args.compile_only:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("decode_step.py --compile-only builds for sm_90: run it without "
                     "TRITON_INTERPRET=1")  # fmt: skip
        compile_fused(args.flavor, args.prompt_len + args.new_tokens, args.fused)
        return
    if not torch.cuda.is_available():
        sys.exit("decode_step.py replays captured CUDA graphs: it needs a CUDA GPU.")
    device = torch.device("cuda")
    model, config = build(args.flavor, device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=generator).tolist()
    report = {"matmuls_alone": matmuls_alone(config, device)}
    print("matmuls alone", report["matmuls_alone"], flush=True)
    settings = {} if args.fused_only else {"compiled": ({}, "torch", False)}
    if args.eager_prefill:
        settings["compiled_eager_prefill"] = ({}, "torch", True)
    if args.kernels:
        settings["compiled_kernels"] = ({}, "auto", False)
    if args.pdl:
        settings["compiled_pdl"] = ({"triton.enable_pdl": True}, "torch", False)
    if args.pdl and args.kernels:
        settings["compiled_kernels_pdl"] = ({"triton.enable_pdl": True}, "auto", False)
    if args.autotune:
        autotune = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
        settings["compiled_kernels_autotune"] = (autotune, "auto", False)
    for label, (patch, kernels, eager_prefill) in settings.items():
        report[label] = decode(
            model, config, prompt, args.new_tokens, args.profile_steps, patch, kernels,
            eager_prefill,
        )  # fmt: skip
        print(label, {k: v for k, v in report[label].items() if k != "kernels"}, flush=True)
    if args.fused:  # the compiled forward's tokens (and speed, as a same-call baseline)
        generator = Generator(model, max_batch=1, max_len=args.prompt_len + args.new_tokens,
                              compile=True, step_kernel="torch")  # fmt: skip
        timed_generate(generator, prompt, args.new_tokens)  # compiles
        tokens_per_s, reference = timed_generate(generator, prompt, args.new_tokens)
        replay = generator.graphs._graphs[1].replay
        ms_per_call(replay, 10)
        report["fused_baseline"] = {"tokens_per_s": tokens_per_s,
                                    "replay_ms": round(ms_per_call(replay, 300), 4)}  # fmt: skip
        print("compiled forward (fused rows' baseline)", report["fused_baseline"], flush=True)
        del generator
        report["fused"] = fused(model, prompt, args.new_tokens, args.fused, reference,
                                args.without_waits)  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device), "command": " ".join(sys.argv),
        "flavor": args.flavor, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        **report,
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
