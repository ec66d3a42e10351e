"""The Sinkhorn kernels (DeepSeek-V4's hyper-connection ``comb``) against the PyTorch reference:
forward values and the gradient of the logits, for several matrix sizes and iteration counts,
a token count that is not a multiple of the kernel's block, and logits wide enough that the
first normalisations move a lot. The kernels run in Triton's interpreter on the CPU (this file
as a script with TRITON_INTERPRET=1); on a GPU compiled, alone and inside a compiled
hyper-connection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from torchloom.kernels.sinkhorn import sinkhorn, sinkhorn_fused, sinkhorn_triton

CASES = [((3, 37, 4, 4), 20), ((5, 2, 2), 3), ((1, 4, 4), 1), ((70, 8, 8), 6)]


def check_against_reference(device: str) -> list[str]:
    """Forward within 1e-6 absolute (the values are probabilities), the logits' gradient within
    1e-5 of its largest entry; one line per case."""
    lines = []
    generator = torch.Generator().manual_seed(0)
    for shape, iterations in CASES:
        logits = (3 * torch.randn(shape, generator=generator)).to(device).requires_grad_()
        grad = torch.randn(shape, generator=generator).to(device)
        want = sinkhorn(logits, iterations, 1e-6)
        (want_grad,) = torch.autograd.grad(want, logits, grad)
        got = sinkhorn_triton(logits, iterations, 1e-6)
        (got_grad,) = torch.autograd.grad(got, logits, grad)
        forward = (got - want).abs().max().item()
        backward = ((got_grad - want_grad).abs().max() / want_grad.abs().max()).item()
        lines.append(f"  {shape} x {iterations} iterations: forward {forward:.1e}, "
                     f"gradient {backward:.1e} relative")  # fmt: skip
        assert forward < 1e-6 and backward < 1e-5, lines[-1]
    return lines


def test_the_public_op_is_the_reference_on_cpu() -> None:
    logits = torch.randn(6, 4, 4)
    assert torch.equal(sinkhorn_fused(logits, 20, 1e-6), sinkhorn(logits, 20, 1e-6))


def test_sinkhorn_kernels_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


@pytest.mark.gpu
def test_sinkhorn_kernels_match_the_reference_on_gpu() -> None:
    print("\n".join(check_against_reference("cuda")))


@pytest.mark.gpu
def test_compiled_hyper_connection_with_the_kernel_matches_the_reference_on_gpu(
    monkeypatch,
) -> None:
    """torch.compile traces the Sinkhorn op without a graph break (fullgraph), and a
    hyper-connection's outputs and gradients agree with the PyTorch Sinkhorn's."""
    from torchloom.models.components import hyper_connections
    from torchloom.models.components.hyper_connections import HyperConnection
    from torchloom.models.components.param_init import ParamInit

    torch.manual_seed(0)
    hc = HyperConnection(64, 4).cuda()
    hc.init_weights(ParamInit(hc, 0))
    with torch.no_grad():
        hc.base.normal_()  # comb away from uniform
    streams_BTND = torch.randn(2, 33, 4, 64, device="cuda", requires_grad=True)

    def run(module) -> list[torch.Tensor]:
        post, comb, x = module(streams_BTND)
        loss = (post.sum() + (comb * comb).sum() + x.square().sum()) / 100
        return [post, comb, x, *torch.autograd.grad(loss, [streams_BTND, *hc.parameters()])]

    compiled = run(torch.compile(hc, fullgraph=True))
    monkeypatch.setattr(hyper_connections, "sinkhorn_fused", sinkhorn)
    reference = run(hc)
    for i, (got, want) in enumerate(zip(compiled, reference, strict=True)):
        rel = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
        print(f"tensor {i}: max |diff| / max |value| {rel:.1e}")
        assert rel < 1e-4, (i, rel)


if __name__ == "__main__":  # run by test_sinkhorn_kernels_in_the_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    print(f"Triton interpreter checks ({Path(__file__).name}):")
    print("\n".join(check_against_reference("cpu")))
