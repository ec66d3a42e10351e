"""torchloom's backend for fla-core's kernel dispatch: the gated delta rule's chunk-parallel
gradients (fla's ``chunk_bwd_dqkwg``), for where fla's Triton kernel is miscompiled.

fla 0.6 refuses that one kernel of its gated delta-rule backward on Hopper with Triton >= 3.4,
< 3.7.1 (fla issue #640) unless tilelang is installed. Every other kernel of the backward (the
sequential state pass among them) is sound there, and this step has nothing sequential: with
the per-chunk states ``h`` and their gradients ``dh`` already computed, every chunk's dq, dk,
dw and dg are a handful of batched matmuls. torchloom writes that step twice: in PyTorch (the
reference, checked against autograd) and as its own Triton kernel that never transposes an
accumulated product (the miscompiled pattern), and registers the kernel as a fla backend (fla's
``fla.backends.register``, the same door fla's own tilelang backend uses) that accepts the
call only where fla's kernel would be refused; fla's backward then runs whole. Triton >= 3.7.1
or tilelang still run fla's own kernels. On an H200 at 1 x 32768 (benchmarks/fla_backend.py,
2026-12-02): 3.1 ms, against 15.2 ms for the PyTorch form and 2.6 ms for fla's kernel, with
the smallest error of the three against the fp32 reference.

Shapes follow fla: q, k [B, T, H, K]; v (the delta-corrected values), do, dv [B, T, HV, V];
w [B, T, HV, K]; g [B, T, HV], the decay's cumulative sum within each chunk in log2 units;
h, dh [B, NT, HV, K, V] (V, K with ``state_v_first``), one state per chunk; with
``cu_seqlens`` the batch is one row of variable-length sequences, chunked per sequence.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from torchloom.kernels.triton_support import jit, tl

# Which form of the step the registered backend runs: "triton" (one kernel, _dqkwg_triton) or
# "torch" (batched matmuls). benchmarks/hybrid.py --fla-step sets it to compare the two.
STEP_KERNEL = "triton"
# Warps per program of the Triton form: its five fp32 accumulators need the registers of 8.
TRITON_WARPS = 8


class StepInputs(NamedTuple):
    """The tensors of fla's chunk_bwd_dqkwg (module docstring: shapes)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    h: torch.Tensor
    dh: torch.Tensor
    w: torch.Tensor
    g: torch.Tensor
    dv: torch.Tensor


