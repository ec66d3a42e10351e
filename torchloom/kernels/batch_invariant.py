"""Batch-invariant ops: every output element is computed in an order that depends only on its
own inputs, never on how many other rows share the call, where the row sits in it, or how long
the sequence around it is. So a token's numbers do not change with the batch it is in, and a
decode step equals the same position of a full forward pass, bit for bit.

On CUDA tensors, with Triton installed, the public functions run the fixed-tile Triton kernels
of ``batch_invariant_triton`` (and the Triton RMSNorm and SwiGLU). Everywhere else they run the
CPU references below, which fix the order explicitly instead of trusting a library's:

- **Sums** are ``fixed_order_sum``: a pairwise tree of elementwise adds (lane i with lane
  i + half, halving until one is left) over the reduced dim zero-padded to a power of two.
  Elementwise IEEE adds round the same in ATen's vector and scalar loops, on any thread split,
  so an element's sum depends on its own terms alone. Padding a power-of-two tree with more
  zeros adds exact zeros, so the result does not even depend on the padded width.
  (torch's own ``sum``/``matmul`` choose their blocking, vector path and thread split from the
  whole tensor's shape: a row's result can change with its neighbours.)
- **Transcendental pointwise ops** (exp, silu, cos, sin) are ``pointwise``: applied so that
  every element goes through ATen's vector loop. ATen computes the tail of a vector loop (and
  of each thread's share) with the scalar libm function, which can round differently from the
  vector one (measured: ``F.silu`` in fp32 on AVX-512), so without this an element's value
  depends on where it falls in the flattened tensor.
- ``linear``: products in fp32 (exact for bf16 inputs), each output a ``fixed_order_sum`` over
  the input features, rounded once to the input dtype.
- ``attention``: query (b, t) sees keys ``starts..positions``; its scores, softmax and weighted
  sum of values run over its own span, indexed from the span's start, so its output is the
  same in any batch, any padding, any cache length, and at any offset of a packed row.
- ``rms_norm``: fp32 statistics with a ``fixed_order_sum``, ``1 / sqrt`` (IEEE in every loop).

Backward passes (training in this mode) are ordinary PyTorch: correct, not batch-invariant.
These CPU references are for small models and tests; docs/batch_invariance.md says what holds
on which device.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from torchloom.kernels.attention_mask import causal_positions_and_starts, masked_attention
from torchloom.kernels.rmsnorm import rms_norm_fused
from torchloom.kernels.swiglu import swiglu_fused
from torchloom.kernels.triton_support import use_triton

MASK_FIX = "run this model with --model.batch_invariant false (its kernels are plain causal)."
"""The fix a batch-invariant site names when it refuses a mask it cannot honour."""

# A multiple of every unrolled vector step of ATen's CPU loops (2 x 64 bytes of bf16 on
# AVX-512 is 64 elements; 256 leaves room for wider vectors).
_VECTOR_SPAN = 256
# Below ATen's parallel grain size (32768 elements), so one thread runs a whole call.
_SERIAL_ELEMENTS = 127 * _VECTOR_SPAN
# Elements of the intermediate products one step of ``linear`` / ``attention`` holds.
_CHUNK_ELEMENTS = 1 << 22


def _triton_kernels(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels module for CUDA tensors when Triton is installed, else None (run the
    references). Imported on first use: importing it loads Triton."""
    if not use_triton(x):
        return None
    from torchloom.kernels import batch_invariant_triton

    return batch_invariant_triton


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Inside torch.autocast its dtype (as nn.Linear and SDPA would compute), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs (their products are exact in it), else the input's own."""
    return torch.promote_types(dtype, torch.float32)


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a pairwise tree of elementwise adds over its width rounded up to
    a power of two: the same bits for an element whatever the other elements of ``x`` are, and
    whatever zeros pad its terms on the right."""
    width = _pow2(x.shape[-1])
    if width != x.shape[-1]:
        x = F.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn``, every element through the same code: on the CPU
    the flattened input is padded to whole vector steps and run in single-threaded pieces, so
    no element lands in a loop's scalar tail. GPU kernels compute every element alike."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    padded = F.pad(flat, (0, -flat.numel() % _VECTOR_SPAN))
    out = torch.cat([fn(piece) for piece in padded.split(_SERIAL_ELEMENTS)])
    return out[: flat.numel()].view(x.shape)


# -- linear -----------------------------------------------------------------------------------


def _fixed_order_matmul(x_ND: torch.Tensor, w_MD: torch.Tensor) -> torch.Tensor:
    """x @ w.T: fp32 (or wider) products, each output a fixed_order_sum over D, rounded to x's
    dtype."""
    (N, D), M = x_ND.shape, w_MD.shape[0]
    pad = _pow2(D) - D  # padded once here rather than per chunk inside the sum
    acc = _accumulation_dtype(x_ND.dtype)
    x32, w32 = F.pad(x_ND.to(acc), (0, pad)), F.pad(w_MD.to(acc), (0, pad))
    out_NM = torch.empty(N, M, dtype=x_ND.dtype, device=x_ND.device)
    rows = max(1, _CHUNK_ELEMENTS // (M * (D + pad)))
    for start in range(0, N, rows):
        products = x32[start : start + rows, None, :] * w32[None]
        out_NM[start : start + rows] = fixed_order_sum(products)
    return out_NM


class _Linear(torch.autograd.Function):
    """The fixed-order forward with ordinary matmul gradients."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w_MD: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_ND, w_MD)
        return _fixed_order_matmul(x_ND, w_MD)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_ND, w_MD = ctx.saved_tensors
        grad_x = grad_NM @ w_MD if ctx.needs_input_grad[0] else None
        grad_w = grad_NM.T @ x_ND if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def linear(x_ND: torch.Tensor, weight_MD: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with one fixed reduction order per output element, in x's dtype (the
    autocast dtype under autocast)."""
    x_ND = x_ND.to(_compute_dtype(x_ND))
    if (kernels := _triton_kernels(x_ND)) is not None:
        return kernels.linear(x_ND, weight_MD)
    rows = x_ND.reshape(-1, x_ND.shape[-1])
    out = _Linear.apply(rows, weight_MD.to(x_ND.dtype))
    return out.reshape(*x_ND.shape[:-1], weight_MD.shape[0])


def stacking_keeps_bits(weight: torch.Tensor) -> bool:
    """Whether ``linear`` over ``weight`` stacked by rows with others gives its columns bit for
    bit as ``linear`` over it alone (generation stacks q/k/v and gate/up into one matmul:
    models/components/fused_linear.py). The references compute every output as its own
    fixed-order sum, so yes; the Triton kernel's tiling follows the weight's width, which
    changes no bit only where every tiling agrees (sm_90)."""
    if (kernels := _triton_kernels(weight)) is None:
        return True
    return kernels.tilings_agree(weight.device)


def make_linears_batch_invariant(model: torch.nn.Module) -> None:
    """Route every nn.Linear of ``model`` through ``linear`` (forward patched in place, so the
    parameter names stay)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module.bias is not None:
                raise ValueError("batch-invariant linear layers take no bias")
            module.forward = lambda x, m=module: linear(x, m.weight)


