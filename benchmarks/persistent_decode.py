"""Can one persistent Triton kernel stream a batch-1 decode step's weights faster than cuBLAS's
one matmul per launch? A probe for issue 35's batch-1 goal (1,200 tokens/s is 0.83 ms a token;
cuBLAS's one-row matmuls alone take 0.80 ms at 1B on the H200).

    python3 benchmarks/persistent_decode.py                    # Llama-3.2-1B shape, bf16, GPU
    python3 benchmarks/persistent_decode.py --configs 16x512x8x2 32x256x8x2 --json out.json
    TRITON_INTERPRET=1 python3 benchmarks/persistent_decode.py --check   # CPU: the chain's sums

The chain is the step's weight matmuls in order, each reading the previous one's output (a
real dependency): per layer q/k/v stacked, o (reads q/k/v's first ``dim`` outputs, standing in
for attention), gate/up stacked, down (reads silu(gate) * up, the SwiGLU folded into its
loads); then the head. One launch runs all of it: programs take tasks (``BLOCK_N`` output rows
of one matrix) from a global counter in dependency order, and a task waits (spinning on the
previous matrix's count of finished tiles) only for what it reads. A program only ever waits
for tasks taken before its own, all held by running programs, so no schedule deadlocks, and
under Triton's interpreter (programs one after another) every wait is already met.

Two kernels: one that walks K in BLOCK_K chunks after its wait, and one (``p`` configs) that
loads its whole tile (BLOCK_N x dim, or the same bytes of the down projection) before it waits,
so the previous matrix's tail overlaps this tile's weight reads, as a hand-written megakernel's
prefetch would. Rows: the kernels at each ``--configs`` entry, and the same chain as PyTorch
ops (cuBLAS one-row matmuls, SwiGLU between) replayed from one CUDA graph. Not a model path:
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

from torchloom.kernels.triton_support import jit, tl, triton
from torchloom.models import ModelConfig, resolve_model_config

PLAIN, SWIGLU = 0, 1  # how a matrix reads its input: as is, or silu(first half) * second half
META = 7  # per matrix: weight offset, N, K, input offset, output offset, input mode, its tiles


@jit
def _wait_for_input(meta_ptr, done_ptr, m):
    """Spin until every tile of matrix m - 1 (what matrix m reads) has been written."""
    if m > 0:
        need = tl.load(meta_ptr + (m - 1) * 7 + 6)
        finished = tl.atomic_add(done_ptr + m - 1, 0, sem="acquire", scope="gpu")
        while finished < need:
            finished = tl.atomic_add(done_ptr + m - 1, 0, sem="acquire", scope="gpu")


@jit
def _chain_kernel(
    w_ptr, act_ptr, meta_ptr, tasks_ptr, counter_ptr, done_ptr, num_tasks,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Each program takes tasks (matrix m, tile j) from the counter until none is left; a task
    waits for matrix m - 1's tiles, computes its BLOCK_N outputs over all of K, and counts
    itself done for matrix m."""
    task = tl.atomic_add(counter_ptr, 1)
    while task < num_tasks:
        m = tl.load(tasks_ptr + 2 * task)
        tile = tl.load(tasks_ptr + 2 * task + 1)
        meta = meta_ptr + m * 7
        w_off, N, K = tl.load(meta), tl.load(meta + 1), tl.load(meta + 2)
        x_off, y_off, mode = tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 5)
        _wait_for_input(meta_ptr, done_ptr, m)
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_rows = w_ptr + w_off + rows.to(tl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (checked on the host)
            cols = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0)
            x = tl.load(act_ptr + x_off + cols, cache_modifier=".cg")
            if mode == 1:
                up = tl.load(act_ptr + x_off + K + cols, cache_modifier=".cg")
                x = x * tl.sigmoid(x) * up
            acc += w.to(tl.float32) * x[None, :]
        tl.store(act_ptr + y_off + rows, tl.sum(acc, axis=1), mask=row_ok)
        tl.debug_barrier()  # every thread's stores before the one release that publishes them
        tl.atomic_add(done_ptr + m, 1, sem="release", scope="gpu")
        task = tl.atomic_add(counter_ptr, 1)