def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    dv: torch.Tensor,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    kernel: str = "torch",
    **_: object,  # fla's chunk_indices: the chunks are recounted here
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Within each chunk c (rows i, j; g_last its last row's g; exp2 as fla's g is log2):

    dq = scale * exp2(g) * (do @ h_c^T) + ds @ k,   dk = exp2(g_last - g) * (v @ dh_c^T) + ds^T @ q,
    ds = scale * tril(do @ v^T * exp2(g_i - g_j)),   dw = -(dv @ h_c^T),
    dg = rowsum(dq * q) - rowsum(dk * k), plus on the last row exp2(g_last) <h_c, dh_c> + <dk, k>.

    dg is per row before fla's reverse cumulative sum; dq and dk sum over a q/k head's value
    heads. ``kernel`` "torch": batched matmuls in q's dtype, everything else in fp32 (the
    reference); "triton": one Triton program per (chunk, value head), ``_dqkwg_triton`` (what
    the fla backend runs, STEP_KERNEL)."""
    B, T, _, K = k.shape
    BT, C = chunk_size, h.shape[0] * h.shape[1]
    scale = K**-0.5 if scale is None else scale
    x = StepInputs(q, k, v, do, h, dh, w, g, dv)
    if kernel == "triton":
        chunks = _chunk_rows(B, T, BT, C, cu_seqlens, q.device)
        return _dqkwg_triton(x, chunks, scale, state_v_first, BT)
    if kernel != "torch":
        raise ValueError(f"unknown chunk_bwd_dqkwg kernel {kernel!r}: torch or triton")
    chunks = None  # whole chunks of equal sequences: plain views
    if cu_seqlens is not None or T % BT:
        chunks = _chunk_rows(B, T, BT, C, cu_seqlens, q.device)
    return _chunk_grads(x, chunks, scale, state_v_first, BT)


def _chunk_grads(
    x: StepInputs,
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    scale: float,
    state_v_first: bool,
    BT: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, do, h, dh, w, g, dv = x
    B, T, H, K = k.shape
    HV = v.shape[2]
    C, G, dev, dt = h.shape[0] * h.shape[1], HV // H, q.device, q.dtype
    if chunks is None:
        valid_CT = torch.ones(C, BT, dtype=torch.bool, device=dev)
        last_C = torch.full((C,), BT - 1, device=dev)
    else:
        rows, valid_CT, last_C = chunks

    def chunked(
        x: torch.Tensor, heads: int
    ) -> torch.Tensor:  # [B, T, heads, D] -> [C, heads, BT, D]
        if chunks is None:
            return x.reshape(C, BT, heads, -1).transpose(1, 2)
        return x.reshape(B * T, heads, -1)[rows].transpose(1, 2)

    def grouped(x_C: torch.Tensor) -> torch.Tensor:  # [C, HV, ...] -> [C, H, G, ...]
        return x_C.unflatten(1, (H, G))

    # q and k stay at their own H heads: a q/k head meets its G value heads by broadcasting,
    # or as G row blocks of one matmul ([C, H, G * BT, .] @ [C, H, BT, K]).
    q_c, k_c = chunked(q, H).to(dt), chunked(k, H).to(dt)
    q_f, k_f = q_c.float()[:, :, None], k_c.float()[:, :, None]  # [C, H, 1, BT, K]
    v_c, do_c, dv_c = (chunked(x, HV).to(dt) for x in (v, do, dv))
    g_c = chunked(g.unsqueeze(-1), HV).squeeze(-1).float()  # [C, HV, BT]
    g_last = g_c[..., -1]  # the rows past a chunk's end repeat its last row
    h_c, dh_c = h.reshape(C, HV, *h.shape[-2:]), dh.reshape(C, HV, *dh.shape[-2:])
    if state_v_first:
        h_c, dh_c = h_c.transpose(-1, -2), dh_c.transpose(-1, -2)
    hT, dhT = h_c.transpose(-1, -2).to(dt), dh_c.transpose(-1, -2).to(dt)  # [C, HV, V, K]

    dw = -(dv_c @ hT)
    dq = (do_c @ hT).float() * (torch.exp2(g_c) * scale).unsqueeze(-1)
    decay_to_end = torch.where(valid_CT[:, None], torch.exp2(g_last[..., None] - g_c), 0.0)
    dk = (v_c @ dhT).float() * decay_to_end.unsqueeze(-1)
    dg_last = torch.exp2(g_last) * torch.sum(h_c.float() * dh_c.float(), dim=(-2, -1))
    dg_last = dg_last + torch.sum(grouped(dk) * k_f, dim=(-2, -1)).flatten(1, 2)

    causal = torch.ones(BT, BT, dtype=torch.bool, device=dev).tril()
    causal = causal & valid_CT[:, None, :, None] & valid_CT[:, None, None, :]
    gap = torch.where(causal, g_c[..., :, None] - g_c[..., None, :], 0.0)
    ds = torch.where(causal, (do_c @ v_c.transpose(-1, -2)).float() * torch.exp2(gap), 0.0)
    ds = (ds * scale).to(dt)
    dq = dq + (ds.view(C, H, G * BT, BT) @ k_c).view(C, HV, BT, K).float()
    ds_T = grouped(ds).transpose(-1, -2).reshape(C, H, G * BT, BT)
    dk = dk + (ds_T @ q_c).view(C, HV, BT, K).float()
    dg = torch.sum(grouped(dq) * q_f, dim=-1) - torch.sum(grouped(dk) * k_f, dim=-1)
    dg = dg.flatten(1, 2)
    dg = dg + torch.nn.functional.one_hot(last_C, BT)[:, None, :] * dg_last[..., None]

    def unchunked(x_C: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
        x = x_C.transpose(1, 2)  # [C, BT, HV, D]
        if heads != HV:  # a q/k head's gradient sums over its value heads
            x = x.unflatten(2, (heads, HV // heads)).sum(3)
        if chunks is None:
            return x.reshape(B, T, *x.shape[2:]).to(dtype)
        out = x.new_empty(B * T + 1, *x.shape[2:])  # row B*T takes the rows past the ends
        out[torch.where(valid_CT, rows, B * T).flatten()] = x.flatten(0, 1)
        return out[: B * T].reshape(B, T, *x.shape[2:]).to(dtype)

    return (
        unchunked(dq, H, q.dtype),
        unchunked(dk, H, k.dtype),
        unchunked(dw, HV, w.dtype),
        unchunked(dg.unsqueeze(-1), HV, torch.float32).squeeze(-1),
    )


def _chunk_rows(
    B: int, T: int, BT: int, C: int, cu_seqlens: torch.Tensor | None, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's rows of the flattened [B * T] batch ([C, BT]; past a sequence's end the
    last row repeats), which of them are real, and the position of its last real row, in fla's
    chunk order (sequence by sequence). No host sync: C is fla's chunk count."""
    if cu_seqlens is None:
        starts = torch.arange(B, device=dev) * T
        lengths = torch.full((B,), T, device=dev)
    else:
        starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    per_sequence = (lengths + BT - 1) // BT
    sequence = torch.repeat_interleave(
        torch.arange(len(starts), device=dev), per_sequence, output_size=C
    )
    first = torch.cumsum(per_sequence, 0) - per_sequence
    start = starts[sequence] + (torch.arange(C, device=dev) - first[sequence]) * BT
    n_real = torch.clamp(starts[sequence] + lengths[sequence] - start, max=BT)
    offsets = torch.arange(BT, device=dev)
    rows = start[:, None] + torch.minimum(offsets, n_real[:, None] - 1)
    return rows, offsets < n_real[:, None], n_real - 1


