"""FlashAttention 4 (the `flash-attn-4` package's CuTe DSL kernels, Hopper and Blackwell) as the
``fa4`` attention backend (``--model.attn_backend fa4``), with its PyTorch reference.

Two torch.library custom ops, ``torchloom::fa4_fwd`` (q, k, v as [B, T, heads, d], causal GQA
-> the output [B, T, H, d] and each query's log-sum-exp [B, H, T] in fp32) and
``torchloom::fa4_bwd``, wrap flash-attn-4's forward and backward, so torch.compile traces them
as opaque ops through their fake forms and the registered backward. Packed rows
(``--data.document_mask true``) go through the varlen pair ``torchloom::fa4_varlen_fwd`` /
``fa4_varlen_bwd``: the rows flattened to [B*T, heads, d] and cut at every document start
(``Fa4Documents``, built once per forward), each document causal on its own. On the CPU the ops
run the reference below (fp32, the same values up to rounding): how the slot is tested without a
GPU, and a slow fallback there. Windowed or chunked layers are refused in one line.

flash-attn-4 is not a dependency (``pip install flash-attn-4``); on a GPU without it, or older
than Hopper (sm_90), a run asking for ``fa4`` stops before it builds the model
(``check_fa4_device``). Measured in the 1B training step on an H200 (benchmarks/RESULTS.md,
thirty-first session): +2.5% over cuDNN's attention through SDPA.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from torchloom.config.errors import ConfigError
from torchloom.kernels.attention_mask import CAUSAL, AttentionMask

INSTALL = "pip install flash-attn-4 (on the lent H200: bash benchmarks/fa4_wheels.sh install)"


def flash_interface():
    """flash-attn-4's kernel entry points (its forward and backward), or one error saying how to
    get them."""
    try:
        from flash_attn.cute import interface
    except ImportError as err:
        raise ConfigError(f"attn_backend 'fa4' on a GPU needs flash-attn-4: {INSTALL}.") from err
    return interface


def check_fa4_device(backend: str, device: torch.device) -> None:
    """ConfigError, before the model is built, when ``backend`` is ``fa4`` and ``device`` is a
    GPU its kernels cannot run on (older than sm_90) or flash-attn-4 is not installed; the CPU
    runs the reference."""
    if backend != "fa4" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ConfigError(
            f"attn_backend 'fa4' (FlashAttention 4) runs on Hopper and Blackwell GPUs (compute "
            f"capability 9.0+); {torch.cuda.get_device_name(device)} has {major}.{minor}. Use "
            "--model.attn_backend sdpa."
        )
    flash_interface()


def _expand_kv(k_BTKd: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, K, d] kv heads repeated to [B, heads, T, d] fp32 (query head h reads h // group)."""
    return k_BTKd.transpose(1, 2).repeat_interleave(heads // k_BTKd.shape[2], dim=1).float()


def _causal_scores(q_BHTd: torch.Tensor, k_BHTd: torch.Tensor) -> torch.Tensor:
    """Scaled scores [B, H, T, S] with the future masked to -inf (fp32 inputs)."""
    T, d = q_BHTd.shape[2], q_BHTd.shape[3]
    future = torch.ones(T, T, dtype=torch.bool, device=q_BHTd.device).triu(1)
    return (q_BHTd @ k_BHTd.transpose(-1, -2) * d**-0.5).masked_fill(future, float("-inf"))


def reference_forward(
    q_BTHd: torch.Tensor, k_BTKd: torch.Tensor, v_BTKd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention in fp32: (the output in q's dtype [B, T, H, d], the log-sum-exp of
    each query's scaled scores [B, H, T])."""
    H = q_BTHd.shape[2]
    scores_BHTS = _causal_scores(q_BTHd.transpose(1, 2).float(), _expand_kv(k_BTKd, H))
    lse_BHT = scores_BHTS.logsumexp(-1)
    out_BHTd = (scores_BHTS - lse_BHT[..., None]).exp() @ _expand_kv(v_BTKd, H)
    return out_BHTd.transpose(1, 2).to(q_BTHd.dtype).contiguous(), lse_BHT


def reference_backward(
    dout_BTHd: torch.Tensor,
    q_BTHd: torch.Tensor,
    k_BTKd: torch.Tensor,
    v_BTKd: torch.Tensor,
    out_BTHd: torch.Tensor,
    lse_BHT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``reference_forward`` in fp32, written out (an op's body runs below
    autograd): P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale
    dS K, dK = scale dS^T Q; a kv head's gradients summed over the query heads that read it."""
    B, T, H, d = q_BTHd.shape
    K, scale = k_BTKd.shape[2], d**-0.5
    q_BHTd, k_BHTd, v_BHTd = (
        q_BTHd.transpose(1, 2).float(),
        _expand_kv(k_BTKd, H),
        _expand_kv(v_BTKd, H),
    )
    do_BHTd, o_BHTd = dout_BTHd.transpose(1, 2).float(), out_BTHd.transpose(1, 2).float()
    p_BHTS = (_causal_scores(q_BHTd, k_BHTd) - lse_BHT[..., None]).exp()
    dv_BHTd = p_BHTS.transpose(-1, -2) @ do_BHTd
    dp_BHTS = do_BHTd @ v_BHTd.transpose(-1, -2)
    ds_BHTS = p_BHTS * (dp_BHTS - (do_BHTd * o_BHTd).sum(-1, keepdim=True))
    dq_BHTd = ds_BHTS @ k_BHTd * scale
    dk_BHTd = ds_BHTS.transpose(-1, -2) @ q_BHTd * scale

    def per_kv_head(g_BHTd: torch.Tensor) -> torch.Tensor:
        return g_BHTd.view(B, K, H // K, T, -1).sum(2).transpose(1, 2).contiguous()

    dq = dq_BHTd.transpose(1, 2).contiguous()
    return (
        dq.to(q_BTHd.dtype),
        per_kv_head(dk_BHTd).to(k_BTKd.dtype),
        per_kv_head(dv_BHTd).to(v_BTKd.dtype),
    )


@torch.library.custom_op("torchloom::fa4_fwd", mutates_args=())
def fa4_fwd(
    q_BTHd: torch.Tensor, k_BTKd: torch.Tensor, v_BTKd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_BTHd.is_cuda:
        out, lse, *_ = flash_interface()._flash_attn_fwd(
            q_BTHd, k_BTKd, v_BTKd, causal=True, return_lse=True
        )
        return out.contiguous(), lse.contiguous()  # the strides the fake form promises
    return reference_forward(q_BTHd, k_BTKd, v_BTKd)


@fa4_fwd.register_fake
def _(q_BTHd, k_BTKd, v_BTKd):
    B, T, H, _ = q_BTHd.shape
    out = q_BTHd.new_empty(B, T, H, v_BTKd.shape[-1])
    return out, q_BTHd.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("torchloom::fa4_bwd", mutates_args=())
def fa4_bwd(
    dout_BTHd: torch.Tensor,
    q_BTHd: torch.Tensor,
    k_BTKd: torch.Tensor,
    v_BTKd: torch.Tensor,
    out_BTHd: torch.Tensor,
    lse_BHT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q_BTHd.is_cuda:
        dq, dk, dv = flash_interface()._flash_attn_bwd(
            q_BTHd, k_BTKd, v_BTKd, out_BTHd, dout_BTHd, lse_BHT, causal=True
        )[:3]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    return reference_backward(dout_BTHd, q_BTHd, k_BTKd, v_BTKd, out_BTHd, lse_BHT)


@fa4_bwd.register_fake
def _(dout_BTHd, q_BTHd, k_BTKd, v_BTKd, out_BTHd, lse_BHT):
    return tuple(t.new_empty(t.shape) for t in (q_BTHd, k_BTKd, v_BTKd))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, dout_BTHd: torch.Tensor, _dlse: torch.Tensor | None):
    q_BTHd, k_BTKd, v_BTKd, out_BTHd, lse_BHT = ctx.saved_tensors
    return fa4_bwd(dout_BTHd.contiguous(), q_BTHd, k_BTKd, v_BTKd, out_BTHd, lse_BHT)


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


class Fa4Documents(NamedTuple):
    """What fa4 layers take in place of ``doc_ids_BT`` in one forward (packed rows): where each
    document starts in the rows flattened to B*T tokens, and the end, as int32 [documents + 1]
    (flash-attn's ``cu_seqlens``). A row's start always starts a document. The ids ride along
    for the token mixers that read them (a hybrid's linear-attention layers)."""

    cu_seqlens: torch.Tensor
    doc_ids_BT: torch.Tensor


def fa4_documents(doc_ids_BT: torch.Tensor) -> Fa4Documents:
    """``Fa4Documents`` of ``doc_ids_BT`` (a document is a run of one id within a row). The
    count of documents is data, so this reads it back from the device: once per forward, in
    the eager code before the compiled blocks. Fake or meta ids (a memory estimate) get one
    document per row: the count changes no size."""
    B, T = doc_ids_BT.shape
    if is_fake(doc_ids_BT) or doc_ids_BT.is_meta:  # sizes only (a memory estimate): one per row
        cu_seqlens = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=doc_ids_BT.device)
        return Fa4Documents(cu_seqlens, doc_ids_BT)
    starts_BT = torch.ones(B, T, dtype=torch.bool, device=doc_ids_BT.device)
    starts_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    starts = starts_BT.flatten().nonzero().flatten()
    end = torch.full((1,), B * T, dtype=starts.dtype, device=starts.device)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)  # one graph for every document count
    return Fa4Documents(cu_seqlens, doc_ids_BT)


def _documents(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    return list(itertools.pairwise(cu_seqlens.tolist()))


def reference_varlen_forward(
    q_NHd: torch.Tensor, k_NKd: torch.Tensor, v_NKd: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_forward`` over each document of the flattened rows on its own: (the output
    [N, H, d], the log-sum-exp [H, N])."""
    out_NHd = q_NHd.new_empty(*q_NHd.shape[:2], v_NKd.shape[-1])
    lse_HN = q_NHd.new_empty(q_NHd.shape[1], q_NHd.shape[0], dtype=torch.float32)
    for s, e in _documents(cu_seqlens):
        out, lse = reference_forward(q_NHd[None, s:e], k_NKd[None, s:e], v_NKd[None, s:e])
        out_NHd[s:e], lse_HN[:, s:e] = out[0], lse[0]
    return out_NHd, lse_HN


def reference_varlen_backward(
    dout_NHd: torch.Tensor,
    q_NHd: torch.Tensor,
    k_NKd: torch.Tensor,
    v_NKd: torch.Tensor,
    out_NHd: torch.Tensor,
    lse_HN: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference_backward`` document by document."""
    grads = [torch.empty_like(t) for t in (q_NHd, k_NKd, v_NKd)]
    for s, e in _documents(cu_seqlens):
        parts = reference_backward(*(t[None, s:e] for t in (dout_NHd, q_NHd, k_NKd, v_NKd,
                                                             out_NHd)), lse_HN[None, :, s:e])  # fmt: skip
        for grad, part in zip(grads, parts):
            grad[s:e] = part[0]
    return grads[0], grads[1], grads[2]


@torch.library.custom_op("torchloom::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(
    q_NHd: torch.Tensor,
    k_NKd: torch.Tensor,
    v_NKd: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_NHd.is_cuda:
        out, lse, *_ = flash_interface()._flash_attn_fwd(
            q_NHd, k_NKd, v_NKd, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True, return_lse=True,
        )  # fmt: skip
        return out.contiguous(), lse.contiguous()
    return reference_varlen_forward(q_NHd, k_NKd, v_NKd, cu_seqlens)


@fa4_varlen_fwd.register_fake
def _(q_NHd, k_NKd, v_NKd, cu_seqlens, max_seqlen):
    N, H, _ = q_NHd.shape
    out = q_NHd.new_empty(N, H, v_NKd.shape[-1])
    return out, q_NHd.new_empty(H, N, dtype=torch.float32)


@torch.library.custom_op("torchloom::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(
    dout_NHd: torch.Tensor,
    q_NHd: torch.Tensor,
    k_NKd: torch.Tensor,
    v_NKd: torch.Tensor,
    out_NHd: torch.Tensor,
    lse_HN: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q_NHd.is_cuda:
        dq, dk, dv = flash_interface()._flash_attn_bwd(
            q_NHd, k_NKd, v_NKd, out_NHd, dout_NHd, lse_HN, causal=True,
            cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
        )[:3]  # fmt: skip
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    return reference_varlen_backward(dout_NHd, q_NHd, k_NKd, v_NKd, out_NHd, lse_HN, cu_seqlens)


@fa4_varlen_bwd.register_fake
def _(dout_NHd, q_NHd, k_NKd, v_NKd, out_NHd, lse_HN, cu_seqlens, max_seqlen):
    return tuple(t.new_empty(t.shape) for t in (q_NHd, k_NKd, v_NKd))


def _setup_varlen_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:4], *output)
    ctx.max_seqlen = inputs[4]


def _varlen_backward(ctx, dout_NHd: torch.Tensor, _dlse: torch.Tensor | None):
    q_NHd, k_NKd, v_NKd, cu_seqlens, out_NHd, lse_HN = ctx.saved_tensors
    grads = fa4_varlen_bwd(dout_NHd.contiguous(), q_NHd, k_NKd, v_NKd, out_NHd, lse_HN,
                           cu_seqlens, ctx.max_seqlen)  # fmt: skip
    return *grads, None, None


fa4_varlen_fwd.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)


def fa4_attention(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | Fa4Documents | None,
    mask: AttentionMask = CAUSAL,
) -> torch.Tensor:
    """The ``fa4`` backend: causal GQA through ``fa4_fwd`` (it takes the model's [B, T, heads,
    d] layout, of which the backend's [B, heads, T, d] inputs are transposed views); with
    documents (``Fa4Documents``, or ids it builds them from), each causal on its own through
    ``fa4_varlen_fwd``."""
    mask.require_plain("attn_backend 'fa4'", "use --model.attn_backend sdpa or flex.")
    q_BTHd, k_BTKd, v_BTKd = (t.transpose(1, 2) for t in (q_BHTd, k_BKTd, v_BKTd))
    if doc_ids_BT is None:
        return fa4_fwd(q_BTHd, k_BTKd, v_BTKd)[0].transpose(1, 2)
    documents = doc_ids_BT if isinstance(doc_ids_BT, Fa4Documents) else fa4_documents(doc_ids_BT)
    B, T = q_BTHd.shape[:2]
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q_BTHd, k_BTKd, v_BTKd)]
    out_NHd, _ = fa4_varlen_fwd(*flat, documents.cu_seqlens, T)
    return out_NHd.view(B, T, *out_NHd.shape[1:]).transpose(1, 2)