@jit
def _chain_prefetch_kernel(
    w_ptr, act_ptr, meta_ptr, tasks_ptr, counter_ptr, done_ptr, num_tasks,
    DIM: tl.constexpr, FFN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_FFN: tl.constexpr,
):  # fmt: skip
    """As _chain_kernel, but a task loads its whole weight tile (BLOCK_N x DIM, or
    BLOCK_N_FFN x FFN for the down projection) before it waits for its input: the weights
    depend on nothing, so the wait for the previous matrix overlaps this tile's reads."""
    task = tl.atomic_add(counter_ptr, 1)
    while task < num_tasks:
        m = tl.load(tasks_ptr + 2 * task)
        tile = tl.load(tasks_ptr + 2 * task + 1)
        meta = meta_ptr + m * 7
        w_off, N, K = tl.load(meta), tl.load(meta + 1), tl.load(meta + 2)
        x_off, y_off = tl.load(meta + 3), tl.load(meta + 4)
        if K == DIM:
            rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            cols = tl.arange(0, DIM)
            w = tl.load(w_ptr + w_off + rows.to(tl.int64)[:, None] * DIM + cols[None, :],
                        mask=(rows < N)[:, None], other=0.0)  # fmt: skip
            _wait_for_input(meta_ptr, done_ptr, m)
            x = tl.load(act_ptr + x_off + cols, cache_modifier=".cg")
            tl.store(act_ptr + y_off + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1),
                     mask=rows < N)  # fmt: skip
        else:  # the down projection: K = FFN, its input silu(gate) * up
            rows = tile * BLOCK_N_FFN + tl.arange(0, BLOCK_N_FFN)
            cols = tl.arange(0, FFN)
            w = tl.load(w_ptr + w_off + rows.to(tl.int64)[:, None] * FFN + cols[None, :],
                        mask=(rows < N)[:, None], other=0.0)  # fmt: skip
            _wait_for_input(meta_ptr, done_ptr, m)
            gate = tl.load(act_ptr + x_off + cols, cache_modifier=".cg")
            up = tl.load(act_ptr + x_off + FFN + cols, cache_modifier=".cg")
            x = gate * tl.sigmoid(gate) * up
            tl.store(act_ptr + y_off + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1),
                     mask=rows < N)  # fmt: skip
        tl.debug_barrier()
        tl.atomic_add(done_ptr + m, 1, sem="release", scope="gpu")
        task = tl.atomic_add(counter_ptr, 1)


@dataclass
class Chain:
    """The step's matrices in one weight buffer, their wiring through one fp32 activation
    buffer, and the task list for a tile height."""

    weights: torch.Tensor  # every weight, flattened one after another
    shapes: list[tuple[int, int, int]]  # (N, K, input mode) per matrix
    offsets: list[int]
    io: list[tuple[int, int]]  # (input offset, output offset) in the activation buffer
    activations: int  # the activation buffer's length

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * self.weights.element_size()

    def weight(self, m: int) -> torch.Tensor:
        N, K, _ = self.shapes[m]
        return self.weights[self.offsets[m] : self.offsets[m] + N * K].view(N, K)


