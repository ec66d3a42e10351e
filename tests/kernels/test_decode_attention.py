"""One-token attention over a generation cache (torchloom/kernels/decode_attention.py).

The PyTorch reference against the cache's masked matmul softmax (the path prefills take); the
Triton kernels against the reference on the CPU in Triton's interpreter (this file run as a
script with TRITON_INTERPRET=1: fp32, since the interpreter's bf16 ``tl.dot`` is wrong on this
Triton) and on a CUDA GPU in bf16 at Llama-3.2-1B's and Llama-3-8B's decode shapes; and the
generator decoding with the kernel against the same generator with the reference. Comparisons
are relative (max |diff| / max |value|) and print the measured difference, so they hold
whatever the host's BLAS.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torchloom.kernels.attention_mask import AttentionMask
from torchloom.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    split_count,
)
from torchloom.models.components.cache import grouped_attention


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def make_inputs(B: int, H: int, K: int, L: int, d: int, slots: int, device: str,
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q [B, H, d], cache k, v [slots, K, L, d], each row's slot (distinct) and position
    (row 0 at L - 1, row 1 at 0, the rest anywhere)."""
    gen = torch.Generator(device).manual_seed(seed)
    q = torch.randn(B, H, d, device=device, generator=gen).to(dtype)
    k = torch.randn(slots, K, L, d, device=device, generator=gen).to(dtype)
    v = torch.randn(slots, K, L, d, device=device, generator=gen).to(dtype)
    slots_B = torch.randperm(slots, device=device, generator=gen)[:B]
    positions_B = torch.randint(0, L, (B,), device=device, generator=gen)
    positions_B[0] = L - 1
    if B > 1:
        positions_B[1] = 0
    return q, k, v, slots_B, positions_B


def test_reference_matches_the_cache_attention() -> None:
    """fp32, causal, sliding window and chunked: what the cache's masked matmul softmax
    computes over each row's gathered slot."""
    q, k, v, slots_B, positions_B = make_inputs(B=4, H=6, K=2, L=40, d=8, slots=5,
                                                device="cpu", dtype=torch.float32)  # fmt: skip
    for mask in (AttentionMask(), AttentionMask(window=7), AttentionMask(chunk=16)):
        index_L = torch.arange(k.shape[2])
        hidden_B11TL = ~mask.visible(positions_B[:, None, None], index_L[None, None, :])[:, None, None]  # fmt: skip
        want = grouped_attention(q[:, :, None], k[slots_B], v[slots_B], hidden_B11TL)[:, :, 0]
        got = decode_attention_reference(q, k, v, slots_B, positions_B, None, mask.window,
                                         mask.chunk)  # fmt: skip
        assert _rel(got, want) < 1e-6, f"{mask.describe()}: {_rel(got, want):.1e}"


def test_rows_not_live_and_unknown_impls() -> None:
    q, k, v, slots_B, positions_B = make_inputs(B=3, H=2, K=1, L=8, d=4, slots=3,
                                                device="cpu", dtype=torch.float32)  # fmt: skip
    live_B = torch.tensor([True, False, True])
    out = decode_attention(q, k, v, slots_B, positions_B, live_B, impl="auto")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    with pytest.raises(ValueError, match="one of"):
        decode_attention(q, k, v, slots_B, positions_B, impl="flash")
    from torchloom.generate.engine import Generator
    from torchloom.models import ModelConfig, build_model, resolve_model_config

    model = build_model(resolve_model_config(ModelConfig(name="llama3", flavor="debug")))
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        Generator(model, max_batch=1, max_len=8, decode_attention="flash")


def test_split_count() -> None:
    """At batch 1 a long cache splits to fill the GPU; never more splits than key blocks,
    and a batch that fills the GPU alone is not split."""
    cpu = torch.device("cpu")  # the interpreter's stand-in: 4 "SMs"
    assert split_count(L=4096, kv_heads=1, rows=1, device=cpu) == 8
    assert split_count(L=100, kv_heads=1, rows=1, device=cpu) == 2
    assert split_count(L=4096, kv_heads=8, rows=64, device=cpu) == 1
    assert split_count(L=4096, kv_heads=1, rows=None, device=cpu) == 8  # symbolic rows


