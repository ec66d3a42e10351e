"""Generation speed side by side: torchloom's Generator (CUDA-graph decode with the PyTorch
kernels, with the Triton norm/RoPE/SwiGLU kernels, compiled; eager; batch-invariant) and
Hugging Face `generate` (eager, and static cache + compiled decode) on the same model shape and
prompts; plus a training step in normal vs batch-invariant mode. One table, JSON to --json.

    python benchmarks/generate.py                                    # 1B-shaped, bf16, one GPU
    python benchmarks/generate.py --shape tiny --device cpu --batches 1 4 --new-tokens 16 \\
        --prompt-len 16 --rows ours ours-bi hf-eager --bi-max-batch 4
    torchrun --nproc-per-node 2 benchmarks/generate.py --tp 2 --rows ours ours-fused   # 2 GPUs

Output tokens/s = batch x new tokens / wall time of one `generate` call (greedy, every request
runs to --new-tokens: no stop tokens, HF with min_new_tokens), after one warm-up call of the same
shape (compilation and CUDA-graph capture happen there; our Generator is kept for the timed
call, as a server keeps its engine). --profile-steps adds each row's GPU kernel breakdown.
Weights are random (speed does not depend on them); torchloom
and HF get the same architecture through torchloom's HF adapter. A compiled row stacks its
model's q/k/v and gate/up weights (docs/generate.md), and every later row on that model decodes
with them stacked: list the compiled rows last to time the default decode as it ships.

ours-tuned is ours-compiled with inductor's coordinate-descent tuning on while it compiles
(gpt-fast's setting): on a GPU inductor then turns a matmul of one row (batch 1's decode) into
a Triton reduction tuned for memory bandwidth, fused with its neighbours, instead of a cuBLAS
call; larger batches keep their matmuls. A candidate for the batch-1 decode (issue 35), not
yet what the Generator ships.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import transformers
from torch.profiler import ProfilerActivity, profile

from torchloom.generate.engine import STEP_IMPLS, Generator, Request, SamplingParams
from torchloom.generate.run import tensor_parallel
from torchloom.models import ModelConfig, build_model, get_model_spec, resolve_model_config
from torchloom.parallel.mesh import destroy, init_distributed
from torchloom.train.loss import CrossEntropy
from torchloom.train.profiling import format_kernel_summary, kernel_summary

SHAPES = {"tiny": "debug", "1B": "1B", "8B": "8B"}
ROWS = ("ours", "ours-fused", "ours-compiled", "ours-fused-compiled", "ours-tuned", "ours-eager",
        "ours-bi", "hf-eager", "hf-compiled")  # fmt: skip
TRITON = {"norm_impl": "triton", "rope_impl": "triton", "mlp_impl": "triton"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(flavor: str, device: torch.device, dtype: torch.dtype, **slots):
    config = resolve_model_config(ModelConfig(name="llama3", flavor=flavor, **slots))
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    model.init_weights(0)
    return model.to(dtype).eval(), config


_GENERATORS: dict[tuple, Generator] = {}


def ours(model, prompts: list[list[int]], new_tokens: int, max_len: int, **options) -> float:
    """Seconds of one generate call; the Generator (its CUDA graphs captured, its step compiled)
    is made by the first call of a shape and reused, as a server would keep it."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    key = (id(model), len(prompts), max_len, tuple(sorted(options.items())))
    if key not in _GENERATORS:
        _GENERATORS.clear()  # one at a time: each holds a KV cache and graph memory
        _GENERATORS[key] = Generator(model, max_batch=len(prompts), max_len=max_len, **options)
    generator = _GENERATORS[key]
    _sync(next(model.parameters()).device)
    start = time.perf_counter()
    completions = generator.generate([Request(p, params) for p in prompts])
    _sync(next(model.parameters()).device)
    assert all(len(c.tokens) == new_tokens for c in completions)
    return time.perf_counter() - start


