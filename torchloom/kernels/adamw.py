"""AdamW with the gradient clip folded in, and the gradients' squared norm: Triton kernels.

``adamw_step_`` updates each parameter and its two moments in one pass over memory, as torch's
AdamW computes them (decoupled weight decay, then the moments, then the bias-corrected step),
and multiplies the gradient by the clip coefficient on the way in. Clipping therefore costs no
pass of its own: torch's path writes every scaled gradient back before its fused AdamW reads it
again. ``squared_norm_partials`` sums each block of a gradient's squares in fp32 into one slot
of a buffer, so the total (``buffer.sum()``) is the same every run: there are no atomics.

The step count, the learning rate and the clip coefficient are read from device tensors, so a
CUDA graph can capture the step and replay it with new values. Run on CUDA, or on CPU tensors
under ``TRITON_INTERPRET=1`` (the tests); the callers pick torch's kernels everywhere else.
"""

from __future__ import annotations

import torch

from torchloom.kernels.triton_support import jit, tl, triton

_BLOCK = 2048  # elements per program: 8 per thread at 8 warps, one 16-byte load of bf16 each
_WARPS = 8


@jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, lr_ptr, scale_ptr,
    n, lr, beta1, beta2, eps, weight_decay,
    LR_ON_DEVICE: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)  # already counts this step
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        grad = grad * tl.load(scale_ptr)
    param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    param = param * (1.0 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    denom = tl.sqrt(exp_avg_sq) / tl.sqrt(bias_correction2) + eps
    param = param - (lr / bias_correction1) * exp_avg / denom
    tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


@jit
def _squared_norm_kernel(x_ptr, out_ptr, first, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + first + tl.program_id(0), tl.sum(x * x, axis=0))


def adamw_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One AdamW step in place for every parameter, the gradients multiplied by ``grad_scale``
    (a one-element fp32 tensor, e.g. the clip coefficient) first. ``steps`` are each parameter's
    float32 step count on its device, already incremented for this step; ``lr`` may be a
    one-element device tensor. Gradients are not modified."""
    if triton is None:
        raise RuntimeError("adamw_step_ needs Triton: pip install triton (Linux)")
    lr_on_device = isinstance(lr, torch.Tensor)
    for tensors in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        param = tensors[0]
        for t in tensors[:4]:
            if t.shape != param.shape or not t.is_contiguous():
                raise ValueError(
                    f"the Triton AdamW needs each parameter, its gradient and moments contiguous "
                    f"and of its shape; got a {tuple(param.shape)} parameter with a "
                    f"{tuple(t.shape)} tensor of strides {t.stride()}. Use "
                    "--optimizer.implementation fused for such parameters."
                )
        n = param.numel()
        if n == 0:
            continue
        step = tensors[4]
        _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
            *tensors[:4], step,
            lr if lr_on_device else step, grad_scale if grad_scale is not None else step,
            n, 0.0 if lr_on_device else float(lr), beta1, beta2, eps, weight_decay,
            LR_ON_DEVICE=lr_on_device, SCALED=grad_scale is not None, BLOCK=_BLOCK,
            num_warps=_WARPS,
        )  # fmt: skip


def squared_norm_partials(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp32 sums of squares of every ``_BLOCK`` elements of every tensor (contiguous, one
    device); their sum is the squared 2-norm of all of them, the same every run."""
    if triton is None:
        raise RuntimeError("squared_norm_partials needs Triton: pip install triton (Linux)")
    blocks = [triton.cdiv(t.numel(), _BLOCK) for t in tensors]
    total = sum(blocks)  # every block writes its own slot; nothing to sum gives one zero
    make = torch.empty if total else torch.zeros
    out = make(max(1, total), dtype=torch.float32, device=tensors[0].device)
    start = 0
    for t, count in zip(tensors, blocks, strict=True):
        if not t.is_contiguous():
            raise ValueError("squared_norm_partials needs contiguous tensors")
        if count:
            _squared_norm_kernel[(count,)](t, out, start, t.numel(), BLOCK=_BLOCK, num_warps=_WARPS)
        start += count
    return out
