"""Grouped matrix products on the GPU: ``torch._grouped_mm`` (sm90+, bf16) against the
per-expert loop, forward and backward, and an MoE layer compiled whole around it. The loop
itself is checked against direct formulas on the CPU (tests/models/test_moe.py)."""

import pytest
import torch

from torchloom.kernels.grouped_mm import grouped_linear, grouped_mm_supported
from torchloom.models.components.moe import MoE, MoEConfig
from torchloom.models.components.param_init import ParamInit

pytestmark = pytest.mark.gpu


def _case(counts: list[int], D: int = 256, out_dim: int = 384):
    """Rows sorted by group (some groups empty), weights."""
    torch.manual_seed(0)
    M = sum(counts)
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(counts), out_dim, D, device="cuda") / D**0.5).to(torch.bfloat16)
    w.requires_grad_(True)
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    return x, w, ends


def _fp32_reference(x, w, ends, grad):
    """The definition in fp32: row block e times w[e].T, rows past the end zero."""
    x32, w32 = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    out = torch.zeros(x.shape[0], w.shape[1], device="cuda")
    lo = 0
    for e, hi in enumerate(ends.tolist()):
        out[lo:hi] = x32[lo:hi] @ w32[e].T
        lo = hi
    out.backward(grad.float())
    return out, x32.grad, w32.grad


@pytest.mark.parametrize("counts", [[37, 0, 129, 5, 0, 300, 1, 40], [0, 64, 0, 16]])
def test_grouped_mm_matches_the_loop_and_the_definition(counts) -> None:
    x, w, ends = _case(counts)
    assert grouped_mm_supported(x, w), torch.cuda.get_device_name()
    grad = torch.randn(x.shape[0], w.shape[1], device="cuda", dtype=torch.bfloat16)
    ref, ref_dx, ref_dw = _fp32_reference(x, w, ends, grad)
    results = {}
    for path in ("grouped_mm", "loop"):
        x.grad = w.grad = None
        if path == "grouped_mm":
            out = grouped_linear(x, w, ends)
        else:
            out = torch.ops.torchloom.grouped_linear_loop(x, w, ends, False)
        out.backward(grad)
        results[path] = (out.float(), x.grad.float(), w.grad.float())
    for path, (out, dx, dw) in results.items():
        errors = [(a - b).abs().max().item() / b.abs().max().item()
                  for a, b in ((out, ref), (dx, ref_dx), (dw, ref_dw))]  # fmt: skip
        print(f"{path}: relative error out {errors[0]:.1e}, dx {errors[1]:.1e}, dw {errors[2]:.1e}")
        assert max(errors) < 1e-2, (path, errors)  # bf16 rounding of the outputs
    for i in range(3):  # the two paths agree to within bf16 rounding
        torch.testing.assert_close(results["grouped_mm"][i], results["loop"][i], rtol=2e-2,
                                   atol=2e-2 * results["loop"][i].abs().max().item())  # fmt: skip


def test_compiled_moe_layer_matches_eager_on_gpu() -> None:
    """The MoE layer with its grouped products compiles as one graph (no host sync: the expert
    boundaries stay on the device) and matches eager within bf16 rounding."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=16, top_k=4, expert_dim=256, num_shared_experts=1,
                    score_func="sigmoid", num_groups=4, top_groups=2, expert_bias=True)  # fmt: skip
    layer = MoE(512, cfg).cuda()
    layer.init_weights(ParamInit(layer, 0))
    layer = layer.to(torch.bfloat16)
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = layer(x)
    eager.float().square().mean().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    compiled = torch.compile(layer, fullgraph=True)(x)
    compiled.float().square().mean().backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * b.abs().max().item())
