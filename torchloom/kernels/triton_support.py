"""Optional Triton for the fused kernels (rmsnorm, rope, swiglu).

Triton is imported when installed and skipped otherwise, so CPU-only installs still import
every kernel module and run the PyTorch references. Set ``TRITON_INTERPRET=1`` before the first
import to run the kernels on CPU tensors through Triton's interpreter (the tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def compile_sm90(
    kernel: Callable,
    arg_types: dict[str, str],
    constants: dict[str, object],
    num_warps: int = 4,
    divisible: Iterable[str] | None = None,
) -> object:
    """Compile a Triton kernel for sm_90 (H100 / H200) on any machine, with no GPU (Triton's
    bundled ptxas); Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``). Checks what
    Triton's interpreter never does: that every value keeps one type across branches and loop
    iterations. ``arg_types``: each runtime argument's Triton type ("*bf16", "*fp32", "*i64",
    "*i1", "i32", ...); ``constants``: the constexpr arguments' values; ``divisible``: the
    arguments the launcher would mark divisible by 16 (a tensor whose address is 16-byte
    aligned, an integer that is a multiple of 16), as it does on a GPU, which decides whether
    the compiler vectorises loads (default: every pointer, as a tensor from PyTorch's allocator
    is aligned)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):  # TRITON_INTERPRET=1 wraps the Python function
        kernel = JITFunction(kernel.fn)
    signature = {**arg_types, **dict.fromkeys(constants, "constexpr")}
    if divisible is None:
        divisible = [name for name, kind in arg_types.items() if kind.startswith("*")]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )


def compile_for_hopper(*args: object, **kwargs: object) -> str:
    """``compile_sm90``'s compile (the same arguments), as its resource line: "REG:<registers a
    thread> ... STACK:<bytes of stack frame> ... LOCAL:<bytes of local arrays> ...
    SPILLS:<bytes of registers spilled>" (spills from ptxas's own report, run again with
    Triton's flags: the stack frame is not a spill count)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    compiled = compile_sm90(*args, **kwargs)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin.write_bytes(compiled.asm["cubin"])
        ptx.write_text(compiled.asm["ptx"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        # Spills show only in ptxas's own report (the stack frame holds more than spills):
        # ptxas again, with the flags Triton gave it, so it allocates the same registers.
        ptxas = get_ptxas(90).path if get_ptxas.__code__.co_argcount else get_ptxas().path
        report = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
                                 "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "again")],
                                capture_output=True, text=True, check=True).stderr  # fmt: skip
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
    line = next(line.strip() for line in usage.splitlines() if "REG:" in line)
    if re.findall(r"Used (\d+) registers", report) != re.findall(r"REG:(\d+)", line):
        raise RuntimeError(f"ptxas's second run allocated other registers: {report} / {line}")
    return f"{line} SPILLS:{spills}"


def cuda_index(device: torch.device) -> int:
    """The index of CUDA ``device`` ("cuda" without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_persistent_programs(device: torch.device) -> int:
    """Programs for a kernel that strides over rows: one per streaming multiprocessor on CUDA
    (a few elsewhere, i.e. under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
