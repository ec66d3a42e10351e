"""The few-row linear kernel (kernels/skinny_linear.py) against its reference, and the decode
steps that run it.

The kernel runs in Triton's interpreter on the CPU (this file as a script with
TRITON_INTERPRET=1): row, feature and input counts that are not multiples of its blocks, fp32
and bf16. There the mode's routing is checked too, on a tiny model's decode steps with the
kernel forced on. On a GPU: the kernel compiled against the reference, and the generator's
captured and compiled decode steps running it (seen in the profiler) with log-probabilities
close to those of the steps without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchloom.kernels import skinny_linear
from torchloom.kernels.skinny_linear import (
    MAX_ROWS,
    SkinnyLinears,
    skinny_config,
    skinny_linear_reference,
    skinny_linear_triton,
    takes_kernel,
)
from torchloom.models import ModelConfig, build_model, resolve_model_config

SHAPES = [(1, 5, 7), (3, 64, 200), (8, 130, 64), (2, 33, 1000)]  # rows, features, inputs
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9] * 11, [4, 4, 4], [100, 200, 300, 400], [5]]


def tiny_llama3() -> torch.nn.Module:
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    model = build_model(config)
    model.init_weights(0)
    return model.eval()


def check_against_reference(device: str) -> list[str]:
    """fp32 within 1e-5 of the largest output; bf16 within one bf16 step (2^-7 relative) of the
    fp32 sums plus 1e-3 of the largest output; one line per case."""
    lines = []
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, features, inputs in SHAPES:
            x = torch.randn(rows, inputs, generator=generator).to(device, dtype)
            weight = torch.randn(features, inputs, generator=generator).to(device, dtype)
            got = skinny_linear_triton(x, weight).float()
            want = skinny_linear_reference(x.float(), weight.float())
            scale = want.abs().max().item()
            worst = ((got - want).abs() / (want.abs() + scale)).max().item()
            lines.append(f"  {dtype} {rows} x {inputs} -> {features} "
                         f"(blocks {skinny_config(rows, features, inputs)[:3]}): {worst:.1e}")  # fmt: skip
            bound = 1e-5 if dtype == torch.float32 else 2**-7
            assert worst < bound, lines[-1]
    return lines


def check_decode_routing() -> list[str]:
    """A tiny llama3's decode steps under the mode with the kernel forced on (the CPU has no
    CUDA): every linear of one row takes it, and the step's log-probabilities stay within 1e-5
    of the plain step's; a prefill's linears (more rows than MAX_ROWS) do not."""
    from torchloom.generate.engine import Generator, Request, SamplingParams, score
    from torchloom.generate.graphs import DecodeGraphs

    skinny_linear.use_triton = lambda x: True
    calls = []
    original = skinny_linear.launch_skinny_linear

    def counted(x, weight, config=None):
        calls.append(x.shape[0])
        return original(x, weight, config)

    skinny_linear.launch_skinny_linear = counted
    model = tiny_llama3()
    requests = [Request(p, SamplingParams(max_new_tokens=3, temperature=0.0)) for p in PROMPTS]
    got, want = [], []
    for skinny, out in ((True, got), (False, want)):
        generator = Generator(model, max_batch=2, max_len=32, cuda_graphs=False)
        generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False,
                                        skinny_linears=skinny)  # fmt: skip
        out.extend(generator.generate(requests))
    assert [c.tokens for c in got] == [c.tokens for c in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
    assert len(calls) >= 7 * model.config.num_layers and set(calls) <= {1, 2}, calls
    assert worst < 1e-5, worst
    return [f"  decode steps: {len(calls)} linears on the kernel, logprobs within {worst:.1e}"]


def test_routing_rules_on_cpu() -> None:
    """On the CPU nothing takes the kernel; with CUDA faked, only gradient-free plain-tensor
    linears without a bias and of at most MAX_ROWS rows do."""
    x, weight = torch.randn(2, 16), torch.nn.Parameter(torch.randn(4, 16))
    assert not takes_kernel(x, weight, None)
    with SkinnyLinears():
        assert torch.equal(F.linear(x, weight), x @ weight.T)


def test_routing_rules_with_cuda_faked(monkeypatch) -> None:
    monkeypatch.setattr(skinny_linear, "use_triton", lambda x: True)
    weight = torch.nn.Parameter(torch.randn(4, 16))
    with torch.no_grad():
        assert takes_kernel(torch.randn(1, 3, 16), weight, None)
        assert takes_kernel(torch.randn(MAX_ROWS, 16), weight, None)
        assert not takes_kernel(torch.randn(MAX_ROWS + 1, 16), weight, None)
        assert not takes_kernel(torch.randn(1, 16), weight, torch.zeros(4))
        assert not takes_kernel(torch.randn(1, 16, dtype=torch.float64), weight.double(), None)
    assert not takes_kernel(torch.randn(1, 16), weight, None)  # a gradient is wanted


def test_skinny_linear_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_skinny_linear_matches_the_reference_on_gpu() -> None:
    print("\n".join(check_against_reference("cuda")))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["captured", "compiled"])
def test_decode_steps_run_the_kernel_on_gpu(compile: bool) -> None:
    """Captured (and compiled) bf16 decode steps with the kernel: the profiler sees it, and
    the greedy tokens' log-probabilities stay within 0.05 of the steps without it."""
    from torchloom.generate.engine import Generator, Request, SamplingParams

    model = tiny_llama3().to("cuda", torch.bfloat16)
    requests = [Request(p, SamplingParams(max_new_tokens=6, temperature=0.0)) for p in PROMPTS]
    skinny = Generator(model, max_batch=4, max_len=64, compile=compile)
    plain = Generator(model, max_batch=4, max_len=64, compile=compile, skinny_linears=False)
    assert skinny.graphs.skinny_linears and not plain.graphs.skinny_linears
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = skinny.generate(requests)
    names = {event.name for event in prof.events()}
    assert any("skinny_linear" in name for name in names), sorted(names)[:20]
    want = plain.generate(requests)
    worst = max(
        abs(a - b)
        for g, w in zip(got, want)
        for a, b, s, t in zip(g.logprobs, w.logprobs, g.tokens, w.tokens)
        if s == t
    )
    print(f"max |logprob difference| with and without the kernel: {worst:.2e}")
    assert worst < 0.05


if __name__ == "__main__":  # run by test_skinny_linear_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    print("\n".join(check_against_reference("cpu")))
    print("\n".join(check_decode_routing()))
