"""Batch-invariant reference ops (CPU): every output element is reduced in an order that
depends only on its own inputs, never on how many other rows share the call or how long the
sequence around it is. So a token's numbers do not change with the batch it is in, and a
decode step equals the same position of a full forward pass, bit for bit.

- ``linear``: each output is a contiguous dot product over the input features (an elementwise
  product, then a last-dim sum, row by row), so no matrix-multiply blocking that depends on the
  row count can enter.
- ``attention``: each query is handled alone over exactly its visible keys (positions
  ``start..p``), with scores, softmax and the weighted sum of values reduced over that span.

These are slow reference implementations for small models and tests. On CUDA tensors, with
Triton installed, the same three functions run the fixed-tile Triton kernels of
``batch_invariant_triton`` instead (same guarantees, GPU speed). RMSNorm and (log-)softmax are
already row-wise reductions in PyTorch on the CPU and need no variant here.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from torchloom.kernels.triton_support import use_triton

_ROWS_PER_CHUNK = 8


def _triton_kernels(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels module for CUDA tensors when Triton is installed, else None (run the
    references). Imported here because it imports this module."""
    if not use_triton(x):
        return None
    from torchloom.kernels import batch_invariant_triton

    return batch_invariant_triton


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Inside torch.autocast its dtype (as nn.Linear and SDPA would compute), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def linear(x_ND: torch.Tensor, weight_MD: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with one fixed reduction order per output element, in x's dtype (the
    autocast dtype under autocast)."""
    x_ND = x_ND.to(_compute_dtype(x_ND))
    if (kernels := _triton_kernels(x_ND)) is not None:
        return kernels.linear(x_ND, weight_MD)
    rows = x_ND.reshape(-1, x_ND.shape[-1])
    out = torch.empty(rows.shape[0], weight_MD.shape[0], dtype=x_ND.dtype, device=x_ND.device)
    w = weight_MD.to(x_ND.dtype)
    for start in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK]
        out[start : start + _ROWS_PER_CHUNK] = (chunk[:, None, :] * w[None, :, :]).sum(-1)
    return out.reshape(*x_ND.shape[:-1], weight_MD.shape[0])


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
    B, H, T, d = q_BHTd.shape
    group = H // k_BKLd.shape[1]
    keys_BHLd = k_BKLd.repeat_interleave(group, dim=1).to(q_BHTd.dtype)
    values_BHLd = v_BKLd.repeat_interleave(group, dim=1).to(q_BHTd.dtype)
    out = torch.empty_like(q_BHTd)
    scale = d**-0.5
    for b in range(B):
        for t in range(T):
            end = int(positions_BT[b, t]) + 1
            start = 0 if starts_BT is None else int(starts_BT[b, t])
            q_Hd = q_BHTd[b, :, t].float()
            k_HSd = keys_BHLd[b, :, start:end].float()
            scores_HS = (q_Hd[:, None, :] * k_HSd).sum(-1) * scale
            weights_HS = torch.softmax(scores_HS, dim=-1)
            v_HSd = values_BHLd[b, :, start:end].float()
            out[b, :, t] = (weights_HS[:, :, None] * v_HSd).sum(1).to(out.dtype)
    return out


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


def causal_positions_and_starts(
    B: int, T: int, doc_ids_BT: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions 0..T-1 of every row and, with ``doc_ids_BT``, the index of the first token of
    each token's document (None without documents: every query sees from key 0)."""
    positions_BT = torch.arange(T, device=device).expand(B, T)
    if doc_ids_BT is None:
        return positions_BT, None
    new_doc_BT = F.pad(doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1], (1, 0), value=True)
    return positions_BT, torch.where(new_doc_BT, positions_BT, 0).cummax(dim=1).values


def make_linears_batch_invariant(model: torch.nn.Module) -> None:
    """Route every nn.Linear of ``model`` through ``linear`` (forward patched in place, so the
    parameter names stay)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module.bias is not None:
                raise ValueError("batch-invariant linear layers take no bias")
            module.forward = lambda x, m=module: linear(x, m.weight)