# -- attention --------------------------------------------------------------------------------


def _fixed_order_attention(
    q_BHTd: torch.Tensor,
    k_BKLd: torch.Tensor,
    v_BKLd: torch.Tensor,
    positions_BT: torch.Tensor,
    starts_BT: torch.Tensor,
) -> torch.Tensor:
    """Every query over its own keys, gathered from its span's start (slot j = key start + j),
    in fp32 (or wider); chunks of queries bound the [queries, heads, span, head_dim] products."""
    B, H, T, d = q_BHTd.shape
    K, L = k_BKLd.shape[1], k_BKLd.shape[2]
    group = H // K
    last_Q = (positions_BT - starts_BT).reshape(-1).long()  # the span's last slot, per query
    starts_Q, rows_Q = starts_BT.reshape(-1).long(), torch.arange(B, device=q_BHTd.device)
    rows_Q = rows_Q.repeat_interleave(T)
    slot_W = torch.arange(_pow2(int(last_Q.max()) + 1), device=q_BHTd.device)
    # Query head h = k * group + g reads kv head k.
    acc = _accumulation_dtype(q_BHTd.dtype)
    q_QKGd = q_BHTd.to(acc).transpose(1, 2).reshape(B * T, K, group, d)
    k32, v32 = k_BKLd.to(acc), v_BKLd.to(acc)
    out_QKGd = torch.empty(B * T, K, group, d, dtype=acc, device=q_BHTd.device)
    chunk = max(1, _CHUNK_ELEMENTS // (H * len(slot_W) * d))
    for start in range(0, B * T, chunk):
        part = slice(start, start + chunk)
        index_QW = (starts_Q[part, None] + slot_W).clamp(max=L - 1)
        hidden_QW = slot_W > last_Q[part, None]
        # Indexing [rows, :, keys] puts the indexed dims first: [Q, W, K, d].
        keys_QKWd = k32[rows_Q[part, None], :, index_QW].transpose(1, 2)
        values_QKdW = v32[rows_Q[part, None], :, index_QW].permute(0, 2, 3, 1)
        scores_QKGW = fixed_order_sum(q_QKGd[part, :, :, None] * keys_QKWd[:, :, None]) * d**-0.5
        scores_QKGW = scores_QKGW.masked_fill(hidden_QW[:, None, None], float("-inf"))
        weights_QKGW = pointwise(torch.exp, scores_QKGW - scores_QKGW.amax(-1, keepdim=True))
        probs_QKGW = weights_QKGW / fixed_order_sum(weights_QKGW)[..., None]
        out_QKGd[part] = fixed_order_sum(probs_QKGW[:, :, :, None] * values_QKdW[:, :, None])
    return out_QKGd.reshape(B, T, H, d).transpose(1, 2).to(q_BHTd.dtype)


class _Attention(torch.autograd.Function):
    """The fixed-order forward; the backward recomputes with SDPA and takes its gradients."""

    @staticmethod
    def forward(ctx, q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT):  # type: ignore[override]
        ctx.save_for_backward(q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT)
        return _fixed_order_attention(q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT)

    @staticmethod
    def backward(ctx, grad_BHTd: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT = ctx.saved_tensors
        inputs = [t.detach().requires_grad_() for t in (q_BHTd, k_BKLd, v_BKLd)]
        with torch.enable_grad():
            out = masked_attention(*inputs, positions_BT, starts_BT)
            grads = torch.autograd.grad(out, inputs, grad_BHTd)
        return *grads, None, None


def attention(
    q_BHTd: torch.Tensor,
    k_BKLd: torch.Tensor,
    v_BKLd: torch.Tensor,
    positions_BT: torch.Tensor,
    starts_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention where query (b, t) sees keys ``starts[b, t] .. positions[b, t]`` of row
    b (key index = position); softmax scale 1/sqrt(d); GQA by head groups; in q's dtype (the
    autocast dtype under autocast)."""
    q_BHTd = q_BHTd.to(_compute_dtype(q_BHTd))
    if (kernels := _triton_kernels(q_BHTd)) is not None:
        return kernels.attention(q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT)
    if starts_BT is None:
        starts_BT = torch.zeros_like(positions_BT)
    k_BKLd, v_BKLd = k_BKLd.to(q_BHTd.dtype), v_BKLd.to(q_BHTd.dtype)
    return _Attention.apply(q_BHTd, k_BKLd, v_BKLd, positions_BT, starts_BT)


def causal_attention(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | None,
) -> torch.Tensor:
    """The attention backend form (training and full forwards): positions 0..T-1, each query
    seeing its own document's earlier tokens."""
    q_BHTd = q_BHTd.to(_compute_dtype(q_BHTd))
    if (kernels := _triton_kernels(q_BHTd)) is not None:
        return kernels.causal_attention(q_BHTd, k_BKTd, v_BKTd, doc_ids_BT)
    B, _, T, _ = q_BHTd.shape
    positions_BT, starts_BT = causal_positions_and_starts(B, T, doc_ids_BT, q_BHTd.device)
    return attention(q_BHTd, k_BKTd, v_BKTd, positions_BT, starts_BT)


# -- norm and gate ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as ``kernels.rmsnorm.rms_norm`` computes it (fp32 statistics, the normalized row
    cast back, then the weight), each row's mean square a fixed_order_sum. On CUDA the Triton
    kernel, one program per row."""
    if use_triton(x):
        return rms_norm_fused(x, weight, eps)
    x32 = x.float()
    mean_square = fixed_order_sum(x32 * x32) / x.shape[-1]
    inverse_rms = torch.sqrt(mean_square + eps).reciprocal()  # IEEE ops: no vector/scalar split
    return weight * (x32 * inverse_rms[..., None]).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with the silu through ``pointwise``; on CUDA the Triton kernel."""
    if use_triton(gate):
        return swiglu_fused(gate, up)
    return pointwise(F.silu, gate) * up
