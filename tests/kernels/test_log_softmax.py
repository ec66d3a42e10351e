"""Log-probabilities and argmax of logits rows, split over the vocabulary
(torchloom/kernels/log_softmax.py).

The Triton kernels against PyTorch's form (what the generator's ``score`` computes) on the CPU
in Triton's interpreter (this file run as a script with TRITON_INTERPRET=1) and on a CUDA GPU
at Llama-3's vocabulary (128,256) in bf16 at batch 1 and 64; the generator scoring with the
kernels against the same generator with PyTorch's form. Tokens must match exactly (ties to the
lowest index), log-probabilities within a few fp32 units in the last place of the
log-sum-exp (another summation order).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from torchloom.kernels.log_softmax import (
    log_softmax_argmax,
    log_softmax_argmax_reference,
)


def make_logits(B: int, V: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Random logits with row 0's maximum tied at two indices in different blocks of 4096
    (the lower one must win) and some -inf entries (masked tokens)."""
    gen = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(B, V, device=device, generator=gen) * 3
    low, high = min(5, V - 1), V - 1
    logits[0, low] = logits[0, high] = 40.0
    logits[:, 1:V:7] = float("-inf")
    return logits.to(dtype)


def check(device: str, dtype: torch.dtype, B: int, V: int, impl: str = "triton") -> str:
    logits = make_logits(B, V, dtype, device)
    want_lp, want_best = log_softmax_argmax_reference(logits)
    got_lp, got_best = log_softmax_argmax(logits, impl=impl)
    assert got_lp.dtype == torch.float32 and got_best.dtype == torch.float64
    assert got_best.shape == (2, B) and got_lp.shape == (B, V)
    assert torch.equal(got_best[0], want_best[0]), (got_best[0], want_best[0])
    assert got_best[0, 0] == min(5, V - 1), "a tie goes to the lowest index"
    finite = want_lp.isfinite()
    assert torch.equal(finite, got_lp.isfinite())
    diff = (got_lp[finite] - want_lp[finite]).abs().max().item()
    picked = (got_best[1] - want_best[1]).abs().max().item()
    assert diff < 2e-5 and picked < 2e-5, (
        f"{dtype} {B}x{V}: logprobs {diff:.1e}, picked {picked:.1e}"
    )
    return f"{impl} {dtype} {B} x {V}: same tokens, log-probabilities within {diff:.1e}"


def check_bad_rows(device: str) -> str:
    """A row with a nan logit, one with +inf and one all -inf: each argmax's log-probability
    is nan, as PyTorch's (the generator ends such a request with an error)."""
    logits = torch.randn(4, 9000, device=device)
    logits[0, 7] = float("nan")
    logits[1, 8100] = float("inf")
    logits[2] = float("-inf")
    _, best = log_softmax_argmax(logits, impl="triton")
    _, want = log_softmax_argmax_reference(logits)
    assert all(math.isnan(v) for v in best[1, :3].tolist()), best
    assert all(math.isnan(v) for v in want[1, :3].tolist()), want
    assert best[0, 3] == want[0, 3] and abs(best[1, 3] - want[1, 3]) < 2e-5
    return "rows with nan, +inf, all -inf logits: nan log-probabilities, as PyTorch's"


def test_unknown_impl_and_batch_invariant_mode_are_refused() -> None:
    with pytest.raises(ValueError, match="one of"):
        log_softmax_argmax(torch.zeros(1, 4), impl="cuda")
    from torchloom.generate.engine import Generator
    from torchloom.models import ModelConfig, build_model, resolve_model_config

    flavor = resolve_model_config(ModelConfig(name="llama3", flavor="debug", batch_invariant=True))
    model = build_model(flavor)
    with pytest.raises(ValueError, match="score_kernel 'triton' and batch-invariant mode"):
        Generator(model, max_batch=1, max_len=8, score_kernel="triton")
    # "auto" scores as the trainer does in this mode, on CUDA too: PyTorch's log-softmax.
    generator = Generator(model, max_batch=1, max_len=8, score_kernel="auto")
    assert generator._score.keywords == {"impl": "torch"}
    with pytest.raises(ValueError, match="score_kernel must be one of"):
        Generator(model, max_batch=1, max_len=8, score_kernel="fast")


