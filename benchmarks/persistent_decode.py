"""Can one persistent Triton kernel stream a batch-1 decode step's weights faster than cuBLAS's
one matmul per launch? A probe for issue 35's batch-1 goal (1,200 tokens/s is 0.83 ms a token;
cuBLAS's one-row matmuls alone take 0.80 ms at 1B on the H200).

    python3 benchmarks/persistent_decode.py                    # Llama-3.2-1B shape, bf16, GPU
    python3 benchmarks/persistent_decode.py --configs 16x512x8x2 32x256x8x2 --json out.json
    TRITON_INTERPRET=1 python3 benchmarks/persistent_decode.py --check   # CPU: the chain's sums
    python3 benchmarks/persistent_decode.py --compile-only     # any machine: sm_90 registers

The chain is the step without its attention, RoPE and sampling, each matrix reading the
previous one's output (a real dependency): per layer q/k/v stacked of the RMS-normed residual
stream, o (reads q/k/v's first ``dim`` outputs, standing in for attention) added to the
stream, gate/up stacked of the normed stream, down (reads silu(gate) * up) added to the
stream; then the head of the normed stream. Norms, SwiGLU and residual adds ride the matmuls'
loads and stores. One launch runs all of it: programs take tasks (``BLOCK_N`` output rows
of one matrix) from a global counter in dependency order, and a task waits (spinning on the
previous matrix's count of finished tiles) only for what it reads. A program only ever waits
for tasks taken before its own, all held by running programs, so no schedule deadlocks, and
under Triton's interpreter (programs one after another) every wait is already met.

Two kernels: one that walks K in BLOCK_K chunks after its wait, and one (``p`` configs) that
loads its whole tile (BLOCK_N x dim, or the same bytes of the down projection) before it waits,
so the previous matrix's tail overlaps this tile's weight reads, as a hand-written megakernel's
prefetch would. Rows: the kernels at each ``--configs`` entry, and the same chain as PyTorch
ops (F.rms_norm, cuBLAS one-row matmuls, SwiGLU and the adds as their own kernels) replayed
from one CUDA graph. Not a model path:
what the numbers say decides whether a whole decode step (norms, attention, RoPE) is worth
folding into one kernel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_bench import ms_per_call

from torchloom.kernels.triton_support import compile_for_hopper, jit, tl, triton
from torchloom.models import ModelConfig, resolve_model_config

PLAIN, SWIGLU = 0, 1  # how a matrix reads its input: as is, or silu(first half) * second half
META = 9  # per matrix: weight, N, K, input, output, input mode, tiles, residual, norm weight
EPS = 1e-5


@jit
def _wait_for_input(meta_ptr, done_ptr, m):
    """Spin until every tile of matrix m - 1 (what matrix m reads) has been written."""
    if m > 0:
        need = tl.load(meta_ptr + (m - 1) * 9 + 6)
        finished = tl.atomic_add(done_ptr + m - 1, 0, sem="acquire", scope="gpu")
        while finished < need:
            finished = tl.atomic_add(done_ptr + m - 1, 0, sem="acquire", scope="gpu")


@jit
def _task(tasks_ptr, meta_ptr, task):
    """Task ``task``'s matrix and tile, and that matrix's row of the table (META)."""
    m = tl.load(tasks_ptr + 2 * task)
    tile = tl.load(tasks_ptr + 2 * task + 1)
    meta = meta_ptr + m * 9
    # Multiples of 16 (asserted on the host): the weights load 16 bytes a thread, not 2.
    w_off, N, K = tl.multiple_of(tl.load(meta), 16), tl.load(meta + 1), tl.multiple_of(tl.load(meta + 2), 16)  # fmt: skip
    x_off, y_off, mode = tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5)
    return m, tile, w_off, N, K, x_off, y_off, mode, tl.load(meta + 7), tl.load(meta + 8)


@jit
def _finish_tile(act_ptr, done_ptr, m, y, rows, N, y_off, resid_off):
    """Store the tile's outputs (plus the residual stream's rows, where the matrix adds to it)
    and publish them: every thread's stores, then one release of the tile count."""
    resid = tl.load(
        act_ptr + resid_off + rows, mask=(rows < N) & (rows * 0 + resid_off >= 0), other=0.0
    )
    tl.store(act_ptr + y_off + rows, y + resid, mask=rows < N)
    tl.debug_barrier()
    tl.atomic_add(done_ptr + m, 1, sem="release", scope="gpu")


