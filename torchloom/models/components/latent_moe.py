"""A mixture of experts that runs at a width of its own (the ``latent_moe`` FFN kind, Muse
Spark's): the router reads the block's input x, the experts a projection of it,

    z = norm_in(W_in x),   y = W_out sum_k w_k norm_out(expert_k(z)),

where ``latent_dim`` is the experts' width, ``norm_in`` and ``norm_out`` are RMSNorms the
family gives (each expert's output is normed on its own, before its routing weight; one norm
weight shared by all experts), and there are no shared experts. Routing, dispatch, load counts,
balance loss and bias updates are the ``MoE`` layer's (models/components/moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from torchloom.models.components.moe import MoE, MoEConfig, Router
from torchloom.models.components.param_init import ParamInit


class LatentMoE(MoE):
    """``MoE`` whose experts see ``norm_in(in_proj(x))`` at ``latent_dim`` channels and whose
    summed output ``out_proj`` maps back to ``dim``; each expert output passes ``norm_out``."""

    def __init__(
        self,
        dim: int,
        latent_dim: int,
        cfg: MoEConfig,
        norm_in: nn.Module,
        norm_out: nn.Module,
        router_logit_scale: float = 1.0,
        impl: str = "torch",
        init_std: float = 0.02,
        out_std: float | None = None,
    ) -> None:
        if cfg.num_shared_experts:
            raise ValueError("LatentMoE has no shared experts")
        # MoE's experts at latent_dim; its router reads x at dim.
        super().__init__(latent_dim, cfg, impl, init_std=init_std, out_std=out_std)
        self.router = Router(dim, cfg, logit_scale=router_logit_scale)
        self.in_proj = nn.Linear(dim, latent_dim, bias=False)
        self.norm_in = norm_in
        self.norm_out = norm_out
        self.out_proj = nn.Linear(latent_dim, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        weights_NK, experts_NK, scores_NE = self.router(x_ND)
        if self.training:
            self._record(experts_NK, scores_NE, B)
        z_NL = self.norm_in(self.in_proj(x_ND))
        z_ML, ends_E, order = self.dispatcher.dispatch(z_NL, experts_NK, self.cfg.num_experts)
        y_ML = self.norm_out(self.experts(z_ML, ends_E))  # per row: commutes with the sort
        y_NKL = self.dispatcher.combine(y_ML, order, x_ND.shape[0])
        weighted_NKL = y_NKL * weights_NK[..., None].to(y_NKL.dtype)
        y_NL = weighted_NKL.sum(1, dtype=torch.float32).to(y_NKL.dtype)
        return self.out_proj(y_NL).view(B, T, D)

    def init_weights(self, init: ParamInit) -> None:
        """As MoE, plus the two projections (up at out_std, the branch's output) and norms."""
        super().init_weights(init)
        init.trunc_normal_(self.in_proj.weight, self.init_std)
        init.trunc_normal_(self.out_proj.weight, self.out_std)
        self.norm_in.init_weights(init)
        self.norm_out.init_weights(init)

    def flops_per_token(self, seq_len: int) -> int:
        """The router on dim, the two projections, top_k experts at latent_dim, 6 per weight."""
        cfg = self.cfg
        latent, dim = self.in_proj.weight.shape
        active = cfg.num_experts * dim + 2 * dim * latent + cfg.top_k * 3 * cfg.expert_dim * latent
        return 6 * active
