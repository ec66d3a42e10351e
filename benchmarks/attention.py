"""Training attention kernels side by side: forward + backward at the llama3 training shapes.

    python benchmarks/attention.py                                  # 1B and 8B heads, seq 4096
    python benchmarks/attention.py --shapes 1B --batch 4 --docs 8 --json outputs/attn.json

For each shape (query heads, kv heads and head dim of a llama3 flavor), causal GQA attention on
bf16 [B, H, T, d] inputs (``--layout bthd``: transposed views of [B, T, H, d], as the model
passes them; ``--load N``: N bf16 8192^3 matmuls ahead of each timed call, as a step's matmuls
load the GPU), forward then backward, with each kernel torch can run:
``sdpa`` (torch's own choice), ``sdpa-flash``, ``sdpa-cudnn`` and ``sdpa-efficient`` (one SDPA
kernel forced with torch.nn.attention.sdpa_kernel; GQA through enable_gqa where the kernel takes
it, else kv heads repeated first, which the row's note says), and ``flex`` (FlexAttention,
compiled, causal block mask), and ``fa4`` (FlashAttention 4, the `flash-attn-4` package's
CuTe DSL kernels, where installed: not a dependency). ``flex-docs``, ``sdpa-docs`` and
``fa4-docs`` pack --docs documents of equal length in each row and mask across them (the
model's attention slots: flex's block mask, SDPA's dense mask, FlashAttention 4's varlen
kernels): their work is a fraction of the causal one, and the table gives each one's time
against its causal row (``vs_causal``) to show whether the kernel skips the masked blocks. Flex rows build their block
mask once, outside the timed calls, as the model does (once per forward for all layers); the
build's own time is the row's ``mask_ms``. FLOPs: the model's attention
term (6 x heads x head_dim x T per token, causal QK^T and AV forward + backward), so TFLOP/s
compare with benchmarks/train.py. Times: median of --iters CUDA-event timed iterations after
warm-up. One table, JSON to --json. GPU only.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_bench import median_seconds, write_report
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchloom.kernels.attention_mask import CAUSAL
from torchloom.models import ModelConfig, resolve_model_config
from torchloom.models.components.attention import flex_attention_backend, flex_block_mask

FORCED = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}
ROWS = ("sdpa", *FORCED, "flex", "flex-docs", "fa4", "sdpa-docs", "fa4-docs")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sdpa(backend: SDPBackend | None, gqa: bool) -> Attend:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not gqa:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return attend


def _flex(doc_ids_BT: torch.Tensor | None, T: int) -> tuple[Attend, float]:
    """The flex backend with its block mask built once, and the build's median seconds."""
    cuda = torch.device("cuda")
    block_mask = flex_block_mask(CAUSAL, doc_ids_BT, T, T, cuda)
    mask_s = median_seconds(lambda: flex_block_mask(CAUSAL, doc_ids_BT, T, T, cuda), 5)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flex_attention_backend(q, k, v, block_mask)

    return attend, mask_s


def _fa4() -> Attend:
    """FlashAttention 4's causal GQA kernel (it takes [B, T, heads, d]: the model's layout)."""
    from flash_attn.cute import flash_attn_func

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return attend


def _slot(backend: str, doc_ids_BT: torch.Tensor | None = None) -> Attend:
    """torchloom's attention slot ``backend``, over packed rows with ``doc_ids_BT``: what the
    model hands it built once outside the timed calls (fa4: the documents' starts; sdpa: the
    ids, its mask built in each call, as in each layer)."""
    from torchloom.kernels.flash_attention4 import fa4_documents
    from torchloom.models import ATTENTION_BACKENDS

    attend_docs = ATTENTION_BACKENDS[backend]
    documents = doc_ids_BT
    if backend == "fa4" and doc_ids_BT is not None:
        documents = fa4_documents(doc_ids_BT)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_docs(q, k, v, documents)

    return attend


def matmul_load(count: int) -> Callable[[], None] | None:
    """``count`` bf16 8192^3 matmuls, run ahead of each timed call: the load a training step's
    matmuls put on the GPU (its clocks drop under it), or None for no load."""
    if count == 0:
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def load() -> None:
        for _ in range(count):
            a @ a

    return load


def time_fwd_bwd(
    attend: Attend, q, k, v, iters: int, before: Callable[[], None] | None = None
) -> float:
    """Median seconds of one forward + backward; the output's gradient is random normal with
    q's strides, as a real one is."""
    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype,
                       generator=torch.Generator(q.device).manual_seed(1)).as_strided(q.shape, q.stride())  # fmt: skip
    return median_seconds(
        lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), grad), iters, before=before
    )


