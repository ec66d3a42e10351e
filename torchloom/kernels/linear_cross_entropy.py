"""The cross-entropy of the output head: from logits (``cross_entropy_sum``), or fused with the
head's matmul so the full logits tensor never exists (``linear_cross_entropy_sum``).

``linear_cross_entropy_sum(h_ND, w_VD, labels_N)`` equals
``F.cross_entropy(h_ND @ w_VD.T, labels_N, reduction="sum")`` but walks the tokens in chunks:
each chunk's logits ([chunk, V], fp32) are formed, reduced to the loss, turned into the
gradients of h and w right away (d loss / d logits = softmax - one_hot), and dropped. So the
largest activation of the head is one chunk's logits instead of [N, V] (2.1 GB in fp32 for one
4096-token sequence of a 128k vocabulary), at the price of keeping w's gradient (one fp32 copy
of the head) from the forward to the backward pass.

Each chunk's logits stay in the matmul's dtype; ``cross_entropy_and_grad_`` computes the loss
in fp32 and writes the gradient over them: on CUDA one Triton kernel that reads each row twice,
elsewhere PyTorch ops on an fp32 copy (the reference). w's gradient accumulates in fp32, on CUDA
straight from the matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from torchloom.data.packing import IGNORE_INDEX
from torchloom.kernels.triton_support import jit, tl, use_triton

DEFAULT_CHUNK_TOKENS = 4096
_BLOCK_V = 4096
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


@jit
def _cross_entropy_grad_kernel(
    logits_ptr, labels_ptr, loss_ptr, stride, V, ignore_index, BLOCK: tl.constexpr
):  # fmt: skip
    """One row per program: its loss (logsumexp - picked logit, 0 for an ignored label), then
    softmax - one_hot written over the row (all zeros for an ignored label)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    cols = tl.arange(0, BLOCK)
    # Online logsumexp, one running max and sum per lane (finite start: no inf - inf).
    m_lanes = tl.full([BLOCK], -3.0e38, tl.float32)
    s_lanes = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m_lanes, x)
        s_lanes = s_lanes * tl.exp(m_lanes - m_new) + tl.exp(x - m_new)
        m_lanes = m_new
    m = tl.max(m_lanes, 0)
    lse = m + tl.log(tl.sum(s_lanes * tl.exp(m_lanes - m), 0))
    picked = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    keep = tl.where(valid, 1.0, 0.0)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(start + cols == label, 1.0, 0.0)) * keep
        tl.store(base + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_and_grad_(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Per-token cross-entropy losses [N] in fp32 (0 where the label is ``ignore_index``); the
    logits are overwritten by the loss sum's gradient, softmax - one_hot (0 for ignored rows),
    in their own dtype. The Triton kernel on CUDA, PyTorch ops elsewhere."""
    if use_triton(logits_NV):
        return cross_entropy_and_grad_triton_(logits_NV, labels_N, ignore_index)
    logits = logits_NV.float()
    valid_N = labels_N != ignore_index
    target_N = labels_N.masked_fill(~valid_N, 0)
    lse_N = logits.logsumexp(-1)
    loss_N = torch.where(valid_N, lse_N - logits.gather(1, target_N[:, None])[:, 0], 0.0)
    grad = (logits - lse_N[:, None]).exp_()
    grad[torch.arange(len(labels_N), device=labels_N.device), target_N] -= 1.0
    logits_NV.copy_(grad * valid_N[:, None])
    return loss_N


def cross_entropy_and_grad_triton_(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``cross_entropy_and_grad_`` by the Triton kernel on any device (CPU: the interpreter)."""
    if logits_NV.dim() != 2 or logits_NV.stride(1) != 1:
        raise ValueError(
            f"cross_entropy_and_grad_ needs 2-d logits with contiguous rows; got shape "
            f"{tuple(logits_NV.shape)}, strides {logits_NV.stride()}"
        )
    N, V = logits_NV.shape
    loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    wrap_triton(_cross_entropy_grad_kernel)[(N,)](
        logits_NV, labels_N.contiguous(), loss_N, logits_NV.stride(0), V, ignore_index,
        BLOCK=_BLOCK_V, num_warps=16,
    )  # fmt: skip
    return loss_N


def _add_matmul_fp32(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` in fp32 (``a @ b`` alone when ``acc`` is None), for low-precision a, b:
    on CUDA one matmul with an fp32 output, no rounded intermediate."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32)
    product = (a @ b).float()
    return product if acc is None else acc.add_(product)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, ignore_index: int, chunk: int):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # False under no_grad
        # Matmuls in autocast's dtype if it is on (as nn.Linear would run), else in h's dtype;
        # reductions in fp32. Autocast is then off: every dtype below is explicit.
        device = h_ND.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        h, w = h_ND.to(dtype or h_ND.dtype), w_VD.to(dtype or h_ND.dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h = torch.empty_like(h_ND) if needs_grad else None
        grad_w = None
        with torch.autocast(device, enabled=False):
            for start in range(0, h_ND.shape[0], chunk):
                h_cD, y_c = h[start : start + chunk], labels_N[start : start + chunk]
                logits_cV = h_cD @ w.T
                loss += cross_entropy_and_grad_(logits_cV, y_c, ignore_index).sum()
                if not needs_grad:
                    continue
                d_logits_cV = logits_cV  # overwritten with the gradient
                grad_h[start : start + chunk] = d_logits_cV @ w
                grad_w = _add_matmul_fp32(grad_w, d_logits_cV.T, h_cD)
        if needs_grad and grad_w is None:  # no tokens
            grad_w = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
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
