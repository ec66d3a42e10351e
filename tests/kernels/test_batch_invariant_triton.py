"""Batch-invariant Triton kernels (torchloom/kernels/batch_invariant_triton.py).

The same checks run twice: on the CPU in Triton's interpreter, all in one subprocess (this file
run as a script with TRITON_INTERPRET=1, which Triton reads when it is imported), with tiny fp32
shapes; and on a CUDA GPU with realistic sizes in fp32 and bf16. Every call uses the kernels'
one fixed configuration. Bitwise means ``torch.equal``; on failure the measured difference is
printed. In the interpreter ``tl.dot`` is emulated in a fixed order (every row of a tile sums
over K the same way, as tensor cores do), so the bitwise checks test our kernels' tiling and
masking on any host instead of the host BLAS behind NumPy's matmul; the GPU tests make the
same bitwise claims about the real kernels.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from torchloom.kernels import batch_invariant as reference
from torchloom.kernels import batch_invariant_triton as kernels
from torchloom.kernels.triton_support import use_triton
from torchloom.models.components.attention import sdpa_attention

TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # max |diff| / max |expected|


def _randn(*shape: int, device: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(seed)
    return torch.randn(shape, device=device, generator=generator).to(dtype)


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    tolerance = TOLERANCES[got.dtype]
    got, want = got.double().cpu(), want.double().cpu()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < tolerance, f"{name}: max |diff| / max |value| = {rel:.1e}"
    return f"{name}: max |diff| / max |value| {rel:.1e}"


def _assert_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.double() - want.double()).abs().max().item()
    assert torch.equal(got, want), f"{name}: not bitwise equal, max |diff| {diff:.2e}"


def check_matmul(device: str, dtype: torch.dtype, M: int, N: int, K: int) -> list[str]:
    """Close to a float64 matmul; each row bitwise the same with M = 1, 3 or all rows, at any
    row offset (across a tile boundary too), from a transposed view, and with leading dims;
    gradients close to torch's."""
    x_MK = _randn(M, K, device=device, dtype=dtype)
    w_NK = _randn(N, K, device=device, dtype=dtype, seed=1) / K**0.5
    full_MN = kernels.linear(x_MK, w_NK)
    report = [_assert_close(f"matmul {M}x{N}x{K}", full_MN, x_MK.double() @ w_NK.double().T)]
    alone = torch.cat([kernels.linear(x_MK[i : i + 1], w_NK) for i in range(M)])
    _assert_equal("matmul: rows one at a time vs all", alone, full_MN)
    for start in (0, M // 2, M - 3):
        _assert_equal(f"matmul: rows {start}..+3", kernels.linear(x_MK[start : start + 3], w_NK),
                      full_MN[start : start + 3])  # fmt: skip
    others = _randn(130, K, device=device, dtype=dtype, seed=2)  # x's rows cross row 128
    shifted = kernels.linear(torch.cat([others, x_MK]), w_NK)[130:]
    _assert_equal("matmul: rows after 130 others", shifted, full_MN)
    _assert_equal("matmul: transposed view", kernels.linear(x_MK.T.contiguous().T, w_NK), full_MN)
    _assert_equal("matmul: [1, M, K]", kernels.linear(x_MK[None], w_NK)[0], full_MN)

    x, w = x_MK.clone().requires_grad_(), w_NK.clone().requires_grad_()
    grad_MN = _randn(M, N, device=device, dtype=dtype, seed=3)
    got = torch.autograd.grad(kernels.linear(x, w), (x, w), grad_MN)
    want = torch.autograd.grad(x.double() @ w.double().T, (x, w), grad_MN.double())
    report += [_assert_close(f"matmul grad {n}", g, r) for n, g, r in zip("xw", got, want)]
    return [*report, f"matmul {M}x{N}x{K}: rows bitwise equal across 1/3/{M}/{M + 130} rows"]


def _qkv(device: str, dtype: torch.dtype, B: int, H: int, K: int, L: int, d: int) -> list:
    return [_randn(B, h, L, d, device=device, dtype=dtype, seed=s) for s, h in enumerate((H, K, K))]


def check_attention(
    device: str, dtype: torch.dtype, H: int, K: int, T: int, d: int, decode_at: tuple[int, ...]
) -> list[str]:
    """A sequence's rows are bitwise the same: prefilled alone, in a batch with shorter rows,
    prefilled in two chunks, and decoded one query at a time from caches of any length (exact,
    or longer with other keys past the query) next to other rows. Close to the reference."""
    q, k, v = _qkv(device, dtype, 3, H, K, T, d)
    arange_T = torch.arange(T, device=device)
    alone = kernels.attention(q[1:2], k[1:2], v[1:2], arange_T[None])[0]
    # Row 1 is the sequence; row 2 is a shorter one, padded by repeating its last position.
    positions_BT = torch.stack([arange_T, arange_T, arange_T.clamp(max=T // 3)])
    batch = kernels.attention(q, k, v, positions_BT)
    _assert_equal("attention: prefill in a batch vs alone", batch[1], alone)
    split = T // 2 + 5  # the second chunk's queries start mid key block
    chunk = kernels.attention(q[1:2, :, split:], k[1:2], v[1:2], arange_T[None, split:])[0]
    _assert_equal("attention: second prefill chunk vs whole", chunk, alone[:, split:])

    L = T + 70  # a longer cache: other keys and values past the query
    k_cache, v_cache = (_randn(3, K, L, d, device=device, dtype=dtype, seed=s) for s in (7, 8))
    k_cache[1, :, :T], v_cache[1, :, :T] = k[1], v[1]
    q_decode = _randn(3, H, 1, d, device=device, dtype=dtype, seed=9)
    for p in decode_at:
        exact = kernels.attention(q[1:2, :, p : p + 1], k[1:2, :, : p + 1], v[1:2, :, : p + 1],
                                  torch.tensor([[p]], device=device))  # fmt: skip
        _assert_equal(f"attention: decode at {p} (cache length {p + 1})", exact[0, :, 0],
                      alone[:, p])  # fmt: skip
        q_decode[1] = q[1, :, p : p + 1]
        positions_B1 = torch.tensor([[L - 1], [p], [T // 3]], device=device)
        mixed = kernels.attention(q_decode, k_cache, v_cache, positions_B1)
        _assert_equal(f"attention: decode at {p} in a batch (cache length {L})",
                      mixed[1, :, 0], alone[:, p])  # fmt: skip

    # The reference (fp64 on the CPU) with per-query starts, as after document boundaries.
    starts_BT = (positions_BT - 9).clamp(min=0) * (positions_BT % 3 == 0)
    got = kernels.attention(q, k, v, positions_BT, starts_BT)
    cpu64 = [t.cpu().double() for t in (q, k, v, positions_BT, starts_BT)]
    report = [_assert_close(f"attention H{H} K{K} T{T} d{d}", got, reference.attention(*cpu64))]
    return [*report, f"attention: bitwise prefill/batch/chunk/decode at {decode_at}"]


def check_causal_attention(
    device: str, dtype: torch.dtype, H: int, K: int, T: int, d: int
) -> list[str]:
    """The training backend form, plain causal and with packed documents: output and q/k/v
    gradients close to the normal-mode SDPA backend in fp64."""
    q, k, v = _qkv(device, dtype, 2, H, K, T, d)
    documents_BT = torch.stack([torch.arange(T) * 3 // T, torch.zeros(T, dtype=torch.long)])
    grad = _randn(2, H, T, d, device=device, dtype=dtype, seed=5)
    report = []
    for doc_ids_BT in (None, documents_BT.to(device)):
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        ours_out = kernels.causal_attention(*ours, doc_ids_BT)
        theirs = [t.double().requires_grad_() for t in (q, k, v)]
        theirs_out = sdpa_attention(*theirs, doc_ids_BT)
        got = [ours_out, *torch.autograd.grad(ours_out, ours, grad)]
        want = [theirs_out, *torch.autograd.grad(theirs_out, theirs, grad.double())]
        label = "causal_attention" + ("" if doc_ids_BT is None else " with documents")
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            report.append(_assert_close(f"{label} {name}", g, w))
    return report


def check_model_end_to_end() -> list[str]:
    """tests/generate/test_batch_invariant.py's model-level check with every batch-invariant
    op on these kernels (CPU tensors routed to them): a debug llama3's generator outputs bitwise
    the same across batch compositions and equal to the trainer's forward."""
    sys.path.insert(0, str(Path(__file__).parents[2]))  # the repository root: tests/ is a package
    from tests.generate.test_batch_invariant import check_bitwise_across_batches, invariant_model

    reference._triton_kernels = lambda x: kernels  # this subprocess only
    check_bitwise_across_batches(invariant_model("llama3"), "cpu", "llama3 debug")
    return ["llama3 debug model on the kernels: generator and trainer forward bitwise equal"]


def run_checks(checks: list[Callable[[], list[str]]]) -> int:
    failures = 0
    for check in checks:
        start = time.perf_counter()
        try:
            lines = check()
        except AssertionError as error:
            failures += 1
            lines = [f"FAIL {error}"]
        print("\n".join(lines) + f"  ({time.perf_counter() - start:.1f}s)")
    return failures


@pytest.mark.slow  # about 110 s on 2 cores: every kernel under the interpreter
def test_kernels_in_the_triton_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


GPU_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.mark.gpu
@GPU_DTYPES
def test_matmul_on_gpu(dtype: torch.dtype) -> None:
    """Narrow and wide weights (their decode tilings differ), K not a multiple of any K block;
    rows 1 and 3 take decode tiles, 40 small ones, 300 and up training-sized ones. The narrow
    weights at 40 rows: 2000 columns fit one wave of 16-column tiles, 3000 do not."""
    assert use_triton(torch.empty(0, device="cuda")), "Triton is not installed"
    print("\n".join(check_matmul("cuda", dtype, M=300, N=3000, K=2048)))
    print("\n".join(check_matmul("cuda", dtype, M=40, N=5000, K=2000)))
    print("\n".join(check_matmul("cuda", dtype, M=40, N=3000, K=2048)))
    print("\n".join(check_matmul("cuda", dtype, M=40, N=2000, K=2000)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_tiling_the_rule_picks_is_one_the_gpu_test_checks(monkeypatch, dtype) -> None:
    """The rule on sm_90 (tilings follow M, N and K) picks only tilings in
    ``possible_matmul_configs``, the set ``test_matmul_tilings_agree_on_gpu`` checks bit for bit
    against each other; one it did not list would break invariance unseen. Run on the CPU with
    an H100's 132 multiprocessors: the decode rule's choices for the 1B's weights included."""
    monkeypatch.setattr(kernels, "_tiling_follows_rows", lambda index: True)
    monkeypatch.setattr(kernels, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    possible = kernels.possible_matmul_configs(dtype)
    for M in (1, 8, 16, 17, 64, 65, 512, 8192):
        for N in (512, 2048, 3072, 4096, 16384, 128256):
            for K in (2048, 8192):
                config = kernels.matmul_config(M, N, K, dtype, cuda)
                assert config in possible, (M, N, K, config)
    if dtype != torch.float32:  # the decode tilings of narrow weights (s49, H100)
        assert kernels.matmul_config(1, 2048, 8192, dtype, cuda) == kernels.MatmulConfig(
            16, 16, 1024, 4, 3
        )  # down: 128 tiles of 16 columns, one wave
        assert kernels.matmul_config(1, 3072, 2048, dtype, cuda) == kernels.MatmulConfig(
            16, 64, 256, 4, 4
        )  # stacked q/k/v: 192 tiles of 16 columns would be two waves
    if dtype != torch.float32:  # 64 rows (s50, H100; fp16 since s52)
        assert kernels.matmul_config(64, 2048, 8192, dtype, cuda) == kernels.MatmulConfig(
            64, 16, 128, 4, 6
        )  # down: one wave of 16-column tiles
        assert kernels.matmul_config(40, 3072, 2048, dtype, cuda) == kernels.MatmulConfig(
            64, 32, 128, 4, 4
        )  # stacked q/k/v: 96 tiles of 32 columns


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmul_tilings_agree_on_gpu(dtype: torch.dtype) -> None:
    """What lets the tiling follow M on Hopper: every tiling ``matmul_config`` can choose (and
    every alternative the benchmarks time for it) gives bitwise the same output. Elsewhere the
    property is not assumed (one tiling per weight)."""
    if not kernels._tiling_follows_rows(torch.cuda.current_device()):
        pytest.skip("the tiling follows M only on sm_90; other GPUs use one tiling per weight")
    configs = kernels.checked_matmul_configs(dtype)
    x_MK = _randn(200, 2000, device="cuda", dtype=dtype)
    w_NK = _randn(5000, 2000, device="cuda", dtype=dtype, seed=1) / 2000**0.5
    outputs = {}
    for config in configs:
        outputs[config] = torch.full((200, 5000), float("nan"), device="cuda", dtype=dtype)
        kernels.launch_matmul(x_MK, w_NK, outputs[config], config)
    reference_config, reference = outputs.popitem()
    for config, out in outputs.items():
        _assert_equal(f"matmul tiling {config} vs {reference_config}", out, reference)


@pytest.mark.gpu
@GPU_DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_on_gpu(dtype: torch.dtype, head_dim: int) -> None:
    decode_at = (0, 1, 63, 64, 200, 511)
    print("\n".join(check_attention("cuda", dtype, 32, 8, 512, head_dim, decode_at)))
    print("\n".join(check_causal_attention("cuda", dtype, 32, 8, 512, head_dim)))


@pytest.mark.gpu
def test_dispatch_and_compile_on_gpu() -> None:
    """batch_invariant's public functions take the kernels for CUDA tensors; torch.compile
    traces them (fullgraph) to the same numbers, backward included."""
    x = _randn(40, 256, device="cuda", dtype=torch.bfloat16)
    w = _randn(512, 256, device="cuda", dtype=torch.bfloat16, seed=1)
    _assert_equal("dispatch: linear", reference.linear(x, w), kernels.linear(x, w))
    q, k, v = (t.requires_grad_() for t in _qkv("cuda", torch.bfloat16, 2, 8, 2, 100, 64))
    doc_ids_BT = (torch.arange(100, device="cuda") >= 30).long().expand(2, -1)

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out_BHTd = reference.causal_attention(q, k, v, doc_ids_BT)
        return reference.linear(out_BHTd.transpose(1, 2).flatten(2), w.T.contiguous())

    grad = _randn(2, 100, 256, device="cuda", dtype=torch.bfloat16, seed=4)
    results = []
    for fn in (forward, torch.compile(forward, fullgraph=True)):
        out = fn(q, k, v)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    (eager_out, *eager_grads), (compiled_out, *compiled_grads) = results
    _assert_equal("compiled vs eager forward", compiled_out, eager_out)
    for name, got, want in zip(("dq", "dk", "dv"), compiled_grads, eager_grads):
        print(_assert_close(f"compiled vs eager {name}", got, want))


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter calls int() on a 1-element array for a runtime range() bound,
    which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _fixed_order_dot_in_interpreter() -> None:
    """``tl.dot`` as a GPU's tensor cores compute it for the purpose of these checks: every row
    of a tile accumulates over K in the same increasing order. The interpreter's own dot is
    ``np.matmul``, whose rounding follows the host's BLAS kernel (a row's place in the tile,
    the CPU vendor, OPENBLAS_CORETYPE), so the bitwise checks below would test the host's BLAS
    rather than our kernels. Elementwise NumPy float32 multiplies and adds round alike on every
    host."""
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc_MN = d.data
        a_MK, b_KN = a.data.astype(acc_MN.dtype), b.data.astype(acc_MN.dtype)
        for k in range(a_MK.shape[-1]):  # k = 0, 1, ...: one rounding order for every row
            acc_MN = acc_MN + a_MK[..., :, k : k + 1] * b_KN[..., k : k + 1, :]
        return interpreter.TensorHandle(acc_MN, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if __name__ == "__main__":  # run by test_kernels_in_the_triton_interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    _patch_interpreter_for_numpy_2_4()
    _fixed_order_dot_in_interpreter()
    fp32 = torch.float32  # the interpreter has no bf16 matmul
    sys.exit(run_checks([
        lambda: check_matmul("cpu", fp32, M=37, N=150, K=200),
        lambda: check_attention("cpu", fp32, H=4, K=2, T=150, d=16, decode_at=(0, 63, 64, 149)),
        lambda: check_attention("cpu", fp32, H=3, K=1, T=40, d=24, decode_at=(5, 39)),
        lambda: check_causal_attention("cpu", fp32, H=4, K=2, T=200, d=16),
        check_model_end_to_end,
    ]))  # fmt: skip
