"""The floor under a training step: its kernels, each timed alone on this GPU, end to end.

    python benchmarks/step_floor.py                               # 1B at 8 x 4096, 8B at 4 x 4096
    python benchmarks/step_floor.py --shapes 8B --train-json outputs/train_bench.json

benchmarks/train.py measures how fast a step runs; this says how fast it could run with the
kernels this software stack has. A step is three kinds of work, each measured here alone:

- matmuls: every linear's forward, input-gradient and weight-gradient matmul at the step's
  tokens (benchmarks/matmul_shapes.py's rows; the head in chunks of --chunk tokens, its weight
  gradient accumulated in fp32 as the chunked loss does);
- attention: SDPA (torch's choice of kernel; ``--attention fa4``: the fa4 slot,
  FlashAttention 4, where flash-attn-4 is installed) causal GQA forward + backward on the
  step's q/k/v, views of [B, T, heads, head_dim] as in the model, random data and a random
  output gradient, times the layers (benchmarks/attention.py's timing);
- memory-bound work: the bytes the step's other kernels must read and write at the least
  (``memory_traffic``: residual adds fused into the norms, SwiGLU, RoPE on q and k, the loss
  kernel over each logits chunk, the embedding, the gradient norm and AdamW, the fp32 master
  weights' bf16 cast), at the bandwidth of a large device-to-device copy timed here.

The floor is their sum: one stream runs its kernels one after another. The overlap row times the
one way around that: a copy on a second stream beside the MLP's matmuls, and how much of the
copy hides. The floor's tokens/s, TFLOP/s and MFU use benchmarks/train.py's FLOP formula. With
--train-json (reports of that script) each measured row of the same shape and batch is shown
against the floor, and the floor against the fastest HF row of the shape. Times: median of
--iters CUDA-event timed calls after warm-up. One table, JSON to --json. GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from attention import _sdpa, _slot, time_fwd_bwd
from gpu_bench import median_seconds, write_report
from matmul_shapes import step_rows, time_linear

from torchloom.models import ModelConfig, TransformerConfig, build_model, resolve_model_config
from torchloom.train.metrics import device_peak_tflops

# name: (llama3 flavor, sequences per step, fp32 master weights under bf16 compute?), as the
# measured steps of benchmarks/RESULTS.md (1B: fp32 master weights; 8B: bf16 weights and state)
SHAPES = {"1B": ("1B", 8, True), "8B": ("8B", 4, False)}
ACT = 2  # bytes per bf16 activation element


def parameter_count(cfg: TransformerConfig) -> int:
    """Distinct parameters (a tied embedding and head counted once), from a meta-device build."""
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def memory_traffic(cfg: TransformerConfig, tokens: int, params: int, fp32_master: bool) -> dict:
    """The least bytes per step that the kernels other than matmuls and attention must move.

    N tokens, width d, FFN width f, L layers, bf16 activations (2 bytes):
    - norms: each block's two residual adds fused into the norm after them: forward reads the
      stream and the branch, writes the sum and the normed output; backward reads the sum, the
      normed output's gradient and the stream's gradient and writes the stream's gradient:
      8 N d elements for each of the 2L norms, 5 N d for the first (no add before it);
    - swiglu: forward reads gate and up, writes their product; backward reads the three
      and writes two gradients: 8 N f per layer;
    - rope on q and k: read and write each, forward and backward: 4 N (q + k width) per layer;
    - loss: the loss kernel reads each logits chunk and writes its gradient in place: 2 N V;
    - embedding: the forward writes N d rows, the backward reads their gradient: 2 N d;
    - optimizer, per parameter: the gradient norm reads the gradient; AdamW reads parameter,
      gradient and both moments and writes parameter and moments (bf16 weights: 16 bytes;
      fp32 master weights: 32, plus 6 for the bf16 copy the matmuls read, the weight
      gradients written in fp32 by the matmuls).
    """
    n, d, f, layers = tokens, cfg.dim, cfg.ffn_dim, cfg.num_layers
    hd = cfg.resolved_head_dim
    q_k = (cfg.num_heads + cfg.num_kv_heads) * hd
    per_param = 32 + 6 if fp32_master else 16
    return {
        "norms": ACT * n * d * (8 * 2 * layers + 5),
        "swiglu": ACT * 8 * n * f * layers,
        "rope": ACT * 4 * n * q_k * layers,
        "loss": ACT * 2 * n * cfg.vocab_size,
        "embedding": ACT * 2 * n * d,
        "optimizer": per_param * params,
    }


def copy_bandwidth(iters: int, gib: int = 2) -> float:
    """Bytes per second of a device-to-device copy of ``gib`` GiB (read + written)."""
    src = torch.empty(gib * 2**30 // 2, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), iters)
    return 2 * src.nbytes / seconds


def overlap(m: int, k: int, n: int, reps: int, iters: int, bandwidth: float) -> dict[str, float]:
    """``reps`` matmuls x [m, k] @ w[n, k]^T on the current stream and a copy of about as long
    on a second one (sized from ``bandwidth``, bytes/s): each alone, then together; how many ms
    of the copy hid under them."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

    def matmuls() -> None:
        for _ in range(reps):
            x @ w.t()

    mm = median_seconds(matmuls, iters)
    src = torch.empty(int(mm * bandwidth / 4), device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = median_seconds(lambda: dst.copy_(src), iters)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()

    def both() -> None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst.copy_(src)
        matmuls()
        main.wait_stream(side)

    together = median_seconds(both, iters)
    return {"matmul_ms": 1e3 * mm, "copy_ms": 1e3 * copy, "together_ms": 1e3 * together,
            "hidden_ms": 1e3 * (mm + copy - together)}  # fmt: skip


def _kinds(row: dict) -> dict[str, float] | None:
    """A profiled benchmarks/train.py row's GPU ms per step as the floor's three kinds of work."""
    if "profile" not in row:
        return None
    kinds = row["profile"]["ms_per_step_by_kind"]
    matmul, attention = kinds.get("matmul", 0.0), kinds.get("attention", 0.0)
    return {"matmul_ms": matmul, "attention_ms": attention,
            "memory_ms": row["profile"]["gpu_busy_ms_per_step"] - matmul - attention}  # fmt: skip


def floor(
    shape: str, batch: int, seq: int, chunk: int, iters: int, bandwidth: float, attention: str
) -> dict:
    flavor, _, fp32_master = SHAPES[shape]
    cfg = resolve_model_config(ModelConfig(name="llama3", flavor=flavor))
    tokens = batch * seq
    matmul_ms = 0.0
    for name, m, k, n, count, fp32_wgrad in step_rows(flavor, tokens, chunk):
        if "fused" not in name:
            matmul_ms += count * sum(time_linear(m, k, n, iters, fp32_wgrad).values())
    heads, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    q, k, v = (torch.randn(batch, seq, h, hd, device="cuda", dtype=torch.bfloat16)
               .transpose(1, 2).detach().requires_grad_() for h in (heads, kv, kv))  # fmt: skip
    attend = _sdpa(None, True) if attention == "sdpa" else _slot(attention)
    attention_ms = 1e3 * cfg.num_layers * time_fwd_bwd(attend, q, k, v, iters)
    del q, k, v
    traffic = memory_traffic(cfg, tokens, parameter_count(cfg), fp32_master)
    memory_ms = {term: 1e3 * b / bandwidth for term, b in traffic.items()}
    step_ms = matmul_ms + attention_ms + sum(memory_ms.values())
    tokens_per_s = tokens / step_ms * 1e3
    return {
        "shape": shape, "batch": batch, "seq": seq, "matmul_ms": matmul_ms,
        "attention": attention, "attention_ms": attention_ms, "memory_bytes": traffic, "memory_ms": memory_ms,
        "step_ms": step_ms, "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * cfg.flops_per_token(seq) / 1e12,
        "overlap": overlap(tokens, cfg.dim, cfg.ffn_dim, 4, iters, bandwidth),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batch", type=int, help="sequences per step (default: the shape's)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=4096, help="the head's tokens per chunk")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "fa4"],
                        help="the attention kernel timed: SDPA's choice, or the fa4 slot")  # fmt: skip
    parser.add_argument("--train-json", type=Path, nargs="*", default=[],
                        help="benchmarks/train.py reports to compare with the floor")  # fmt: skip
    parser.add_argument("--json", type=Path, default=Path("outputs/step_floor.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/step_floor.py times GPU kernels; run it on a CUDA machine.")
    peak, device_name = device_peak_tflops(torch.device("cuda"))
    bandwidth = copy_bandwidth(args.iters)
    print(f"{device_name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    measured = [row for path in args.train_json for row in json.loads(path.read_text())["rows"]]
    rows = []
    for shape in args.shapes:
        batch = args.batch or SHAPES[shape][1]
        r = floor(shape, batch, args.seq, args.chunk, args.iters, bandwidth, args.attention)
        r["mfu"] = 100 * r["tflops"] / peak if peak else None
        r["measured"] = [
            {"row": m["row"], "tokens_per_s": m["tokens_per_s"],
             "of_floor": m["tokens_per_s"] / r["tokens_per_s"], "profile": _kinds(m)}
            for m in measured
            if m["shape"] == shape and m.get("tokens_per_s") and m["batch"] == batch
        ]  # fmt: skip
        hf = [m["tokens_per_s"] for m in measured
              if m["shape"] == shape and m["row"] == "hf" and m.get("tokens_per_s")]  # fmt: skip
        r["floor_vs_hf"] = r["tokens_per_s"] / max(hf) if hf else None  # HF's best batch
        rows.append(r)
        print(f"  {shape}: floor {r['step_ms']:.1f} ms per step", flush=True)
    print(f"\n{'shape':<5} {'term':<22} {'ms':>8}  note")
    for r in rows:
        s = r["shape"]
        print(f"{s:<5} {'matmuls':<22} {r['matmul_ms']:>8.1f}  each alone, cuBLAS")
        print(f"{s:<5} {'attention':<22} {r['attention_ms']:>8.1f}  "
              f"{r['attention']} fwd + bwd, alone")  # fmt: skip
        for term, ms in r["memory_ms"].items():
            print(f"{s:<5} {'memory: ' + term:<22} {ms:>8.1f}  "
                  f"{r['memory_bytes'][term] / 1e9:.1f} GB at the copy's bandwidth")  # fmt: skip
        mfu = f", {r['mfu']:.1f}% MFU" if r["mfu"] is not None else ""
        print(f"{s:<5} {'floor (sum)':<22} {r['step_ms']:>8.1f}  {r['tokens_per_s']:,.0f} "
              f"tokens/s, {r['tflops']:.1f} TFLOP/s{mfu}")  # fmt: skip
        o = r["overlap"]
        print(f"{s:<5} {'overlap':<22} {o['hidden_ms']:>8.1f}  of a {o['copy_ms']:.1f} ms copy "
              f"on a second stream beside {o['matmul_ms']:.1f} ms of MLP matmuls")  # fmt: skip
        for m in r["measured"]:
            print(f"{s:<5} {'measured: ' + m['row']:<22} {'':>8}  {m['tokens_per_s']:,.0f} "
                  f"tokens/s = {100 * m['of_floor']:.1f}% of the floor")  # fmt: skip
            if p := m["profile"]:
                floor_ms = (r["matmul_ms"], r["attention_ms"], sum(r["memory_ms"].values()))
                print(f"{s:<5} {'  its kernels, ms':<22} {'':>8}  " + ", ".join(
                    f"{kind.removesuffix('_ms')} {p[kind]:.1f} (floor {ms:.1f})"
                    for kind, ms in zip(p, floor_ms)))  # fmt: skip
        if r["floor_vs_hf"] is not None:
            print(f"{s:<5} {'floor vs hf':<22} {'':>8}  {r['floor_vs_hf']:.3f}x")
    write_report(args.json, rows)


if __name__ == "__main__":
    main()