@jit
def _chain_kernel(
    w_ptr, act_ptr, meta_ptr, tasks_ptr, counter_ptr, done_ptr, num_tasks,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    """Each program takes tasks (matrix m, tile j) from the counter until none is left; a task
    waits for matrix m - 1's tiles, computes its BLOCK_N outputs over all of K in BLOCK_K
    chunks (RMS-normed input where the matrix has a norm weight), and counts itself done."""
    task = tl.atomic_add(counter_ptr, 1)
    while task < num_tasks:
        m, tile, w_off, N, K, x_off, y_off, mode, resid_off, norm_off = _task(
            tasks_ptr, meta_ptr, task
        )
        _wait_for_input(meta_ptr, done_ptr, m)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)  # the norm's pass over the input
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(act_ptr + x_off + k0 + tl.arange(0, BLOCK_K), cache_modifier=".cg")
            squares += x * x
        scale = tl.where(norm_off >= 0, tl.rsqrt(tl.sum(squares, axis=0) / K + EPS), 1.0)
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_rows = w_ptr + w_off + rows.to(tl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (checked on the host)
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + cols[None, :], mask=(rows < N)[:, None], other=0.0)
            x = tl.load(act_ptr + x_off + cols, cache_modifier=".cg")
            if mode == 1:
                up = tl.load(act_ptr + x_off + K + cols, cache_modifier=".cg")
                x = x * tl.sigmoid(x) * up
            gain = tl.load(act_ptr + norm_off + cols, mask=cols * 0 + norm_off >= 0, other=1.0)
            acc += w.to(tl.float32) * (x * scale * gain)[None, :]
        _finish_tile(act_ptr, done_ptr, m, tl.sum(acc, axis=1), rows, N, y_off, resid_off)
        task = tl.atomic_add(counter_ptr, 1)


@jit
def _chain_prefetch_kernel(
    w_ptr, act_ptr, meta_ptr, tasks_ptr, counter_ptr, done_ptr, num_tasks,
    DIM: tl.constexpr, FFN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_FFN: tl.constexpr,
    EPS: tl.constexpr,
):  # fmt: skip
    """As _chain_kernel, but a task loads its whole weight tile (BLOCK_N x DIM, or
    BLOCK_N_FFN x FFN for the down projection) before it waits for its input: the weights
    depend on nothing, so the wait for the previous matrix overlaps this tile's reads."""
    task = tl.atomic_add(counter_ptr, 1)
    while task < num_tasks:
        m, tile, w_off, N, K, x_off, y_off, _, resid_off, norm_off = _task(
            tasks_ptr, meta_ptr, task
        )
        if K == DIM:  # q/k/v, o, gate/up, the head: the input RMS-normed where it has a norm
            rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = tl.arange(0, DIM)
            w = tl.load(w_ptr + w_off + rows.to(tl.int64)[:, None] * DIM + cols[None, :],
                        mask=(rows < N)[:, None], other=0.0)  # fmt: skip
            gain = tl.load(act_ptr + norm_off + cols, mask=cols * 0 + norm_off >= 0, other=1.0)
            _wait_for_input(meta_ptr, done_ptr, m)
            x = tl.load(act_ptr + x_off + cols, cache_modifier=".cg")
            scale = tl.where(norm_off >= 0, tl.rsqrt(tl.sum(x * x, axis=0) / DIM + EPS), 1.0)
            y = tl.sum(w.to(tl.float32) * (x * scale * gain)[None, :], axis=1)
            _finish_tile(act_ptr, done_ptr, m, y, rows, N, y_off, resid_off)
        else:  # the down projection: K = FFN, its input silu(gate) * up
            rows_f = tile * BLOCK_N_FFN + tl.arange(0, BLOCK_N_FFN)
            cols_f = tl.arange(0, FFN)
            w_f = tl.load(w_ptr + w_off + rows_f.to(tl.int64)[:, None] * FFN + cols_f[None, :],
                        mask=(rows_f < N)[:, None], other=0.0)  # fmt: skip
            _wait_for_input(meta_ptr, done_ptr, m)
            gate_f = tl.load(act_ptr + x_off + cols_f, cache_modifier=".cg")
            up_f = tl.load(act_ptr + x_off + FFN + cols_f, cache_modifier=".cg")
            y_f = tl.sum(w_f.to(tl.float32) * (gate_f * tl.sigmoid(gate_f) * up_f)[None, :], axis=1)
            _finish_tile(act_ptr, done_ptr, m, y_f, rows_f, N, y_off, resid_off)  # (its own shape)
        task = tl.atomic_add(counter_ptr, 1)


@dataclass
class Link:
    """One matrix of the chain: its shape, how it reads its input, where it writes, and the
    activation buffer's offsets of its residual stream and norm weight (-1: none)."""

    N: int
    K: int
    mode: int
    x_off: int
    y_off: int
    resid_off: int = -1
    norm_off: int = -1


