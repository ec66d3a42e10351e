"""Run a test file as a script under Triton's interpreter, then compile every kernel it launched
for sm_90 (H100 / H200) with the same arguments' types, constants and warps.

    TRITON_INTERPRET=1 python tests/sm90_launches.py tests/kernels/test_log_softmax.py

The interpreter runs a kernel's Python body on NumPy and never type-checks it as the compiler
does: a value that changes type across branches or loop iterations runs there and fails to
compile on the GPU. This bootstrap (what the ``run_in_triton_interpreter`` fixture starts)
records each launch (with the arguments the launcher would mark divisible by 16, as on a GPU)
and compiles each distinct one with Triton's bundled ptxas
(``kernels/triton_support.compile_for_hopper``): no GPU needed. The compiles run in a second
process without TRITON_INTERPRET (the interpreter patches ``triton.language`` in place). It
exits non-zero, naming the kernel, if any fails.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys

import torch
from triton.runtime import interpreter
from triton.runtime.jit import JITFunction

from torchloom.kernels.triton_support import compile_for_hopper

_POINTER_TYPES = {
    torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
    torch.float64: "*fp64", torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16",
    torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1",
}  # fmt: skip


def _type_of(value: object) -> str | None:
    """The Triton type the launcher would give ``value``; None: passed as a constant."""
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _divisible(value: object) -> bool:
    """Whether the launcher marks ``value`` divisible by 16 (an aligned tensor, an integer
    multiple of 16), which lets the compiler vectorise the loads it addresses."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


launches: dict[str, dict] = {}


def _record(function: interpreter.InterpretedFunction, args: tuple, kwargs: dict) -> None:
    kernel = JITFunction(function.fn)
    values = dict(zip((p.name for p in kernel.params), args))
    values.update((k, v) for k, v in kwargs.items() if k in kernel.arg_names)
    types, constants, divisible = {}, {}, []
    for param in kernel.params:
        value = values.get(param.name, param.default)
        kind = None if param.is_constexpr else _type_of(value)
        if kind is None:
            constants[param.name] = value
        else:
            types[param.name] = kind
            if _divisible(value):
                divisible.append(param.name)
    record = {"module": function.fn.__module__, "name": function.fn.__name__, "types": types,
              "constants": constants, "warps": kwargs.get("num_warps", 4),
              "divisible": divisible}  # fmt: skip
    try:
        key = json.dumps(record, sort_keys=True)
    except TypeError:  # a constant JSON cannot carry (a dtype object, say): named, not compiled
        record["constants"] = {k: repr(v) for k, v in constants.items()}
        record["module"], key = "<unserializable>", json.dumps(record, sort_keys=True)
    launches.setdefault(key, record)


_run = interpreter.InterpretedFunction.run


def _recording_run(self, *args, grid, warmup, **kwargs):
    _record(self, args, kwargs)
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)


def compile_all(records: list[dict]) -> None:
    """Compile each record's kernel for sm_90 (in a process where Triton compiles)."""
    failures = []
    for record in records:
        jit = getattr(importlib.import_module(record["module"]), record["name"])
        name = f"{record['module']}.{record['name']}"
        try:
            usage = compile_for_hopper(jit, record["types"], record["constants"], record["warps"],
                                       record["divisible"])  # fmt: skip
        except Exception as exc:  # report every kernel, then fail
            failures.append(f"{name} {record['constants']}: {type(exc).__name__}: {exc}"[:2000])
            continue
        registers, spills = usage.split()[0], usage.split()[-1]
        print(f"sm_90: {name} ({record['warps']} warps): {registers} {spills}")
    print(f"compiled {len(records) - len(failures)} of {len(records)} launched kernels for sm_90")
    if failures:
        sys.exit("kernels that do not compile for sm_90:\n" + "\n".join(failures))


def main() -> None:
    if sys.argv[1] == "--compile":
        compile_all(json.loads(sys.stdin.read()))
        return
    path = sys.argv[1]
    interpreter.InterpretedFunction.run = _recording_run
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:  # a script that ends with sys.exit(its checks' status)
        if done.code not in (0, None):
            raise
    skipped = [r for r in launches.values() if r["module"] in ("__main__", "<unserializable>")]
    records = [r for r in launches.values() if r not in skipped]
    for record in skipped:  # defined in the test file itself, or a constant JSON cannot carry
        print(f"not compiled for sm_90: {record['name']} ({record['module']})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__, "--compile"], input=json.dumps(records),
                            text=True, env=env, timeout=600)  # fmt: skip
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
