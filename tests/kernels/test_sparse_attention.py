"""Gathered MQA attention with a sink (torchloom/kernels/sparse_attention.py).

The PyTorch reference against the dense masked softmax (fp32, forward and gradients); the
Triton kernels against the reference, on the CPU in Triton's interpreter (this file run as a
script with TRITON_INTERPRET=1, tiny fp32 shapes) and on a CUDA GPU at DeepSeek-V4-Flash's
shape (64 heads of 512, K = 128 + 512). Comparisons are relative (max |diff| / max |value|)
and print the measured difference, so they hold whatever the host's BLAS.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torchloom.kernels.sparse_attention import dense_attention, gather_attention, sparse_attention


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def make_inputs(
    B: int, H: int, T: int, S: int, d: int, window: int, picks: int, device: str,
    dtype: torch.dtype, seed: int = 0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q [B, H, T, d], kv [B, T + S, d], indices [B, T, window + picks] (the window's causal
    tokens, then ``picks`` distinct groups among the first S, -1 padded as the model pads)
    and sinks [H], as leaf tensors that require grad."""
    gen = torch.Generator(device).manual_seed(seed)
    q = torch.randn(B, H, T, d, device=device, generator=gen).to(dtype)
    kv = torch.randn(B, T + S, d, device=device, generator=gen).to(dtype)
    sinks = torch.randn(H, device=device, generator=gen)
    t_T1 = torch.arange(T, device=device)[:, None]
    window_TW = t_T1 - window + 1 + torch.arange(window, device=device)
    window_BTW = torch.where(window_TW >= 0, window_TW, -1).expand(B, T, window)
    order_BTS = torch.rand(B, T, S, device=device, generator=gen).argsort(-1)[..., :picks]
    groups_BTk = torch.where(order_BTS < (t_T1 + 1) // 4, T + order_BTS, -1)  # causal groups
    indices = torch.cat([window_BTW, groups_BTk], dim=-1).to(torch.int32).contiguous()
    return q.requires_grad_(), kv.requires_grad_(), indices, sinks.requires_grad_()


def _forward_backward(fn, q, kv, indices, sinks, seed: int = 1) -> list[torch.Tensor]:
    out = fn(q, kv, indices, sinks, q.shape[-1] ** -0.5)
    gen = torch.Generator(q.device.type).manual_seed(seed)
    grad = torch.randn(out.shape, device=q.device, generator=gen).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, (q, kv, sinks), grad)]


NAMES = ("out", "dq", "dkv", "dsinks")


def check_triton(device: str, dtype: torch.dtype, tolerance: float, bthd: bool = False,
                 **shape: int) -> list[str]:  # fmt: skip
    """The Triton op's output and gradients against the gather reference's in fp32 (inputs
    rounded to ``dtype`` first); ``bthd``: q a [B, H, T, d] view of [B, T, H, d], as the
    model's may be."""
    q, kv, indices, sinks = make_inputs(**shape, device=device, dtype=dtype)
    if bthd:
        q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    fp32 = [x.detach().float().requires_grad_() for x in (q, kv, sinks)]
    want = _forward_backward(gather_attention, fp32[0], fp32[1], indices, fp32[2])
    got = _forward_backward(lambda *a: sparse_attention(*a, impl="triton"), q, kv, indices, sinks)
    report = []
    for name, g, w in zip(NAMES, got, want, strict=True):
        rel = _rel(g, w)
        report.append(f"triton {dtype} {shape} {name}: max |diff| / max |value| {rel:.1e}")
        assert rel < tolerance, report[-1]
    return report


def test_gather_reference_matches_the_dense_masked_softmax() -> None:
    """Forward and gradients, fp32, with padding, queries that see nothing but their window,
    and a chunk smaller than T (the reference's chunking crosses queries)."""
    import torchloom.kernels.sparse_attention as module

    inputs = make_inputs(B=2, H=3, T=37, S=9, d=16, window=5, picks=4, device="cpu",
                         dtype=torch.float32)  # fmt: skip
    want = _forward_backward(dense_attention, *inputs)
    budget = module._GATHER_BUDGET
    try:
        module._GATHER_BUDGET = 2 * 9 * 16 * 7  # 7 queries a chunk
        got = _forward_backward(gather_attention, *inputs)
    finally:
        module._GATHER_BUDGET = budget
    for name, g, w in zip(NAMES, got, want, strict=True):
        rel = _rel(g, w)
        print(f"gather vs dense {name}: {rel:.1e}")
        assert rel < 1e-5, f"{name}: max |diff| / max |value| {rel:.1e}"