def decode_chain(dim: int, qkv: int, ffn: int, layers: int, vocab: int, device, dtype) -> Chain:
    shapes, io, cursor = [], [], dim  # the activation buffer starts with the input row [dim]
    x = 0
    for _ in range(layers):
        # q/k/v; o reads q/k/v's first `dim` outputs; gate/up; down reads silu(gate) * up
        for n, k, mode in ((qkv, dim, PLAIN), (dim, dim, PLAIN), (2 * ffn, dim, PLAIN),
                           (dim, ffn, SWIGLU)):  # fmt: skip
            shapes.append((n, k, mode))
            io.append((x, cursor))
            x, cursor = cursor, cursor + n
    shapes.append((vocab, dim, PLAIN))
    io.append((x, cursor))
    cursor += vocab
    sizes = [n * k for n, k, _ in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    weights = torch.empty(sum(sizes), device=device, dtype=dtype)
    for (n, k, _), offset in zip(shapes, offsets):  # unit-variance outputs for unit-variance inputs
        view = weights[offset : offset + n * k]
        view.normal_(0.0, k**-0.5)
    return Chain(weights, shapes, offsets, io, cursor)


def chain_reference(chain: Chain, x0: torch.Tensor) -> torch.Tensor:
    """The chain in PyTorch ops (fp32 activations, as the kernel keeps them)."""
    act = torch.zeros(chain.activations, device=x0.device, dtype=torch.float32)
    act[: x0.numel()] = x0
    for m, (n, k, mode) in enumerate(chain.shapes):
        x_off, y_off = chain.io[m]
        x = act[x_off : x_off + k]
        if mode == SWIGLU:
            x = F.silu(x) * act[x_off + k : x_off + 2 * k]
        act[y_off : y_off + n] = chain.weight(m).float() @ x
    return act


def chain_torch_step(chain: Chain, x0: torch.Tensor):
    """The chain as the model runs it: bf16 one-row F.linear per matrix, SwiGLU between."""
    weights = [chain.weight(m) for m in range(len(chain.shapes))]

    def step() -> torch.Tensor:
        x = x0[None].to(chain.weights.dtype)
        for m, (_, k, mode) in enumerate(chain.shapes):
            if mode == SWIGLU:
                x = F.silu(x[:, :k]) * x[:, k:]
            y = F.linear(x, weights[m])
            x = y if m % 4 != 0 or m == len(chain.shapes) - 1 else y[:, : x0.numel()]
        return y

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
        self.dim, self.ffn = chain.shapes[0][1], chain.shapes[3][1]
        self.block_n_ffn = max(1, block_n * self.dim // self.ffn)
        if prefetch:
            heights = [block_n if k == self.dim else self.block_n_ffn for _, k, _ in chain.shapes]
        elif any(k % block_k for _, k, _ in chain.shapes):
            raise ValueError(f"every K must be a multiple of BLOCK_K {block_k}")
        else:
            heights = [block_n] * len(chain.shapes)
        tiles = [triton.cdiv(n, h) for (n, _, _), h in zip(chain.shapes, heights)]
        meta = [[chain.offsets[m], n, k, *chain.io[m], mode, tiles[m]]
                for m, (n, k, mode) in enumerate(chain.shapes)]  # fmt: skip
        self.meta = torch.tensor(meta, dtype=torch.int64, device=device)
        tasks = [(m, j) for m, count in enumerate(tiles) for j in range(count)]
        self.tasks = torch.tensor(tasks, dtype=torch.int32, device=device)
        self.counters = torch.zeros(1 + len(chain.shapes), dtype=torch.int32, device=device)
        self.chain, self.block_n, self.block_k, self.warps = chain, block_n, block_k, warps
        self.programs, self.prefetch = programs, prefetch
        self.act = torch.zeros(chain.activations, device=device, dtype=torch.float32)

    def __call__(self, x0: torch.Tensor) -> torch.Tensor:
        self.counters.zero_()
        self.act[: x0.numel()] = x0
        args = (self.chain.weights, self.act, self.meta, self.tasks, self.counters[:1],
                self.counters[1:], len(self.tasks))  # fmt: skip
        if self.prefetch:
            _chain_prefetch_kernel[(self.programs,)](
                *args, DIM=self.dim, FFN=self.ffn, BLOCK_N=self.block_n,
                BLOCK_N_FFN=self.block_n_ffn, num_warps=self.warps,
            )  # fmt: skip
        else:
            _chain_kernel[(self.programs,)](
                *args, BLOCK_N=self.block_n, BLOCK_K=self.block_k, num_warps=self.warps
            )
        return self.act


def check() -> None:
    """A tiny chain (2 layers, every kind of link) against the reference, in fp32."""
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
    print("check passed")


def time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--configs", nargs="+",
                        default=["16x512x4x2", "16x256x4x4", "32x256x8x2", "8x1024x4x2",
                                 "p8x8x2", "p16x8x1", "p4x4x4", "p8x4x3"],
                        help="BLOCK_N x BLOCK_K x num_warps x programs per multiprocessor, or "
                             "pBLOCK_N x num_warps x programs per multiprocessor for the kernel "
                             "that loads each whole tile before it waits")  # fmt: skip
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--check", action="store_true",
                        help="only check a tiny chain against the reference (any device)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("outputs/persistent_decode.json"))
    args = parser.parse_args()
    if triton is None:
        sys.exit("persistent_decode.py runs a Triton kernel: pip install triton")
    if args.check:
        check()
        return
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("persistent_decode.py times a GPU kernel; without a CUDA GPU run --check.")
    config = resolve_model_config(ModelConfig(name="llama3", flavor=args.flavor))
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

    record("torch ops, one CUDA graph", time_ms(graphed(chain_torch_step(chain, x0)), args.iters))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for spec in args.configs:
        prefetch = spec.startswith("p")
        values = [int(v) for v in spec.removeprefix("p").split("x")]
        block_n, block_k, warps, per_sm = [values[0], 0, *values[1:]] if prefetch else values
        try:
            run = PersistentChain(chain, block_n, block_k, warps, per_sm * sms, prefetch)
            got = run(x0)
            torch.cuda.synchronize()
            error = ((got - want).abs().max() / want.abs().max()).item()
            replay = graphed(lambda run=run: run(x0))  # with its counters' reset, as one step
            record(f"persistent {spec}", time_ms(replay, args.iters), error)
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
