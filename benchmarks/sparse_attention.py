"""DeepSeek-V4's sparse attention side by side: forward, and forward + backward, of one CSA
layer's attention at DeepSeek-V4-Flash's shape.

    python benchmarks/sparse_attention.py --json outputs/sparse_attention.json   # H200: ~1 min
    python benchmarks/sparse_attention.py --small                                # CPU, seconds

Shape (GPU default): B = 1, T = 32768 queries, 64 heads of 512 sharing one key = value, a
window of 128 tokens plus 512 of the S = T / 4 compressed groups, picked at random among each
query's completed ones (K = 640 rows per query), a sink per head, bf16. Rows:

- ``dense``: the model's dense reference math (masked softmax over all T + S keys and the
  sink) chunked over --chunk queries, since [H, T, T + S] logits cannot exist at once; its
  backward recomputes each chunk (torch.utils.checkpoint).
- ``flex``: FlexAttention (compiled) with a mask_mod (window | picked groups, read from a
  [T, S] bool table) over the T + S keys and one extra zero key whose score_mod is the sink;
  its block mask is built once, outside the timed calls. If flex refuses head_dim 512 (or
  anything else), the row records why.
- ``gather``: the PyTorch reference of kernels/sparse_attention.py (gathers each chunk of
  queries' K rows).
- ``triton``: the Triton kernels of kernels/sparse_attention.py.

Each row: median ms (CUDA events after warm-up), the max |diff| of its output against the
gather reference's, forward TFLOP/s counting the sparse work only (4 H T K d: a dense row's
extra work is its waste), and triton's speedup over the row (``triton_speedup_*``). A row that fails
(out of memory, a compile error) records the error in the JSON instead of ending the run.
``--small`` (automatic without CUDA) runs a tiny fp32 shape on the CPU, gather and dense rows
only (Triton's interpreter is not a timing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_bench import median_seconds
from torch.utils.checkpoint import checkpoint

from torchloom.kernels.sparse_attention import (
    attention_flops,
    dense_attention,
    gather_attention,
    sparse_attention,
)

ROWS = ("gather", "triton", "dense", "flex")  # flex last: the likeliest to fail
Attend = Callable[..., torch.Tensor]


def make_inputs(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """q [1, H, T, d], kv [1, T + S, d], indices [1, T, window + topk] (window tokens, then
    ``topk`` random completed groups, -1 padded), sinks [H], and the picks as a [T, S] table."""
    T, H, d, S = args.seq, args.heads, args.head_dim, args.seq // args.ratio
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(1, H, T, d, device=device, generator=gen).to(dtype)
    kv = torch.randn(1, T + S, d, device=device, generator=gen).to(dtype)
    sinks = torch.randn(H, device=device, generator=gen)
    t_T1 = torch.arange(T, device=device)[:, None]
    window_TW = t_T1 - args.window + 1 + torch.arange(args.window, device=device)
    window_TW = torch.where(window_TW >= 0, window_TW, -1)
    completed_TS = torch.arange(S, device=device) < (t_T1 + 1) // args.ratio
    scores_TS = torch.rand(T, S, device=device, generator=gen).masked_fill(~completed_TS, -1)
    picks_Tk = scores_TS.topk(min(args.topk, S), dim=-1).indices
    picks_Tk = torch.where(completed_TS.gather(-1, picks_Tk), picks_Tk, -1)
    picked_TS = torch.zeros(T, S + 1, dtype=torch.bool, device=device)
    picked_TS.scatter_(-1, torch.where(picks_Tk < 0, S, picks_Tk), True)
    indices = torch.cat([window_TW, torch.where(picks_Tk < 0, -1, T + picks_Tk)], dim=-1)
    return {"q": q, "kv": kv, "indices": indices[None].to(torch.int32).contiguous(),
            "sinks": sinks, "picked_TS": picked_TS[:, :S].contiguous()}  # fmt: skip


def dense_chunked(chunk: int) -> Attend:
    """The dense masked form, ``chunk`` queries at a time, each chunk recomputed in backward."""

    def attend(q, kv, indices, sinks, scale):
        outs = []
        for start in range(0, q.shape[2], chunk):
            part = (q[:, :, start : start + chunk], kv, indices[:, start : start + chunk], sinks)
            if torch.is_grad_enabled():
                outs.append(checkpoint(dense_attention, *part, scale, use_reentrant=False))
            else:
                outs.append(dense_attention(*part, scale))
        return torch.cat(outs, dim=2)

    return attend


def flex_row(inputs: dict, args: argparse.Namespace) -> tuple[Attend, float]:
    """FlexAttention over [T tokens | S groups | one zero key for the sink] and the seconds
    its block mask took to build."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T, S, window = args.seq, args.seq // args.ratio, args.window
    picked_TS = inputs["picked_TS"]
    N = T + S

    def mask_mod(b, h, q_idx, kv_idx):
        token = (kv_idx < T) & (kv_idx <= q_idx) & (q_idx - kv_idx < window)
        group = (kv_idx >= T) & (kv_idx < N) & picked_TS[q_idx, (kv_idx - T).clamp(0, S - 1)]
        return token | group | (kv_idx == N)

    started = time.perf_counter()
    block_mask = create_block_mask(mask_mod, None, None, T, N + 1, device=inputs["q"].device,
                                   _compile=True)  # block by block: [T, N] would not fit  # fmt: skip
    mask_s = time.perf_counter() - started
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q, kv, indices, sinks, scale):
        def score_mod(score, b, h, q_idx, kv_idx):  # the sink's logit on the zero key
            return torch.where(kv_idx == N, sinks[h].to(score.dtype), score)

        kv_ext = torch.cat([kv, kv.new_zeros(kv.shape[0], 1, kv.shape[-1])], dim=1)[:, None]
        return compiled(q, kv_ext, kv_ext, score_mod=score_mod, block_mask=block_mask,
                        scale=scale, enable_gqa=True)  # fmt: skip

    return attend, mask_s