def check_triton(device: str, dtype: torch.dtype, tolerance: float, window: int | None = None,
                 chunk: int | None = None, live: bool = False, **shape: int) -> str:  # fmt: skip
    """The Triton op against the reference in fp64 (inputs rounded to ``dtype`` first)."""
    q, k, v, slots_B, positions_B = make_inputs(**shape, device=device, dtype=dtype)
    live_B = None
    if live:
        live_B = torch.arange(shape["B"], device=device) % 3 != 2
    want = decode_attention_reference(q.double(), k.double(), v.double(), slots_B, positions_B,
                                      live_B, window, chunk)  # fmt: skip
    got = decode_attention(q, k, v, slots_B, positions_B, live_B, window, chunk, impl="triton")
    assert got.dtype == dtype and got.shape == q.shape
    if live_B is not None:
        assert torch.equal(got[~live_B], torch.zeros_like(got[~live_B])), "dummy rows: zeros"
    rel = _rel(got, want)
    splits = split_count(shape["L"], shape["K"], shape["B"], q.device)
    line = (f"triton {dtype} {shape} window {window} chunk {chunk} live {live} "
            f"({splits} splits): max |diff| / max |value| {rel:.1e}")  # fmt: skip
    assert rel < tolerance, line
    return line


def check_generator(device: str, dtype: torch.dtype, tolerance: float, compile: bool = False) -> str:  # fmt: skip
    """The qwen3 debug model (a sliding layer, window 4, then a full one) generating 3
    requests through 2 slots on the static (graph-shaped) decode steps, with the kernel and
    with the reference: the same tokens, log-probabilities within ``tolerance``."""
    from dataclasses import replace

    from torchloom.generate.engine import Generator, Request, SamplingParams, score
    from torchloom.generate.graphs import DecodeGraphs
    from torchloom.models import ModelConfig, build_model, resolve_model_config

    base = resolve_model_config(ModelConfig(name="qwen3", flavor="debug"))
    config = replace(base, layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    model = build_model(config)
    model.init_weights(0)
    model = model.eval().to(device=device, dtype=dtype)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9] * 11]
    results = {}
    for impl in ("torch", "triton"):
        generator = Generator(model, max_batch=2, max_len=32, decode_attention=impl,
                              cuda_graphs=compile, compile=compile)  # fmt: skip
        if generator.graphs is None:
            generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
        requests = [Request(p, SamplingParams(max_new_tokens=6 + i, temperature=0.0))
                    for i, p in enumerate(prompts)]  # fmt: skip
        results[impl] = generator.generate(requests)
    worst = 0.0
    for ours, reference in zip(results["triton"], results["torch"], strict=True):
        assert ours.tokens == reference.tokens, (ours.tokens, reference.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours.logprobs, reference.logprobs)))
    assert worst < tolerance, f"generator {dtype}: max |logprob diff| {worst:.1e}"
    return f"generator {dtype} compile {compile}, kernel vs reference: same tokens, logprobs within {worst:.1e}"  # fmt: skip


@pytest.mark.parametrize(("dtype", "precision"), [("bf16", "tf32"), ("fp32", "ieee")])
def test_kernels_compile_for_hopper(dtype: str, precision: str) -> None:
    """The split and combine kernels compile for sm_90 without a GPU (what the interpreter
    never checks: one type per value across branches and loop iterations), at the 1B decode
    shape (head_dim 64, 4 query heads a kv head, 8 splits) with a window, without spilling. The
    pointers and the integers that are multiples of 16 at that shape (32 heads, a 4,096-long
    cache, head_dim 64 and the strides) are marked so, as the launcher marks them on a GPU (the
    split kernel unmarked held 229-255 registers and spilled in fp32; marked, 72-92)."""
    pytest.importorskip("triton")
    from torchloom.kernels import decode_attention as kernels
    from torchloom.kernels.triton_support import compile_for_hopper

    ints = ["H", "group", "g_blocks", "L", "d", "split_len", "stride_qb", "stride_qh",
            "stride_ks", "stride_kk", "stride_kl", "stride_vs", "stride_vk", "stride_vl"]  # fmt: skip
    split_types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                   "slots_ptr": "*i64", "pos_ptr": "*i64", "live_ptr": "*i1",
                   "out_ptr": f"*{dtype}", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                   "acc_ptr": "*fp32", **dict.fromkeys(ints, "i32")}  # fmt: skip
    split_constants = {"SCALE_LOG2": 64**-0.5 * kernels._LOG2E, "WINDOW": 4096, "CHUNK": 0,
                       "SPLITS": 8, "BLOCK_G": 16, "BLOCK_L": kernels._BLOCK_L, "BLOCK_D": 64,
                       "DOT_PRECISION": precision}  # fmt: skip
    combine_types = {"max_ptr": "*fp32", "sum_ptr": "*fp32", "acc_ptr": "*fp32",
                     "out_ptr": f"*{dtype}", "H": "i32", "d": "i32", "stride_ob": "i32",
                     "stride_oh": "i32"}  # fmt: skip
    for kernel, types, constants in [
        (kernels._split_kernel, split_types, split_constants),
        (kernels._combine_kernel, combine_types, {"SPLITS": 8, "BLOCK_S": 8, "BLOCK_D": 64}),
    ]:
        divisible = [n for n in types if n.startswith(("H", "L", "d", "stride")) or "ptr" in n]
        usage = compile_for_hopper(kernel, types, constants, 4, divisible)
        assert usage.endswith(" SPILLS:0"), usage