def _by_name(args: tuple, kwargs: dict) -> dict:
    """fla's chunk_bwd_dqkwg arguments, positional ones named as in its signature."""
    names = ("q", "k", "v", "do", "h", "dh", "w", "g", "g_gamma", "dv")
    return {**dict(zip(names, args)), **kwargs}


@functools.cache
def triton_miscompiles_dqkwg() -> bool:
    """fla's own test: Hopper with Triton >= 3.4, < 3.7.1 (fla issue #640)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    import triton

    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    return (3, 4, 0) <= version < (3, 7, 1)


@functools.cache
def register() -> bool:
    """Register the backend with fla's dispatch (once); False where this fla has none."""
    try:
        from fla.backends import BaseBackend
        from fla.backends import register as fla_register
    except ImportError:
        return False

    class TorchloomBackend(BaseBackend):
        backend_type = "torchloom"
        priority = 6  # after fla's own tilelang backend (5), where that is installed

        def chunk_bwd_dqkwg_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
            named = _by_name(args, kwargs)
            if not triton_miscompiles_dqkwg():
                return False, "fla's Triton kernel is sound here"
            if any(named.get(name) is None for name in ("w", "g", "dv")):
                return False, "torchloom's form covers the gated delta rule only (w, g, dv)"
            if named.get("g_gamma") is not None:
                return False, "torchloom's form has no g_gamma"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            named = _by_name(args, kwargs)
            named.pop("g_gamma", None)
            dims = named["k"].shape[-1], named["v"].shape[-1]
            kernel = STEP_KERNEL if all(map(triton_kernel_fits, dims)) else "torch"
            return chunk_bwd_dqkwg(**named, kernel=kernel)

    fla_register("common")(TorchloomBackend)
    return True


# --- the same step as one Triton kernel (the backend's; tests/kernels/test_fla_backend.py checks
# it against the PyTorch form in Triton's interpreter, benchmarks/fla_backend.py on a GPU) ----