def run_row(row: str, inputs: dict, args: argparse.Namespace, reference: torch.Tensor,
            cuda: bool) -> dict:  # fmt: skip
    q, kv, indices, sinks = (inputs[k] for k in ("q", "kv", "indices", "sinks"))
    record: dict = {"row": row, "note": ""}
    if row == "dense":
        attend = dense_chunked(args.chunk)
        record["note"] = f"{args.chunk} queries a chunk over all T + S keys"
    elif row == "flex":
        attend, mask_s = flex_row(inputs, args)
        record["mask_ms"] = 1e3 * mask_s
        record["note"] = f"block mask built in {1e3 * mask_s:.0f} ms"
    elif row == "gather":
        attend = gather_attention
    else:
        attend = lambda *a: sparse_attention(*a, impl="triton")  # noqa: E731
    scale = q.shape[-1] ** -0.5
    leaves = [x.detach().requires_grad_() for x in (q, kv, sinks)]
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype,
                       generator=torch.Generator(q.device.type).manual_seed(1))  # fmt: skip
    iters = args.iters_dense if row in ("dense", "gather") else args.iters
    with torch.no_grad():
        out = attend(q, kv, indices, sinks, scale)
        record["max_abs_diff_vs_gather"] = (out.float() - reference.float()).abs().max().item()
        del out
        record["fwd_ms"] = 1e3 * median_seconds(
            lambda: attend(q, kv, indices, sinks, scale), iters, 1, cuda=cuda
        )

    def fwd_bwd() -> None:
        out = attend(leaves[0], leaves[1], indices, leaves[2], scale)
        torch.autograd.grad(out, leaves, grad)

    record["fwd_bwd_ms"] = 1e3 * median_seconds(fwd_bwd, iters, 1, cuda=cuda)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--ratio", type=int, default=4, help="tokens per compressed group")
    parser.add_argument("--topk", type=int, default=512, help="groups each query attends to")
    parser.add_argument("--chunk", type=int, default=1024, help="queries per dense chunk")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--iters-dense", type=int, default=3, help="for dense and gather")
    parser.add_argument("--small", action="store_true",
                        help="a tiny fp32 shape (automatic without CUDA)")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("outputs/sparse_attention_bench.json"))
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if args.small or not cuda:  # the CPU: PyTorch rows only
        args.seq, args.heads, args.head_dim, args.window, args.topk = 64, 4, 32, 8, 4
        args.chunk, args.iters, args.iters_dense = 16, 2, 2
        args.rows = [r for r in args.rows if r in ("gather", "dense")]
        cuda = False
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    inputs = make_inputs(args, device, dtype)
    K = inputs["indices"].shape[-1]
    shape = {"B": 1, "H": args.heads, "T": args.seq, "S": args.seq // args.ratio,
             "d": args.head_dim, "K": K, "dtype": str(dtype)}  # fmt: skip
    with torch.no_grad():
        reference = gather_attention(inputs["q"], inputs["kv"], inputs["indices"],
                                     inputs["sinks"], args.head_dim**-0.5)  # fmt: skip
    rows = []
    for row in args.rows:
        try:
            record = run_row(row, inputs, args, reference, cuda)
        except Exception as err:  # an OOM or a compile failure becomes the row's error
            message = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            record = {"row": row, "error": f"{type(err).__name__}: {message}"}
            if cuda:
                torch.cuda.empty_cache()
        rows.append(shape | record)
        done = "" if "error" in record else (
            f"{record['fwd_ms']:.2f} ms fwd, {record['fwd_bwd_ms']:.2f} ms fwd+bwd")  # fmt: skip
        print(f"  {row}: {record.get('error', done)}", flush=True)
    triton_row = next((r for r in rows if r["row"] == "triton" and "fwd_ms" in r), None)
    for r in rows:
        r["forward_tflops"] = attention_flops(1, args.heads, args.seq, K, args.head_dim) / r["fwd_ms"] / 1e9 if "fwd_ms" in r else None  # fmt: skip
        if triton_row and "fwd_ms" in r:
            r["triton_speedup_fwd"] = r["fwd_ms"] / triton_row["fwd_ms"]
            r["triton_speedup_fwd_bwd"] = r["fwd_bwd_ms"] / triton_row["fwd_bwd_ms"]
    print(f"\nB=1 H={args.heads} T={args.seq} S={shape['S']} d={args.head_dim} K={K} {dtype}")
    print(f"{'row':<8} {'fwd ms':>10} {'fwd+bwd ms':>11} {'triton x (fwd, fwd+bwd)':>24} "
          f"{'max|diff|':>10}  note")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['row']:<8} error: {r['error'][:100]}")
            continue
        speedup = (f"{r['triton_speedup_fwd']:.1f}x, {r['triton_speedup_fwd_bwd']:.1f}x"
                   if "triton_speedup_fwd" in r else "")  # fmt: skip
        print(f"{r['row']:<8} {r['fwd_ms']:>10.2f} {r['fwd_bwd_ms']:>11.2f} {speedup:>24} "
              f"{r['max_abs_diff_vs_gather']:>10.2e}  {r['note']}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