@dataclass
class Chain:
    """The step's matrices in one weight buffer, wired through one fp32 activation buffer
    (norm weights first, then the input row, then every matrix's output)."""

    weights: torch.Tensor  # every weight, flattened one after another
    links: list[Link]
    offsets: list[int]
    activations: torch.Tensor  # the buffer with the norm weights and the input row written
    input_off: int
    dim: int
    ffn: int

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * self.weights.element_size()

    def weight(self, m: int) -> torch.Tensor:
        link = self.links[m]
        return self.weights[self.offsets[m] : self.offsets[m] + link.N * link.K].view(
            link.N, link.K
        )


def decode_chain(dim: int, qkv: int, ffn: int, layers: int, vocab: int, device, dtype) -> Chain:
    """Per layer: h -> q/k/v of norm(h); o of q/k/v's first ``dim`` outputs (standing in for
    attention), added to h; gate/up of norm(h); down of silu(gate) * up, added to h. Then the
    head of norm(h)."""
    norms = 2 * layers + 1
    input_off = norms * dim
    cursor, h, links = input_off + dim, input_off, []

    def link(n: int, k: int, x_off: int, mode: int = PLAIN, **extra) -> int:
        nonlocal cursor
        links.append(Link(n, k, mode, x_off, cursor, **extra))
        cursor += n
        return cursor - n

    for layer in range(layers):
        qkv_out = link(qkv, dim, h, norm_off=2 * layer * dim)
        h = link(dim, dim, qkv_out, resid_off=h)
        gate_up = link(2 * ffn, dim, h, norm_off=(2 * layer + 1) * dim)
        h = link(dim, ffn, gate_up, SWIGLU, resid_off=h)
    link(vocab, dim, h, norm_off=2 * layers * dim)
    sizes = [x.N * x.K for x in links]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    weights = torch.empty(sum(sizes), device=device, dtype=dtype)
    for x, offset in zip(links, offsets):  # unit-variance outputs for unit-variance inputs
        weights[offset : offset + x.N * x.K].normal_(0.0, x.K**-0.5)
    activations = torch.zeros(cursor, device=device, dtype=torch.float32)
    activations[:input_off] = 1.0 + 0.1 * torch.randn(input_off, device=device)
    return Chain(weights, links, offsets, activations, input_off, dim, ffn)


def chain_reference(chain: Chain, x0: torch.Tensor) -> torch.Tensor:
    """The chain in PyTorch ops (fp32 activations, as the kernels keep them)."""
    act = chain.activations.clone()
    act[chain.input_off : chain.input_off + x0.numel()] = x0
    for m, x in enumerate(chain.links):
        inputs = act[x.x_off : x.x_off + x.K]
        if x.mode == SWIGLU:
            inputs = F.silu(inputs) * act[x.x_off + x.K : x.x_off + 2 * x.K]
        if x.norm_off >= 0:
            rms = torch.rsqrt(inputs.square().mean() + EPS)
            inputs = inputs * rms * act[x.norm_off : x.norm_off + x.K]
        out = chain.weight(m).float() @ inputs
        if x.resid_off >= 0:
            out = out + act[x.resid_off : x.resid_off + x.N]
        act[x.y_off : x.y_off + x.N] = out
    return act


def chain_torch_step(chain: Chain, x0: torch.Tensor):
    """The chain as the model runs it, in bf16: F.rms_norm, one-row F.linear, the residual
    adds and SwiGLU as separate kernels."""
    dtype, dim, ffn = chain.weights.dtype, chain.dim, chain.ffn
    weights = [chain.weight(m) for m in range(len(chain.links))]
    gains = chain.activations[: chain.input_off].view(-1, dim).to(dtype)
    layers = (len(weights) - 1) // 4

    def step() -> torch.Tensor:
        h = x0[None].to(dtype)
        for layer in range(layers):
            w_qkv, w_o, w_gate_up, w_down = weights[4 * layer : 4 * layer + 4]
            qkv = F.linear(F.rms_norm(h, (dim,), gains[2 * layer], EPS), w_qkv)
            h = h + F.linear(qkv[:, :dim], w_o)
            gate_up = F.linear(F.rms_norm(h, (dim,), gains[2 * layer + 1], EPS), w_gate_up)
            h = h + F.linear(F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:], w_down)
        return F.linear(F.rms_norm(h, (dim,), gains[2 * layers], EPS), weights[-1])

    return step