def test_auto_is_the_reference_off_cuda() -> None:
    logits = make_logits(2, 300, torch.float32, "cpu")
    got, want = log_softmax_argmax(logits, impl="auto"), log_softmax_argmax_reference(logits)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def check_generator(device: str, dtype: torch.dtype, compile: bool = False) -> str:
    """The llama3 debug model generating 3 greedy requests through 2 slots on the static
    decode steps, scored by the kernels and by PyTorch: the same tokens, logprobs within 1e-5."""
    from torchloom.generate.engine import Generator, Request, SamplingParams
    from torchloom.generate.graphs import DecodeGraphs
    from torchloom.models import ModelConfig, build_model, resolve_model_config

    model = build_model(resolve_model_config(ModelConfig(name="llama3", flavor="debug")))
    model.init_weights(0)
    model = model.eval().to(device=device, dtype=dtype)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9] * 11]
    results = {}
    for impl in ("torch", "triton"):
        # the forward at every batch (the fused step scores in its own kernel)
        generator = Generator(model, max_batch=2, max_len=32, score_kernel=impl,
                              cuda_graphs=compile, compile=compile, step_kernel="torch")  # fmt: skip
        if generator.graphs is None:
            generator.graphs = DecodeGraphs(model, generator.cache, generator._score, capture=False)
        requests = [Request(p, SamplingParams(max_new_tokens=5, temperature=0.0)) for p in prompts]
        results[impl] = generator.generate(requests)
    worst = 0.0
    for ours, reference in zip(results["triton"], results["torch"], strict=True):
        assert ours.tokens == reference.tokens, (ours.tokens, reference.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours.logprobs, reference.logprobs)))
    assert worst < 1e-5, f"generator: max |logprob diff| {worst:.1e}"
    return f"generator {dtype} compile {compile}: same tokens, logprobs within {worst:.1e}"


def test_kernels_compile_for_hopper() -> None:
    """Both kernels compile for sm_90 without a GPU over bf16 logits of Llama-3's vocabulary
    (32 blocks of 4,096), without spilling (what the interpreter never checks). The pointers and
    the integers that are multiples of 16 there (the vocabulary, the row stride, the blocks) are
    marked so, as the launcher marks them on a GPU."""
    pytest.importorskip("triton")
    from torchloom.kernels import log_softmax as kernels
    from torchloom.kernels.triton_support import compile_for_hopper

    partial = {"max_ptr": "*fp32", "sum_ptr": "*fp32", "arg_ptr": "*i64"}
    ints = dict.fromkeys(["V", "stride_xb", "blocks"], "i32")
    types = {"x_ptr": "*bf16", **partial, **ints}
    usage = compile_for_hopper(kernels._partials_kernel, types, {"BLOCK_V": kernels._BLOCK_V}, 4,
                               [*types])  # fmt: skip
    assert usage.endswith(" SPILLS:0"), usage
    finish = {"x_ptr": "*bf16", **partial, "out_ptr": "*fp32", "best_ptr": "*fp64",
              "V": "i32", "B": "i32", "stride_xb": "i32", "blocks": "i32"}  # fmt: skip
    usage = compile_for_hopper(kernels._finish_kernel, finish,
                               {"BLOCK_V": kernels._BLOCK_V, "BLOCK_P": 32}, 4,
                               [name for name in finish if name != "B"])  # fmt: skip
    assert usage.endswith(" SPILLS:0"), usage


def test_triton_kernels_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_triton_matches_the_reference_on_gpu() -> None:
    """Llama-3's vocabulary in bf16 at batch 1 and 64, fp32, the bad rows, the op compiled
    (inductor) against eager, and the generator eager and compiled from CUDA graphs."""
    lines = [
        check("cuda", torch.bfloat16, 1, 128256),
        check("cuda", torch.bfloat16, 64, 128256),
        check("cuda", torch.float32, 3, 151936),
        check("cuda", torch.float32, 5, 1000, impl="auto"),
        check_bad_rows("cuda"),
    ]
    logits = make_logits(2, 128256, torch.bfloat16, "cuda")
    eager = log_softmax_argmax(logits, impl="triton")
    compiled = torch.compile(lambda x: log_softmax_argmax(x, impl="triton"), fullgraph=True)(logits)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager)), "compiled differs from eager"
    lines.append("compiled (inductor, fullgraph) = eager (bitwise)")
    lines += [check_generator("cuda", torch.float32), check_generator("cuda", torch.float32, True)]
    print("\n".join(lines))


if __name__ == "__main__":  # run by test_triton_kernels_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    for line in (
        check("cpu", torch.float32, 2, 1000),  # one block
        check("cpu", torch.float32, 3, 10000),  # three blocks, the last partial
        check("cpu", torch.bfloat16, 1, 20000),
        check_bad_rows("cpu"),
        check_generator("cpu", torch.float32),
    ):
        print(line)