def hf_model(config, device: torch.device, dtype: torch.dtype, compiled: bool):
    hf_config = transformers.LlamaConfig(
        **get_model_spec("llama3").hf_adapter.config_to_hf(config), attn_implementation="sdpa"
    )
    model = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=dtype).eval()
    if compiled:
        # With a static cache, transformers' generate compiles the decoding forward itself
        # (generation_config.compile_config: fullgraph, reduce-overhead). Wrapping forward in
        # torch.compile as well made its CUDA graphs overwrite outputs still in use (H200,
        # transformers 5.17 + torch 2.11).
        model.generation_config.cache_implementation = "static"
    return model


def hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    input_ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    _sync(input_ids.device)
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start


def kernel_profile(run, prompts: list[list[int]], steps: int) -> dict:
    """GPU kernel time of one ``run`` of ``steps`` new tokens (torch.profiler over CUPTI, CUDA
    graph replays included); see torchloom.train.profiling.kernel_summary."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = run(prompts, steps)
    return kernel_summary(prof, steps, wall)


def train_step_seconds(
    model,
    config,
    device: torch.device,
    seq: int,
    batch: int = 1,
    steps: int = 3,
    profile_kernels: bool = False,
) -> tuple[float, dict | None]:
    """Median forward + backward + AdamW step on ``batch`` sequences of ``seq`` tokens; with
    ``profile_kernels``, the kernel summary of one more step."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)

    def step() -> float:
        start = time.perf_counter()
        targets = {"labels": tokens[:, 1:]}
        model(tokens[:, :-1], objective=CrossEntropy(), targets=targets).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - start

    times = sorted([step() for _ in range(steps + 1)][1:])  # the first is a warm-up
    summary = None
    if profile_kernels:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = step()
        summary = kernel_summary(prof, 1, wall)
    model.eval()
    return times[len(times) // 2], summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1B", choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--bi-max-batch", type=int, default=64,
                        help="largest batch for the batch-invariant row (its CPU reference "
                             "kernels are slow: use a small value there)")  # fmt: skip
    parser.add_argument("--train-seq", type=int, default=256,
                        help="tokens of the normal vs batch-invariant training step (0: skip)")  # fmt: skip
    parser.add_argument("--train-batch", type=int, default=1,
                        help="sequences of the normal vs batch-invariant training step")  # fmt: skip
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="after timing, profile a run of this many new tokens per row and "
                             "batch: kernel time per step and the GPU's busy share (GPU only)")  # fmt: skip
    parser.add_argument("--decode-attention", default="torch", choices=("auto", "torch", "triton"),
                        help="how our rows attend one-token steps (Generator's decode_attention: "
                             "auto: the Triton kernel on CUDA)")  # fmt: skip
    parser.add_argument("--score-kernel", default="torch", choices=("auto", "torch", "triton"),
                        help="how our rows take each forward's log-softmax and argmax "
                             "(Generator's score_kernel; auto: the Triton kernels on CUDA)")  # fmt: skip
    parser.add_argument("--step-kernel", default="auto", choices=STEP_IMPLS,
                        help="how our rows run a decode step of one sequence (Generator's "
                             "step_kernel; triton: the fused one-launch step, "
                             "kernels/fused_decode.py; auto, the default: it where it runs "
                             "on CUDA)")  # fmt: skip
    parser.add_argument("--max-len", type=int, default=0,
                        help="our rows' cache length (0: prompt + new tokens); a longer cache "
                             "shows what reading every cached index costs")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=Path("outputs/generate_bench.json"))
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor parallelism over the processes of a torchrun job (ours, "
                             "ours-eager and ours-fused rows; rank 0 reports)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    rank0 = True
    if args.tp > 1:
        device = init_distributed(device.type)
        rank0 = torch.distributed.get_rank() == 0
        args.rows = [r for r in args.rows if r in ("ours", "ours-eager", "ours-fused")]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flavor = SHAPES[args.shape]
    model, config = build(flavor, device, dtype)
    models = {"ours": model}
    for row, slots in (("ours-bi", {"batch_invariant": True}), ("ours-fused", TRITON)):
        if row in args.rows or row + "-compiled" in args.rows:  # same weights, other kernels
            models[row], _ = build(flavor, device, dtype, **slots)
            models[row].load_state_dict(model.state_dict())
    if args.tp > 1:
        for m in models.values():
            tensor_parallel(m, get_model_spec("llama3"), args.tp, device)
    gen = torch.Generator().manual_seed(0)
    results = []
    for row in args.rows:
        for batch in args.batches:
            prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=gen)
            prompts = prompts.tolist()
            record = {"row": row, "batch": batch}
            try:
                if row == "ours-bi" and batch > args.bi_max_batch:
                    raise RuntimeError(f"skipped: batch > --bi-max-batch {args.bi_max_batch}")
                if row.startswith("hf"):
                    target = hf_model(config, device, dtype, compiled=row == "hf-compiled")
                    run = lambda p, n, m=target: hf(m, p, n)  # noqa: E731
                else:
                    options = {"cuda_graphs": False} if row == "ours-eager" else {}
                    if row.endswith("-compiled") or row == "ours-tuned":
                        options = {"compile": True}
                    options["decode_attention"] = args.decode_attention
                    if row != "ours-bi":  # batch-invariant scoring stays PyTorch's (refused)
                        options["score_kernel"] = args.score_kernel
                        options["step_kernel"] = args.step_kernel
                    m = models.get(row.removesuffix("-compiled"), model)
                    length = args.max_len or args.prompt_len + args.new_tokens
                    run = lambda p, n, m=m, o=options, L=length: ours(m, p, n, L, **o)  # noqa: E731
                tuning = contextlib.nullcontext()
                if row == "ours-tuned":  # read while compiling: in force for the warm-up call
                    tuning = inductor_config.patch(coordinate_descent_tuning=True)
                with tuning:
                    run(prompts, args.new_tokens)  # warm-up (compiles)
                seconds = run(prompts, args.new_tokens)
                record["tokens_per_s"] = round(batch * args.new_tokens / seconds, 1)
                if args.profile_steps and device.type == "cuda" and rank0:
                    record["profile"] = kernel_profile(run, prompts, args.profile_steps)
                    print(format_kernel_summary(f"{row} batch {batch}", record["profile"]))
            except Exception as err:  # OOM or a skipped row: recorded, the run goes on
                record["error"] = f"{type(err).__name__}: {err}"[:200]
            _GENERATORS.clear()
            results.append(record)
            shown = record.get("tokens_per_s", record.get("error"))
            if rank0:
                print(f"{row:<12} batch {batch:>3}: {shown}", flush=True)
    if not rank0:
        destroy()
        return
    train, train_profiles = {}, {}
    for name, m in models.items():
        if args.tp > 1 or args.train_seq == 0:
            continue
        profiled = bool(args.profile_steps) and device.type == "cuda"
        train[name], train_profiles[name] = train_step_seconds(
            m, config, device, args.train_seq, args.train_batch, profile_kernels=profiled
        )
        print(
            f"train step ({name}, {args.train_batch} x {args.train_seq} tokens): "
            f"{train[name]:.3f} s"
        )
        if profiled:
            print(format_kernel_summary(f"train step {name}", train_profiles[name]))
    print(f"\n{'row':<12} " + " ".join(f"{'batch ' + str(b):>12}" for b in args.batches))
    for row in args.rows:
        cells = []
        for b in args.batches:
            r = next(x for x in results if x["row"] == row and x["batch"] == b)
            cells.append(f"{r['tokens_per_s']:>12,.0f}" if "tokens_per_s" in r else f"{'n/a':>12}")
        print(f"{row:<12} " + " ".join(cells) + "   output tokens/s")
    for baseline in ("ours", "ours-fused"):
        if "ours-bi" in train and baseline in train:
            print(
                f"batch-invariant train step / {baseline}: "
                f"{train['ours-bi'] / train[baseline]:.2f}x"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "command": " ".join(sys.argv), "shape": args.shape, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "tp": args.tp, "train_batch": args.train_batch,
        "train_seq": args.train_seq, "decode_attention": args.decode_attention,
        "score_kernel": args.score_kernel, "step_kernel": args.step_kernel,
        "max_len": args.max_len or args.prompt_len + args.new_tokens,
        "rows": results, "train_step_s": train,
        "train_step_profiles": train_profiles,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")
    destroy()


if __name__ == "__main__":
    main()