class PersistentChain:
    """The kernel's launch for one configuration, its tables built once. ``prefetch``: the
    kernel that loads each whole tile before waiting (tiles of ``block_n`` rows where K is the
    model's dim, ``block_n * dim // ffn`` rows for the down projection: the same bytes)."""

    def __init__(
        self, chain: Chain, block_n: int, block_k: int, warps: int, programs: int,
        prefetch: bool = False,
    ):  # fmt: skip
        device = chain.weights.device
        self.dim, self.ffn = chain.dim, chain.ffn
        self.block_n_ffn = max(1, block_n * self.dim // self.ffn)
        if prefetch:
            heights = [block_n if self.dim == x.K else self.block_n_ffn for x in chain.links]
        elif any(x.K % block_k for x in chain.links):
            raise ValueError(f"every K must be a multiple of BLOCK_K {block_k}")
        else:
            heights = [block_n] * len(chain.links)
        tiles = [triton.cdiv(x.N, h) for x, h in zip(chain.links, heights)]
        meta = [[chain.offsets[m], x.N, x.K, x.x_off, x.y_off, x.mode, tiles[m], x.resid_off,
                 x.norm_off] for m, x in enumerate(chain.links)]  # fmt: skip
        assert len(meta[0]) == META
        assert all(row[0] % 16 == 0 and row[2] % 16 == 0 for row in meta), "offsets, K: x16"
        self.meta = torch.tensor(meta, dtype=torch.int64, device=device)
        tasks = [(m, j) for m, count in enumerate(tiles) for j in range(count)]
        self.tasks = torch.tensor(tasks, dtype=torch.int32, device=device)
        self.counters = torch.zeros(1 + len(chain.links), dtype=torch.int32, device=device)
        self.chain, self.block_n, self.block_k, self.warps = chain, block_n, block_k, warps
        self.programs, self.prefetch = programs, prefetch
        self.act = chain.activations.clone()

    def __call__(self, x0: torch.Tensor) -> torch.Tensor:
        self.counters.zero_()
        self.act[self.chain.input_off : self.chain.input_off + x0.numel()] = x0
        args = (self.chain.weights, self.act, self.meta, self.tasks, self.counters[:1],
                self.counters[1:], len(self.tasks))  # fmt: skip
        if self.prefetch:
            _chain_prefetch_kernel[(self.programs,)](
                *args, DIM=self.dim, FFN=self.ffn, BLOCK_N=self.block_n,
                BLOCK_N_FFN=self.block_n_ffn, EPS=EPS, num_warps=self.warps,
            )  # fmt: skip
        else:
            _chain_kernel[(self.programs,)](
                *args, BLOCK_N=self.block_n, BLOCK_K=self.block_k, EPS=EPS, num_warps=self.warps
            )
        return self.act


def check() -> None:
    """A tiny chain (2 layers, every kind of link) against the reference, in fp32: both
    kernels at several tilings and program counts, and the PyTorch row's ops."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    chain = decode_chain(dim=64, qkv=96, ffn=128, layers=2, vocab=200, device=device,
                         dtype=torch.float32)  # fmt: skip
    x0 = torch.randn(64, device=device)
    want = chain_reference(chain, x0)
    runs = [(16, 32, 3, False), (32, 64, 1, False), (8, 64, 5, False), (8, 0, 3, True),
            (4, 0, 2, True)]  # fmt: skip
    for block_n, block_k, programs, prefetch in runs:
        run = PersistentChain(chain, block_n, block_k, 4, programs, prefetch=prefetch)
        error = ((run(x0) - want).abs().max() / want.abs().max()).item()
        name = f"BLOCK_N {block_n} " + ("prefetch" if prefetch else f"BLOCK_K {block_k}")
        assert error < 1e-5, f"{name}: relative error {error:.2e}"
        print(f"{name} programs {programs}: max relative error {error:.1e}")
    head = chain.links[-1]  # the PyTorch row computes the same chain (in fp32 here)
    logits = chain_torch_step(chain, x0)()[0]
    want_logits = want[head.y_off : head.y_off + head.N]
    error = ((logits - want_logits).abs().max() / want_logits.abs().max()).item()
    assert error < 1e-5, f"the PyTorch row: relative error {error:.2e}"
    print(f"the PyTorch row: max relative error {error:.1e}")
    print("check passed")


def parse_config(spec: str) -> tuple[bool, int, int, int, int]:
    """(prefetch, BLOCK_N, BLOCK_K, num_warps, programs per multiprocessor) of a --configs
    entry: "NxKxWxP" for the chunked kernel, "pNxWxP" for the prefetching one."""
    prefetch = spec.startswith("p")
    values = [int(v) for v in spec.removeprefix("p").split("x")]
    if len(values) != (3 if prefetch else 4):
        raise SystemExit(f"--configs entry {spec!r}: want NxKxWxP or pNxWxP")
    return (prefetch, values[0], 0, *values[1:]) if prefetch else (prefetch, *values)


def compile_for_sm90(spec: str, dim: int, ffn: int) -> str:
    """Compile a config's kernel for an H100/H200 on any machine (what Triton's interpreter
    never checks: types across branches, register use); its resource line."""
    prefetch, block_n, block_k, warps, _ = parse_config(spec)
    arg_types = {"w_ptr": "*bf16", "act_ptr": "*fp32", "meta_ptr": "*i64", "tasks_ptr": "*i32",
                 "counter_ptr": "*i32", "done_ptr": "*i32", "num_tasks": "i32"}  # fmt: skip
    if prefetch:
        kernel = _chain_prefetch_kernel
        constants = {"DIM": dim, "FFN": ffn, "BLOCK_N": block_n,
                     "BLOCK_N_FFN": max(1, block_n * dim // ffn), "EPS": EPS}  # fmt: skip
    else:
        kernel, constants = _chain_kernel, {"BLOCK_N": block_n, "BLOCK_K": block_k, "EPS": EPS}
    return compile_for_hopper(kernel, arg_types, constants, warps)


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()  # the first replay, untimed
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--configs", nargs="+",
                        default=["16x512x4x2", "16x256x4x3", "8x512x4x4", "32x256x8x1",
                                 "p8x8x1", "p8x4x2", "p4x4x4", "p16x8x1", "p2x2x6", "p8x16x1"],
                        help="BLOCK_N x BLOCK_K x num_warps x programs per multiprocessor, or "
                             "pBLOCK_N x num_warps x programs per multiprocessor for the kernel "
                             "that loads each whole tile before it waits")  # fmt: skip
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--check", action="store_true",
                        help="only check a tiny chain against the reference (any device)")  # fmt: skip
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile each config's kernel for sm_90 (no GPU needed: "
                             "Triton's bundled ptxas) and print its registers a thread")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("outputs/persistent_decode.json"))
    args = parser.parse_args()
    if triton is None:
        sys.exit("persistent_decode.py runs a Triton kernel: pip install triton")
    if args.check:
        check()
        return
    config = resolve_model_config(ModelConfig(name="llama3", flavor=args.flavor))
    if args.compile_only:
        for spec in args.configs:
            print(f"{spec}: {compile_for_sm90(spec, config.dim, config.ffn_dim)}", flush=True)
        return
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("persistent_decode.py times a GPU kernel; without a CUDA GPU run --check.")
    D, head_dim = config.dim, config.dim // config.num_heads
    qkv = (config.num_heads + 2 * config.num_kv_heads) * head_dim
    device = torch.device("cuda")
    torch.manual_seed(0)
    chain = decode_chain(D, qkv, config.ffn_dim, config.num_layers, config.vocab_size, device,
                         torch.bfloat16)  # fmt: skip
    x0 = torch.randn(D, device=device)
    gb = chain.nbytes / 1e9
    want = chain_reference(chain, x0)
    rows = []

    def record(name: str, ms: float, error: float | None = None) -> None:
        rows.append({"row": name, "ms": round(ms, 4), "TB_per_s": round(gb / ms, 3),
                     "max_rel_error": None if error is None else float(f"{error:.2e}")})  # fmt: skip
        tail = "" if error is None else f"  (max rel. error vs fp32 reference {error:.1e})"
        print(f"{name:>28}: {ms:7.4f} ms  {gb / ms:5.2f} TB/s{tail}", flush=True)

    record(
        "torch ops, one CUDA graph", ms_per_call(graphed(chain_torch_step(chain, x0)), args.iters)
    )
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for spec in args.configs:
        prefetch, block_n, block_k, warps, per_sm = parse_config(spec)
        try:
            run = PersistentChain(chain, block_n, block_k, warps, per_sm * sms, prefetch)
            got = run(x0)
            torch.cuda.synchronize()
            error = ((got - want).abs().max() / want.abs().max()).item()
            replay = graphed(lambda run=run: run(x0))  # with its counters' reset, as one step
            record(f"persistent {spec}", ms_per_call(replay, args.iters), error)
        except Exception as exc:  # a configuration that does not compile or fit: say which
            print(f"persistent {spec}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            rows.append({"row": f"persistent {spec}", "error": f"{type(exc).__name__}: {exc}"})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "device_name": torch.cuda.get_device_name(device),
        "command": " ".join(sys.argv), "flavor": args.flavor, "weights_GB": round(gb, 3),
        "rows": rows,
    }, indent=1) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
