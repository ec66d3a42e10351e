"""FlashAttention 4 (the `flash-attn-4` package's CuTe DSL kernels, Hopper and Blackwell) as the
``fa4`` attention backend (``--model.attn_backend fa4``), with its PyTorch reference.

Two torch.library custom ops, ``torchloom::fa4_fwd`` (q, k, v as [B, T, heads, d], causal GQA
-> the output [B, T, H, d] and each query's log-sum-exp [B, H, T] in fp32) and
``torchloom::fa4_bwd``, wrap flash-attn-4's forward and backward, so torch.compile traces them
as opaque ops through their fake forms and the registered backward. On the CPU they run the
reference below (fp32, the same values up to rounding): how the slot is tested without a GPU,
and a slow fallback there. Plain causal attention over one document per row only: packed rows
(``--data.document_mask true``) and windowed or chunked layers are refused in one line.

flash-attn-4 is not a dependency (``pip install flash-attn-4``); on a GPU without it, or older
than Hopper (sm_90), a run asking for ``fa4`` stops before it builds the model
(``check_fa4_device``). Measured in the 1B training step on an H200 (benchmarks/RESULTS.md,
thirty-first session): +2.5% over cuDNN's attention through SDPA.
"""

from __future__ import annotations

import torch

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

DOCUMENT_FIX = (
    "attn_backend 'fa4' runs plain causal attention over one document per row; set "
    "--data.document_mask false, or use --model.attn_backend sdpa or flex for packed documents."
)


def fa4_attention(
    q_BHTd: torch.Tensor,
    k_BKTd: torch.Tensor,
    v_BKTd: torch.Tensor,
    doc_ids_BT: torch.Tensor | None,
    mask: AttentionMask = CAUSAL,
) -> torch.Tensor:
    """The ``fa4`` backend: causal GQA through ``fa4_fwd`` (it takes the model's [B, T, heads,
    d] layout, of which the backend's [B, heads, T, d] inputs are transposed views)."""
    if doc_ids_BT is not None:
        raise ConfigError(DOCUMENT_FIX)
    mask.require_plain("attn_backend 'fa4'", "use --model.attn_backend sdpa or flex.")
    out_BTHd, _ = fa4_fwd(q_BHTd.transpose(1, 2), k_BKTd.transpose(1, 2), v_BKTd.transpose(1, 2))
    return out_BTHd.transpose(1, 2)