def test_a_query_with_no_key_outputs_zeros() -> None:
    q, kv, _, sinks = make_inputs(B=1, H=2, T=3, S=0, d=8, window=1, picks=0, device="cpu",
                                  dtype=torch.float32)  # fmt: skip
    indices = torch.full((1, 3, 2), -1, dtype=torch.int64)
    assert torch.equal(sparse_attention(q, kv, indices, sinks), torch.zeros_like(q))


def test_unknown_impl_is_refused() -> None:
    q, kv, indices, sinks = make_inputs(B=1, H=1, T=2, S=0, d=4, window=2, picks=0,
                                        device="cpu", dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="one of"):
        sparse_attention(q, kv, indices, sinks, impl="flash")


def test_triton_kernels_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_triton_matches_the_reference_on_gpu() -> None:
    """DeepSeek-V4-Flash's attention (64 heads of 512, window 128, 512 picked groups of 4) at
    T = 2048 in bf16, a small fp32 shape with non-power-of-two heads and dims, the op under
    torch.compile, and the debug model with the Triton path against dense."""
    print("\n".join(check_triton("cuda", torch.float32, 1e-4, B=2, H=5, T=97, S=24, d=80,
                                 window=16, picks=11)))  # fmt: skip
    print("\n".join(check_triton("cuda", torch.bfloat16, 3e-2, B=1, H=64, T=2048, S=512,
                                 d=512, window=128, picks=512, bthd=True)))  # fmt: skip
    print(check_compiled("cuda"))
    print(check_model("cuda"))


def check_compiled(device: str) -> str:
    """torch.compile traces the op in one graph (fullgraph) and agrees with eager."""
    inputs = make_inputs(B=1, H=2, T=8, S=2, d=16, window=4, picks=2, device=device,
                         dtype=torch.float32)  # fmt: skip

    def attend(q, kv, indices, sinks, scale):
        return sparse_attention(q, kv, indices, sinks, scale, impl="triton")

    eager = _forward_backward(attend, *inputs)
    compiled = _forward_backward(torch.compile(attend, backend="aot_eager", fullgraph=True), *inputs)  # fmt: skip
    for name, g, w in zip(NAMES, compiled, eager, strict=True):
        diff = (g - w).abs().max().item()
        if name == "dkv" and device == "cuda":  # summed by atomics, in no fixed order on a GPU
            assert diff <= 1e-6 * w.abs().max().item(), f"compiled dkv: max |diff| {diff:.1e}"
        else:
            assert torch.equal(g, w), f"compiled {name}: max |diff| {diff:.1e}"
    return "compiled (fullgraph, aot_eager) = eager (bitwise; dkv on a GPU within 1e-6)"


def check_model(device: str) -> str:
    """DeepSeek-V4's debug flavor (sliding, CSA, HCA layers) with sparse_attention "triton"
    against "dense": logits and every gradient, fp32 (the hyper-connections' gradients amplify
    the softmax's different rounding to ~1e-4; tests/models/test_deepseek_v4.py shows the same
    paths agree to 1e-15 in fp64)."""
    from dataclasses import replace

    from torchloom.models import build_model
    from torchloom.models.deepseek_v4 import DEEPSEEK_V4_FLAVORS

    window = torch.randint(0, 4096, (1, 24), generator=torch.Generator().manual_seed(1))
    results = {}
    for impl in ("dense", "triton"):
        model = build_model(replace(DEEPSEEK_V4_FLAVORS["debug"], sparse_attention=impl))
        model.init_weights(0)
        model = model.to(device).train()
        logits = model(window.to(device))
        logits.pow(2).mean().backward()
        results[impl] = [logits.detach()] + [p.grad for p in model.parameters()]
    names = ["logits"] + [n for n, _ in model.named_parameters()]
    worst = 0.0
    for name, got, want in zip(names, results["triton"], results["dense"], strict=True):
        if want is not None:
            rel = _rel(got, want)
            assert rel < (1e-5 if name == "logits" else 1e-3), f"model {name}: {rel:.1e}"
            worst = max(worst, rel)
    return f"debug model, triton vs dense: logits and gradients within {worst:.1e}"


if __name__ == "__main__":  # run by test_triton_kernels_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    print("\n".join(check_triton("cpu", torch.float32, 1e-5, B=2, H=3, T=9, S=4, d=24,
                                 window=3, picks=3)))  # fmt: skip
    # K = 72 rows: two key blocks of 64, the second mostly padding.
    print("\n".join(check_triton("cpu", torch.float32, 1e-5, B=1, H=2, T=48, S=12, d=16,
                                 window=60, picks=12, bthd=True)))  # fmt: skip
    print(check_compiled("cpu"))
    print(check_model("cpu"))
