"""Optional Triton for the fused kernels (rmsnorm, rope, swiglu).

Triton is imported when installed and skipped otherwise, so CPU-only installs still import
every kernel module and run the PyTorch references. Set ``TRITON_INTERPRET=1`` before the first
import to run the kernels on CPU tensors through Triton's interpreter (the tests do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the kernels below are defined but never launched
    triton = None
    tl = None

F = TypeVar("F", bound=Callable[..., object])


def jit(fn: F) -> F:
    """``triton.jit`` when Triton is installed; otherwise ``fn`` unchanged."""
    return fn if triton is None else triton.jit(fn)


def triton_op(
    name: str, backward: Callable | None = None, setup_context: Callable | None = None
) -> Callable[[F], F]:
    """``torch.library.triton_op`` (no mutated inputs), with ``backward`` registered as its
    autograd formula. Without Triton the function stays a plain function: its kernels could
    never launch, and torch would log a warning for every op it registers."""

    def register(fn: F) -> F:
        if triton is None:
            return fn
        op = torch.library.triton_op(name, fn, mutates_args=())
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return register


def use_triton(x: torch.Tensor) -> bool:
    """Whether the public ops take their Triton path for ``x``: on CUDA, with Triton installed."""
    return triton is not None and x.is_cuda


def cuda_index(device: torch.device) -> int:
    """The index of CUDA ``device`` ("cuda" without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_persistent_programs(device: torch.device) -> int:
    """Programs for a kernel that strides over rows: one per streaming multiprocessor on CUDA
    (a few elsewhere, i.e. under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
