"""Manifold-constrained hyper-connections (mHC; Xie et al. 2026, DeepSeek-V4 §2.2): the residual
stream is ``streams`` copies of the hidden state ([B, T, N, D]) instead of one.

Around each branch (attention or feed-forward) one ``HyperConnection`` computes, per token and
from all N streams (flattened, RMS-scaled without a weight, one linear ``fn``):

- ``pre`` [N]: sigmoid weights that collapse the N streams into the branch's input;
- ``post`` [N]: 2 * sigmoid weights that spread the branch's output over the N streams;
- ``comb`` [N, N]: how the N streams mix into the next N, made doubly stochastic by Sinkhorn-
  Knopp iterations (a softmax over rows, then alternating column and row normalisations; on
  the GPU one Triton kernel each way, kernels/sinkhorn.py).

The stream after the branch is ``post * branch + comb^T @ streams``. Everything is computed in
fp32 whatever the model's dtype (DeepSeek keeps these modules in fp32), also under the trainer's
bf16 autocast, which would otherwise run ``fn`` and the stream mixing in bf16 and round the
fp32 residual streams to bf16 at every join. ``HyperHead`` collapses the N streams into one
before the final norm with its own ``pre`` weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchloom.kernels.sinkhorn import sinkhorn_fused
from torchloom.models.components.param_init import ParamInit


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, without a weight (the statistics in fp32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_scaled_linear(streams_BTND: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.linear(unweighted_rms_norm(streams flattened), weight)`` in fp32, with the norm's
    per-token scale applied to the [.., mixes] product instead of the [.., N * D] input: the same
    value (the scale is one number per token), without writing a normalised copy of the streams
    for the matmul to read back."""
    flat_BTM = streams_BTND.flatten(2).float()
    rstd_BT1 = torch.rsqrt(flat_BTM.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat_BTM, weight.float()) * rstd_BT1


def _no_autocast(x: torch.Tensor) -> torch.autocast:
    """A context that turns autocast off on ``x``'s device (fp32 mixing under bf16 autocast)."""
    return torch.autocast(x.device.type, enabled=False)


class HyperConnection(nn.Module):
    """The pre/post/comb mixing around one branch: ``forward(streams_BTND) -> (post_BTN,
    comb_BTNN, branch input x_BTD)``; ``join`` adds the branch's output back."""

    def __init__(
        self, dim: int, streams: int, sinkhorn_iters: int = 20, eps: float = 1e-6,
        norm_eps: float = 1e-6, init_std: float = 0.02,
    ) -> None:  # fmt: skip
        super().__init__()
        self.streams, self.sinkhorn_iters, self.eps, self.norm_eps = (
            streams,
            sinkhorn_iters,
            eps,
            norm_eps,
        )
        self.init_std = init_std
        mixes = (2 + streams) * streams  # pre, post, comb
        self.fn = nn.Parameter(torch.empty(mixes, streams * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(mixes, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(
        self, streams_BTND: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N = self.streams
        with _no_autocast(streams_BTND):
            mixes_BTX = rms_scaled_linear(streams_BTND, self.fn, self.norm_eps)
        pre_BTN, post_BTN, comb_BTX = mixes_BTX.split([N, N, N * N], dim=-1)
        pre_base, post_base, comb_base = self.base.float().split([N, N, N * N])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre_BTN = torch.sigmoid(pre_BTN * pre_scale + pre_base) + self.eps
        post_BTN = 2 * torch.sigmoid(post_BTN * post_scale + post_base)
        comb_logits = comb_BTX.unflatten(-1, (N, N)) * comb_scale + comb_base.view(N, N)
        comb_BTNN = sinkhorn_fused(comb_logits, self.sinkhorn_iters, self.eps)
        x_BTD = (pre_BTN[..., None] * streams_BTND).sum(dim=2).to(streams_BTND.dtype)
        return post_BTN, comb_BTNN, x_BTD

    @staticmethod
    def join(
        streams_BTND: torch.Tensor, branch_BTD: torch.Tensor, post_BTN: torch.Tensor,
        comb_BTNN: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """post * branch + comb^T @ streams: the N streams after the branch."""
        dtype = streams_BTND.dtype
        post_BTN1, comb_BTNN1 = post_BTN.to(dtype)[..., None], comb_BTNN.to(dtype)[..., None]
        # comb^T @ streams as N multiply-adds of whole streams rather than a batched [N, N] x
        # [N, D] matmul per token: compiled, the mixing and the spread are one pass over the
        # streams (a bmm writes its product out and the add reads it back).
        out_BTND = post_BTN1 * branch_BTD[..., None, :]
        for n in range(streams_BTND.shape[-2]):
            out_BTND = out_BTND + comb_BTNN1[..., n, :, :] * streams_BTND[..., n, None, :]
        return out_BTND

    def init_weights(self, init: ParamInit) -> None:
        """fn normal(0, init_std), base 0, scale 1 (DeepSeek-V4's initialisation)."""
        init.normal_(self.fn, self.init_std)
        init.zeros_(self.base)
        init.ones_(self.scale)

    def flops_per_token(self, seq_len: int) -> int:
        return 6 * self.fn.numel()


class HyperHead(nn.Module):
    """The N streams collapsed into one hidden state before the final norm (sigmoid weights
    from the RMS-scaled streams, as a HyperConnection's ``pre``)."""

    def __init__(
        self, dim: int, streams: int, eps: float = 1e-6, norm_eps: float = 1e-6,
        init_std: float = 0.02,
    ) -> None:  # fmt: skip
        super().__init__()
        self.eps, self.norm_eps, self.init_std = eps, norm_eps, init_std
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * dim, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(streams, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams_BTND: torch.Tensor) -> torch.Tensor:
        with _no_autocast(streams_BTND):
            mixes_BTN = rms_scaled_linear(streams_BTND, self.hc_fn, self.norm_eps)
        pre_BTN = torch.sigmoid(mixes_BTN * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre_BTN[..., None] * streams_BTND).sum(dim=2).to(streams_BTND.dtype)

    def init_weights(self, init: ParamInit) -> None:
        init.normal_(self.hc_fn, self.init_std)
        init.zeros_(self.hc_base)
        init.ones_(self.hc_scale)
