"""The PyTorch form of fla's chunk-parallel gated delta-rule gradients (``chunk_bwd_dqkwg``)
against autograd of what that step differentiates: per chunk, the output from the chunk's
state and its own rows, the next state, and the delta correction's ``-w @ h``."""

import itertools
import math
import sys
import types

import pytest
import torch

from torchloom.kernels import fla_backend
from torchloom.kernels.fla_backend import chunk_bwd_dqkwg, triton_kernel_fits


def _autograd_grads(q, k, v, do, h, dh, w, g, dv, scale, spans, BT, state_v_first):
    """dq, dk, dw, dg of sum(do * o) + sum(dh * h_next) - sum(dv * (w @ h)), chunk by chunk
    (fp64; g in log2 units, so dg comes back divided by ln 2 as fla's kernel leaves it)."""
    B, T, H, HV = *k.shape[:3], v.shape[2]
    leaves = [
        x.detach().double().reshape(B * T, *x.shape[2:]).requires_grad_() for x in (q, k, w, g)
    ]
    q_, k_, w_, g_ = leaves
    v_, do_, dv_ = (x.double().reshape(B * T, *x.shape[2:]) for x in (v, do, dv))
    h_, dh_ = (x.double().reshape(-1, HV, *x.shape[-2:]) for x in (h, dh))
    if state_v_first:
        h_, dh_ = h_.transpose(-1, -2), dh_.transpose(-1, -2)
    loss, chunk = 0.0, 0
    for start, end in spans:
        for r0 in range(start, end, BT):
            r = slice(r0, min(r0 + BT, end))
            for head in range(HV):
                qh, kh = q_[r, head * H // HV], k_[r, head * H // HV]
                vh, gh, state = v_[r, head], g_[r, head], h_[chunk, head]
                A = (qh @ kh.T * torch.exp2(gh[:, None] - gh[None, :])).tril()
                o = scale * torch.exp2(gh)[:, None] * (qh @ state) + scale * A @ vh
                nxt = torch.exp2(gh[-1]) * state + (kh * torch.exp2(gh[-1] - gh)[:, None]).T @ vh
                loss = loss + (do_[r, head] * o).sum() + (dh_[chunk, head] * nxt).sum()
                loss = loss - (dv_[r, head] * (w_[r, head] @ state)).sum()
            chunk += 1
    loss.backward()
    dq, dk, dw, dg = (x.grad for x in leaves)
    return dq.view(q.shape), dk.view(k.shape), dw.view(w.shape), dg.view(g.shape) / math.log(2)


CASES = {  # B, T, cu_seqlens, state_v_first
    "batch-whole-chunks": (2, 48, None, False),
    "batch-partial-chunk": (2, 45, None, False),
    "varlen": (1, 60, [0, 5, 21, 24, 60], False),
    "varlen-state-v-first": (1, 40, [0, 17, 40], True),
}


def _inputs(B, T, cu_seqlens, state_v_first, K, V, H=2, HV=4, BT=16):
    """Random step inputs (fp32) in fla's layouts, and each sequence's (start, end) row."""
    lengths = [T] * B if cu_seqlens is None else [b - a for a, b in itertools.pairwise(cu_seqlens)]
    starts = [i * T for i in range(B)] if cu_seqlens is None else cu_seqlens[:-1]
    spans = [(s, s + n) for s, n in zip(starts, lengths)]
    C = sum(-(-n // BT) for n in lengths)
    rows = B if cu_seqlens is None else 1
    h = torch.randn(rows, C // rows, HV, *((V, K) if state_v_first else (K, V)))
    # fla's g: the log2 decay summed within each chunk (so it restarts at every chunk start)
    g = -torch.rand(B, T, HV)
    flat = g.view(B * T, HV)
    for s, e in spans:
        for r0 in range(s, e, BT):
            flat[r0 : min(r0 + BT, e)] = flat[r0 : min(r0 + BT, e)].cumsum(0)
    inputs = {
        "q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, HV, V),
        "do": torch.randn(B, T, HV, V), "h": h, "dh": torch.randn_like(h),
        "w": torch.randn(B, T, HV, K), "g": g, "dv": torch.randn(B, T, HV, V), "scale": 0.3,
        "state_v_first": state_v_first, "chunk_size": BT,
        "cu_seqlens": None if cu_seqlens is None else torch.tensor(cu_seqlens),
    }  # fmt: skip
    return inputs, spans


@pytest.mark.parametrize("case", CASES)
def test_chunk_bwd_dqkwg_matches_autograd(case):
    torch.manual_seed(0)
    x, spans = _inputs(*CASES[case], K=8, V=6)
    got = chunk_bwd_dqkwg(**x)
    want = _autograd_grads(
        *(x[n] for n in ("q", "k", "v", "do", "h", "dh", "w", "g", "dv", "scale")),
        spans, x["chunk_size"], x["state_v_first"],
    )  # fmt: skip
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)


def test_chunk_bwd_dqkwg_bf16_inputs_keep_dtypes_and_stay_close():
    torch.manual_seed(1)
    B, T, H, HV, K, V, BT = 1, 70, 1, 2, 16, 16, 32
    q, k = torch.randn(B, T, H, K) * 0.3, torch.randn(B, T, H, K) * 0.3
    v, do, dv, w = (torch.randn(B, T, HV, d) for d in (V, V, V, K))
    h, dh = torch.randn(B, 3, HV, K, V), torch.randn(B, 3, HV, K, V)
    g = (-0.1 * torch.rand(B, T, HV)).view(B, T, HV)
    exact = chunk_bwd_dqkwg(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, chunk_size=BT)
    half = [x.bfloat16() for x in (q, k, v, do, h, dh, w)]
    got = chunk_bwd_dqkwg(*half[:6], w=half[6], g=g, dv=dv.bfloat16(), chunk_size=BT)
    assert [x.dtype for x in got] == [torch.bfloat16] * 3 + [torch.float32]
    for a, b in zip(got, exact):
        assert (a.float() - b).abs().max() <= 0.02 * b.abs().max()


def test_triton_kernel_takes_whole_tiles_only() -> None:
    """Head dims the Triton kernel cannot tile are refused by it; the registered backend runs
    the PyTorch form for them instead (triton_kernel_fits)."""
    assert [triton_kernel_fits(d) for d in (8, 16, 64, 96, 128)] == [False, True, True, False, True]
    x, _ = _inputs(*CASES["varlen"], K=24, V=32)
    with pytest.raises(ValueError, match="power-of-two K, V >= 16; got 24, 32"):
        chunk_bwd_dqkwg(**x, kernel="triton")


def test_registered_backend_takes_the_triton_kernel_only_when_every_head_dim_fits(
    monkeypatch,
) -> None:
    """fla's dispatch, stood in for by a fake ``fla.backends`` (no fla or GPU needed): the
    backend torchloom registers runs its Triton form only when both the key and the value head
    dims fit it, and the PyTorch form when either does not."""
    registered: dict[str, type] = {}

    class BaseBackend:
        pass

    def register(name: str):
        def add(cls: type) -> type:
            registered[name] = cls
            return cls

        return add

    backends = types.ModuleType("fla.backends")
    backends.BaseBackend, backends.register = BaseBackend, register
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.backends", backends)
    chosen: list[str] = []
    monkeypatch.setattr(fla_backend, "chunk_bwd_dqkwg", lambda **kw: chosen.append(kw["kernel"]))
    fla_backend.register.cache_clear()
    try:
        assert fla_backend.register() and set(registered) == {"common"}
    finally:
        fla_backend.register.cache_clear()  # the real fla (or none) for the other tests
    backend = registered["common"]()
    for K, V in ((16, 32), (16, 24), (24, 32), (24, 40)):
        named = {n: torch.zeros(1) for n in ("q", "do", "h", "dh", "w", "g", "dv")}
        backend.chunk_bwd_dqkwg(**named, k=torch.zeros(1, 64, 2, K), v=torch.zeros(1, 64, 2, V))
    print(f"kernels for (K, V) = (16, 32), (16, 24), (24, 32), (24, 40): {chosen}")
    assert chosen == [fla_backend.STEP_KERNEL, "torch", "torch", "torch"]


def test_triton_kernel_in_the_interpreter(run_in_triton_interpreter) -> None:
    run_in_triton_interpreter(__file__)


if __name__ == "__main__":  # run by test_triton_kernel_in_the_interpreter
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 on CPU"
    for case, args in CASES.items():
        torch.manual_seed(0)
        x, _ = _inputs(*args, K=16, V=32)
        want = chunk_bwd_dqkwg(**x)
        got = chunk_bwd_dqkwg(**x, kernel="triton")
        for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{case} {name}")
        print(f"{case}: Triton kernel matches the PyTorch form")
