"""The cross-entropy of the output head: from logits (``cross_entropy_sum``), or fused with the
head's matmul so the full logits tensor never exists (``linear_cross_entropy_sum``).

``linear_cross_entropy_sum(h_ND, w_VD, labels_N)`` equals
``F.cross_entropy(h_ND @ w_VD.T, labels_N, reduction="sum")`` but walks the tokens in chunks:
each chunk's logits ([chunk, V], fp32) are formed, reduced to the loss, turned into the
gradients of h and w right away (d loss / d logits = softmax - one_hot), and dropped. So the
largest activation of the head is one chunk's logits instead of [N, V] (2.1 GB in fp32 for one
4096-token sequence of a 128k vocabulary), at the price of keeping w's gradient (one fp32 copy
of the head) from the forward to the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value that contributes no loss (padding, prompt tokens in SFT, document ends)."""
DEFAULT_CHUNK_TOKENS = 2048
LOSS_IMPLS = ("full", "chunked")
"""Model config ``loss_impl``: full logits then cross-entropy, or the chunked fused head."""


def cross_entropy_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropies in fp32, skipping labels equal to IGNORE_INDEX."""
    return F.cross_entropy(
        logits_BTV.flatten(0, 1).float(),
        labels_BT.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, ignore_index: int, chunk: int):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # False under no_grad
        # Matmuls in h's dtype (bf16 under autocast, as nn.Linear would run), reductions in fp32.
        w = w_VD.to(h_ND.dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h = torch.empty_like(h_ND) if needs_grad else None
        grad_w = (
            torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if needs_grad else None
        )
        for start in range(0, h_ND.shape[0], chunk):
            h_cD, y_c = h_ND[start : start + chunk], labels_N[start : start + chunk]
            logits_cV = (h_cD @ w.T).float()
            valid_c = y_c != ignore_index
            target_c = y_c.masked_fill(~valid_c, 0)
            lse_c = logits_cV.logsumexp(-1)
            picked_c = logits_cV.gather(1, target_c[:, None])[:, 0]
            loss += torch.where(valid_c, lse_c - picked_c, 0.0).sum()
            if not needs_grad:
                continue
            d_logits_cV = (logits_cV - lse_c[:, None]).exp_()  # softmax, in place
            d_logits_cV[torch.arange(len(y_c), device=y_c.device), target_c] -= 1.0
            d_logits_cV *= valid_c[:, None]
            d_logits_cV = d_logits_cV.to(h_ND.dtype)
            grad_h[start : start + chunk] = d_logits_cV @ w
            grad_w += (d_logits_cV.T @ h_cD).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w_VD.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h * grad_loss.to(grad_h.dtype),
            (grad_w * grad_loss).to(ctx.w_dtype),
            None,
            None,
            None,
        )


def linear_cross_entropy_sum(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(h @ w.T, labels) in fp32, skipping ``ignore_index``."""
    return _ChunkedLinearCrossEntropy.apply(h_ND, w_VD, labels_N, ignore_index, chunk_tokens)