def triton_kernel_fits(head_dim: int) -> bool:
    """Whether the Triton kernel takes this key or value head dim (whole tiles: a power of two,
    at least 16); the backend runs the PyTorch form for any other."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _dqkwg_triton(
    x: StepInputs,
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    state_v_first: bool,
    BT: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step as one program per (chunk, value head). Unlike fla's kernel it never transposes
    an accumulated dot product (the pattern Triton 3.4-3.7.0 miscompiles on Hopper, fla issue
    #640): it accumulates ds and ds^T as two products of loaded tiles."""
    q, k, v, do, h, dh, w, g, dv = x
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    C = h.shape[0] * h.shape[1]
    if not (triton_kernel_fits(K) and triton_kernel_fits(V)):
        raise ValueError(f"the Triton dqkwg kernel needs power-of-two K, V >= 16; got {K}, {V}")
    rows, _, last_C = chunks
    q, k, v, do, dv, h, dh, g = (x.contiguous() for x in (q, k, v, do, dv, h, dh, g))
    dq = torch.empty(B * T, HV, K, dtype=torch.float32, device=q.device)
    dk, dw = torch.empty_like(dq), torch.empty(B * T, HV, K, dtype=w.dtype, device=q.device)
    dg = torch.empty(B * T, HV, dtype=torch.float32, device=q.device)
    _dqkwg_kernel[(C, HV)](
        q, k, v, do, dv, h, dh, g, rows, last_C + 1, dq, dk, dw, dg, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=min(V, 64), STATE_V_FIRST=state_v_first,
        num_warps=TRITON_WARPS,
    )  # fmt: skip
    G = HV // H

    def per_qk_head(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.view(B, T, H, G, K).sum(3).to(dtype)

    return (
        per_qk_head(dq, q.dtype),
        per_qk_head(dk, k.dtype),
        dw.view(B, T, HV, K),
        dg.view(B, T, HV),
    )


@jit
def _dqkwg_kernel(
    q, k, v, do, dv, h, dh, g, rows, n_real, dq, dk, dw, dg, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BV: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    qk_head = head // (HV // H)
    t = tl.arange(0, BT)
    count = tl.load(n_real + chunk)
    real = t < count
    row = tl.load(rows + chunk * BT + t).to(tl.int64)  # past the end: the last real row again
    ks = tl.arange(0, K)
    state = (chunk * HV + head).to(tl.int64) * K * V

    ds = tl.zeros([BT, BT], dtype=tl.float32)  # do @ v^T
    ds_t = tl.zeros([BT, BT], dtype=tl.float32)  # v @ do^T, its transpose
    acc_q = tl.zeros([BT, K], dtype=tl.float32)  # do @ h^T
    acc_k = tl.zeros([BT, K], dtype=tl.float32)  # v @ dh^T
    acc_w = tl.zeros([BT, K], dtype=tl.float32)  # dv @ h^T
    h_dh = 0.0  # <h, dh>
    for v0 in range(0, V, BV):
        vs = v0 + tl.arange(0, BV)
        tile = (row * HV + head)[:, None] * V + vs[None, :]  # [BT, BV]
        b_v = tl.load(v + tile)
        b_do = tl.load(do + tile)
        b_dv = tl.load(dv + tile)
        if STATE_V_FIRST:  # states stored [V, K]
            st = state + vs[:, None] * K + ks[None, :]
        else:  # [K, V], read transposed
            st = state + ks[None, :] * V + vs[:, None]
        b_h_t = tl.load(h + st)  # [BV, K]
        b_dh_t = tl.load(dh + st)
        h_dh += tl.sum(b_h_t.to(tl.float32) * b_dh_t.to(tl.float32))
        ds = tl.dot(b_do, tl.trans(b_v), ds)
        ds_t = tl.dot(b_v, tl.trans(b_do), ds_t)
        acc_q = tl.dot(b_do, b_h_t.to(b_do.dtype), acc_q)
        acc_k = tl.dot(b_v, b_dh_t.to(b_v.dtype), acc_k)
        acc_w = tl.dot(b_dv, b_h_t.to(b_dv.dtype), acc_w)

    qk_tile = (row * H + qk_head)[:, None] * K + ks[None, :]
    b_q = tl.load(q + qk_tile)
    b_k = tl.load(k + qk_tile)
    b_g = tl.load(g + row * HV + head)
    g_last = tl.load(g + tl.load(rows + chunk * BT + count - 1).to(tl.int64) * HV + head)

    acc_q = acc_q * (tl.exp2(b_g) * scale)[:, None]
    acc_k = acc_k * tl.where(real, tl.exp2(g_last - b_g), 0.0)[:, None]
    dg_last = tl.exp2(g_last) * h_dh + tl.sum(acc_k * b_k.to(tl.float32))
    both = real[:, None] & real[None, :]
    lower = (t[:, None] >= t[None, :]) & both  # ds[i, j], i >= j
    gap = tl.where(lower, b_g[:, None] - b_g[None, :], 0.0)
    ds = tl.where(lower, ds * tl.exp2(gap), 0.0) * scale
    upper = (t[:, None] <= t[None, :]) & both  # ds^T[j, i] = ds[i, j]
    gap_t = tl.where(upper, b_g[None, :] - b_g[:, None], 0.0)
    ds_t = tl.where(upper, ds_t * tl.exp2(gap_t), 0.0) * scale
    acc_q = tl.dot(ds.to(b_k.dtype), b_k, acc_q)
    acc_k = tl.dot(ds_t.to(b_q.dtype), b_q, acc_k)
    b_dg = tl.sum(acc_q * b_q.to(tl.float32), 1) - tl.sum(acc_k * b_k.to(tl.float32), 1)
    b_dg = tl.where(t == count - 1, b_dg + dg_last, b_dg)

    out = (row * HV + head)[:, None] * K + ks[None, :]
    mask = real[:, None]
    tl.store(dq + out, acc_q, mask=mask)
    tl.store(dk + out, acc_k, mask=mask)
    tl.store(dw + out, (-acc_w).to(dw.dtype.element_ty), mask=mask)
    tl.store(dg + row * HV + head, b_dg, mask=real)
