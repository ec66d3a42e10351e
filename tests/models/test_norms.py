"""RMSNorm against its formula, in fp32 and in bf16."""

from __future__ import annotations

import torch

from torchloom.models.components.norms import NORM_IMPLS, RMSNorm, ZeroCenteredRMSNorm


def test_rmsnorm_matches_formula() -> None:
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(2, 3, 8)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, atol=1e-6, rtol=1e-6)


def test_bf16_is_normalized_in_fp32_then_cast() -> None:
    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16) * 100
    out = norm(x)
    assert out.dtype == torch.bfloat16
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_reset_parameters_and_registry() -> None:
    norm = NORM_IMPLS["torch"](4, 1e-5)
    assert isinstance(norm, RMSNorm)
    with torch.no_grad():
        norm.weight.zero_()
    norm.reset_parameters()
    torch.testing.assert_close(norm.weight.detach(), torch.ones(4))


def test_zero_centered_scales_by_one_plus_weight_in_fp32() -> None:
    """(1 + w) applied in fp32 before the single cast (Qwen3-Next, Gemma 3): in bf16 that is
    not RMSNorm with weight 1 + w rounded to bf16."""
    norm = ZeroCenteredRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 64))
    x = torch.randn(4, 64) * 10
    x32 = x.double()
    expected = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)
    torch.testing.assert_close(norm(x).double(), expected, atol=1e-5, rtol=1e-5)
    out = norm.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    x32 = x.to(torch.bfloat16).float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    weight = 1.0 + norm.weight.float()
    torch.testing.assert_close(out, (normed * weight).to(torch.bfloat16), atol=0, rtol=0)