def run_shape(shape: str, args: argparse.Namespace) -> list[dict]:
    cfg = resolve_model_config(ModelConfig(name="llama3", flavor=shape))
    H, K, d = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    T, B = args.seq, args.batch
    gen = torch.Generator("cuda").manual_seed(0)
    if args.layout == "bhtd":
        q, k, v = (torch.randn(B, heads, T, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for heads in (H, K, K))  # fmt: skip
    else:  # the model's layout: q/k/v projected as [B, T, heads, d], attention on transposed views
        q, k, v = (torch.randn(B, T, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .transpose(1, 2).detach().requires_grad_() for heads in (H, K, K))  # fmt: skip
    flops = B * T * 6 * H * d * T  # the model's attention term, per layer
    load = matmul_load(args.load)
    doc_ids_BT = (torch.arange(T, device="cuda") * args.docs // T).expand(B, T).contiguous()
    reference = _sdpa(SDPBackend.FLASH_ATTENTION, True)(q, k, v)
    rows = []
    for row in args.rows:
        record = {"shape": shape, "row": row, "B": B, "H": H, "K": K, "d": d, "T": T, "note": "",
                  "layout": args.layout, "load": args.load}  # fmt: skip
        try:
            if row.startswith("flex"):
                attend, mask_s = _flex(doc_ids_BT if row == "flex-docs" else None, T)
                record["mask_ms"] = 1e3 * mask_s
                record["note"] = f"mask built in {1e3 * mask_s:.2f} ms"
                if row == "flex-docs":
                    record["note"] += f"; {args.docs} documents per row"
            elif row == "fa4":
                attend = _fa4()
            elif row in ("sdpa-docs", "fa4-docs"):
                attend = _slot(row.removesuffix("-docs"), doc_ids_BT)
                record["note"] = f"{args.docs} documents per row"
            else:
                attend = _sdpa(FORCED.get(row), True)
                try:
                    attend(q, k, v)
                except RuntimeError:  # this kernel takes no enable_gqa
                    attend = _sdpa(FORCED.get(row), False)
                    record["note"] = "kv heads repeated (no GQA support)"
            if not row.endswith("-docs"):  # the same function as flash's: how close
                out = attend(q, k, v)
                record["max_abs_diff_vs_flash"] = (out - reference).abs().max().item()
            seconds = time_fwd_bwd(attend, q, k, v, args.iters, load)
        except Exception as err:  # a kernel this GPU or build lacks becomes the row's error
            record["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
            rows.append(record)
            print(f"  {shape} {row}: {record['error']}", flush=True)
            continue
        record |= {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}
        rows.append(record)
        print(f"  {shape} {row}: {1e3 * seconds:.3f} ms", flush=True)
    for r in rows:  # each -docs row against its kernel's causal row
        causal = next((c for c in rows if c["row"] == r["row"].removesuffix("-docs")), None)
        if r["row"].endswith("-docs") and causal and "ms" in r and "ms" in causal:
            r["vs_causal"] = r["ms"] / causal["ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1B", "8B"])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=8, help="documents per row for flex-docs")
    parser.add_argument("--layout", default="bhtd", choices=["bhtd", "bthd"],
                        help="q/k/v contiguous as [B, H, T, d], or views of [B, T, H, d] (the "
                        "model's; the gradient then has the same strides)")  # fmt: skip
    parser.add_argument("--load", type=int, default=0,
                        help="bf16 8192^3 matmuls run (untimed) before each timed call")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("outputs/attention_bench.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py times GPU kernels; run it on a CUDA machine.")
    rows = [r for shape in args.shapes for r in run_shape(shape, args)]
    print(f"\n{'shape':<5} {'row':<15} {'B,H,K,d,T':<18} {'ms':>8} {'TFLOP/s':>8}  note")
    for r in rows:
        dims = f"{r['B']},{r['H']},{r['K']},{r['d']},{r['T']}"
        if "error" in r:
            print(f"{r['shape']:<5} {r['row']:<15} {dims:<18} error: {r['error'][:70]}")
            continue
        note = r["note"] + (f" ({r['vs_causal']:.2f}x its causal row's time)"
                            if "vs_causal" in r else "")  # fmt: skip
        print(f"{r['shape']:<5} {r['row']:<15} {dims:<18} {r['ms']:>8.3f} {r['tflops']:>8.1f}  "
              f"{note}")  # fmt: skip
    write_report(args.json, rows)


if __name__ == "__main__":
    main()
