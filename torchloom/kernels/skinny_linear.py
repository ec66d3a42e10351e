"""Linears of a few rows (a decode step's: one row per sequence): a Triton kernel that streams
the weight once at close to the memory's speed.

A decode step at batch 1 reads every weight of the model to multiply it by one row, so its
time is the weight bytes over the memory bandwidth. cuBLAS runs such a product as a tensor-core
tile of 64 or more rows, padded, at about half the H200's bandwidth (benchmarks/RESULTS.md). In
``_skinny_linear_kernel`` each program owns ``BLOCK_N`` output features: it reads their weight
rows in contiguous ``BLOCK_K`` chunks and multiplies them by the (at most ``MAX_ROWS``) input
rows on the CUDA cores, accumulating in fp32. Many small programs keep enough loads in flight
to saturate the memory, and no program waits for another (no split-K reduction).

``SkinnyLinears`` is a torch function mode that sends ``F.linear`` calls of at most ``MAX_ROWS``
rows without gradients to the kernel, on CUDA; every other call runs as it would. The generator
holds it around its decode steps only (generate/graphs.py): prefills, the trainer (also in
another thread of the same process: modes are per thread) and batch-invariant mode are never
affected. The sums run in another order than cuBLAS's, so logits may differ in the last bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.library import wrap_triton
from torch.overrides import TorchFunctionMode

from torchloom.kernels.triton_support import jit, tl, triton_op, use_triton

MAX_ROWS = 8
"""The most input rows a linear may have to take the kernel."""

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def skinny_config(rows: int, features: int, inputs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for [rows, inputs] x [features, inputs]^T.

    BLOCK_M covers the rows. The product tile BLOCK_M x BLOCK_N x BLOCK_K stays near 4,096
    fp32 values (32 a thread at 4 warps), taking K in chunks of at least 64 (128 contiguous
    bytes of bf16 per weight row). BLOCK_N is 8 when that still gives two programs per
    streaming multiprocessor of an H200 (2 x 132), else 4, for more loads in flight."""
    block_m = _pow2(rows)
    block_n = 8 if features >= 8 * 264 else 4
    block_k = min(max(64, 4096 // (block_m * block_n)), _pow2(inputs))
    return block_m, block_n, block_k, 4


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with fp32 sums, rounded to x's dtype: what the kernel computes."""
    return (x.float() @ weight.float().T).to(x.dtype)


@jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum_k x[m, k] * w[n, k] for this program's BLOCK_N features n (x, w, out
    contiguous)."""
    n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                    other=0.0)  # fmt: skip
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                    other=0.0)  # fmt: skip
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out = out_ptr + m[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


def launch_skinny_linear(
    x_MK: torch.Tensor, weight_NK: torch.Tensor, config: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """The kernel on contiguous [M, K] and [N, K] (``config`` as ``skinny_config`` returns;
    benchmarks/skinny_linear.py passes others)."""
    (M, K), N = x_MK.shape, weight_NK.shape[0]
    block_m, block_n, block_k, warps = config or skinny_config(M, N, K)
    out = x_MK.new_empty(M, N)
    wrap_triton(_skinny_linear_kernel)[(-(-N // block_n),)](
        x_MK, weight_NK, out, M, N, K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps,
    )  # fmt: skip
    return out


@triton_op("torchloom::skinny_linear")
def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[..., K] x [N, K]^T by the kernel (at most MAX_ROWS rows; forward only)."""
    x_MK = x.reshape(-1, x.shape[-1]).contiguous()
    return launch_skinny_linear(x_MK, weight.contiguous()).view(*x.shape[:-1], weight.shape[0])


def takes_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``F.linear(x, weight, bias)`` goes to the kernel under ``SkinnyLinears``."""
    return (
        bias is None
        and use_triton(x)
        and type(x) in _PLAIN
        and type(weight) in _PLAIN  # not a DTensor (tensor parallelism) or another subclass
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
        and x.shape[-1] == weight.shape[1]
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


class SkinnyLinears(TorchFunctionMode):
    """While active (this thread only), ``F.linear`` calls that ``takes_kernel`` accepts run
    the Triton kernel; everything else runs unchanged."""

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if takes_kernel(x, weight, bias):
                return torch.ops.torchloom.skinny_linear(x, weight)
        return func(*args, **kwargs)