def test_triton_kernels_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_triton_matches_the_reference_on_gpu() -> None:
    """bf16 at Llama-3.2-1B's decode shape (32 heads, 8 kv heads of 64) at batch 1 (split)
    and 64 (not), Llama-3-8B's at a 4096-token cache, a sliding window, dummy rows, groups of
    80 heads; under torch.compile (inductor) against eager; and the generator eager, and
    compiled and replayed from CUDA graphs, kernel against reference."""
    bf16, fp32 = torch.bfloat16, torch.float32
    lines = [
        check_triton("cuda", bf16, 2e-2, B=1, H=32, K=8, L=384, d=64, slots=1),
        check_triton("cuda", bf16, 2e-2, B=64, H=32, K=8, L=384, d=64, slots=64),
        check_triton("cuda", bf16, 2e-2, B=2, H=32, K=8, L=4096, d=128, slots=4),
        check_triton("cuda", bf16, 2e-2, 128, None, True, B=5, H=16, K=4, L=700, d=64, slots=8),
        check_triton("cuda", fp32, 1e-5, B=3, H=80, K=1, L=200, d=80, slots=3, chunk=64),
        check_compiled("cuda"),
        # fp32 models: a random debug model's near-tied logits would let bf16 rounding flip a
        # greedy token, which says nothing about the kernel (its bf16 error is checked above)
        check_generator("cuda", fp32, 1e-4),
        check_generator("cuda", fp32, 1e-4, compile=True),
    ]
    print("\n".join(lines))


def check_compiled(device: str) -> str:
    """Inside torch.compile (inductor, batch dynamic) the op gives eager's bits."""
    q, k, v, slots_B, positions_B = make_inputs(B=3, H=8, K=2, L=256, d=64, slots=4,
                                                device=device, dtype=torch.bfloat16)  # fmt: skip

    def attend(q, positions_B):
        return decode_attention(q, k, v, slots_B, positions_B, impl="triton")

    eager = attend(q, positions_B)
    compiled = torch.compile(attend, fullgraph=True, dynamic=True)(q, positions_B)
    diff = (compiled.float() - eager.float()).abs().max().item()
    assert torch.equal(compiled, eager), f"compiled: max |diff| {diff:.1e}"
    return "compiled (inductor, fullgraph) = eager (bitwise)"


if __name__ == "__main__":  # run by test_triton_kernels_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    fp32 = torch.float32
    for line in (
        # one row: 3 splits of 64 keys over a 150-key cache, GQA groups of 4
        check_triton("cpu", fp32, 1e-5, B=1, H=8, K=2, L=150, d=16, slots=2),
        # 8 rows x 2 kv heads fill the interpreter's 4 "SMs": one split, written directly
        check_triton("cpu", fp32, 1e-5, B=8, H=4, K=2, L=100, d=16, slots=9),
        check_triton("cpu", fp32, 1e-5, B=3, H=6, K=3, L=200, d=24, slots=4, window=37),
        # a window that starts inside a split's key block, over 5 splits
        check_triton("cpu", fp32, 1e-5, B=1, H=2, K=1, L=300, d=16, slots=1, window=100),
        check_triton("cpu", fp32, 1e-5, B=4, H=4, K=1, L=130, d=32, slots=4, chunk=64, live=True),
        # 80 query heads on one kv head: two head blocks of 64
        check_triton("cpu", fp32, 1e-5, B=2, H=80, K=1, L=70, d=16, slots=3),
        check_generator("cpu", fp32, 1e-5),
    ):
        print(line)
