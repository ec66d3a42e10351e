"""The gated delta rule (Gated DeltaNet, Kimi Delta Attention): a recurrent state S [K, V] per
head that decays, then is corrected towards each new key/value pair.

Per token t (``g_t`` the log decay, <= 0, one per head or one per key channel)::

    S = diag(exp(g_t)) S          # decay (a scalar gate multiplies the whole state)
    u = v_t - S^T k_t             # what the state still gets wrong about v_t
    S = S + beta_t k_t u^T        # delta-rule correction
    o_t = S^T (scale q_t)

``delta_rule_reference`` is that loop, the definition. ``delta_rule_chunked`` computes the same
in chunks for training: inside a chunk the corrections solve one unit lower-triangular system
(the WY / UT form), and the state passes from chunk to chunk. ``delta_rule_step`` is one decode
token. Everything runs in fp32; outputs come back in v's dtype, states in fp32.

Shapes: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` or ``[B, T, H, K]``, beta
``[B, T, H]``, state ``[B, H, K, V]``. ``delta_rule`` and ``delta_rule_step`` also take q and k
with fewer heads than v (each serving HV / H consecutive value heads, Gated DeltaNet's
grouping) and, with ``normalize_qk``, L2-normalise them per head (fla does both inside its
kernels); otherwise q and k are used as given.

``fixed_order`` (batch-invariant mode, kernels/batch_invariant.py): ``delta_rule_step`` takes its
exp through ``pointwise`` and its sums over K (and the L2 norm's) as ``fixed_order_sum``, the
rest being elementwise; ``delta_rule(impl="fixed_order")`` is that step token after token
(``delta_rule_reference``), so a
training forward, a prefill and a decode step compute every token alike, whatever its batch.

Packed rows: with ``doc_ids_BT`` (contiguous documents per row) the state restarts from zero at
every token whose document differs from the previous token's; the initial state belongs to
each row's first document, the returned state is that of its last.
"""

from __future__ import annotations

import functools
import warnings

import torch

from torchloom.kernels import fla_backend
from torchloom.kernels.batch_invariant import fixed_order_sum, pointwise


def l2_normalize(x: torch.Tensor, eps: float = 1e-6, fixed_order: bool = False) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (as fla and transformers compute);
    with ``fixed_order`` the sum is a fixed_order_sum and the root IEEE (batch-invariant)."""
    x = x.float()
    if fixed_order:
        return x * torch.sqrt(fixed_order_sum(x * x) + eps).reciprocal()[..., None]
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _per_value_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, normalize_qk: bool, fixed_order: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normalised if asked, and repeated to v's heads (dim -2) if they have fewer."""
    if normalize_qk:
        q, k = l2_normalize(q, fixed_order=fixed_order), l2_normalize(k, fixed_order=fixed_order)
    group = v.shape[-2] // q.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k


def delta_rule_step(
    q_BHK: torch.Tensor,
    k_BHK: torch.Tensor,
    v_BHV: torch.Tensor,
    g: torch.Tensor,
    beta_BH: torch.Tensor,
    state_BHKV: torch.Tensor,
    scale: float | None = None,
    normalize_qk: bool = False,
    fixed_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``g`` is [B, H] or [B, H, K]; returns (o [B, H, V], new fp32 state).
    ``fixed_order``: batch-invariant arithmetic (module docstring)."""
    scale = q_BHK.shape[-1] ** -0.5 if scale is None else scale
    q_BHK, k_BHK = _per_value_head(q_BHK, k_BHK, v_BHV, normalize_qk, fixed_order)
    q, k, v = (x.float() for x in (q_BHK, k_BHK, v_BHV))
    decay = pointwise(torch.exp, g.float()) if fixed_order else g.float().exp()
    decay = decay[..., None, None] if decay.dim() == 2 else decay[..., None]
    state = state_BHKV.float() * decay

    def over_k(x_BHK: torch.Tensor) -> torch.Tensor:  # sum_k x[k] S[k, :]
        if fixed_order:
            return fixed_order_sum((x_BHK[..., :, None] * state).transpose(-1, -2))
        return torch.einsum("bhk,bhkv->bhv", x_BHK, state)

    u_BHV = v - over_k(k)
    state = state + beta_BH.float()[..., None, None] * k[..., :, None] * u_BHV[..., None, :]
    o_BHV = over_k(q * scale)
    return o_BHV.to(v_BHV.dtype), state


def delta_rule_reference(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    scale: float | None = None,
    doc_ids_BT: torch.Tensor | None = None,
    normalize_qk: bool = False,
    fixed_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the module docstring); returns (o [B, T, H, V], state).
    With ``fixed_order``, batch-invariant mode's rule for training, prefill and decode alike
    (``delta_rule(impl="fixed_order")``): one token at a time, for RL-sized models."""
    B, T, H, V = v_BTHV.shape
    state = _initial_state(state_BHKV, B, H, q_BTHK.shape[-1], V, v_BTHV.device)
    outputs = []
    for t in range(T):
        if doc_ids_BT is not None and t > 0:
            new_doc_B = doc_ids_BT[:, t] != doc_ids_BT[:, t - 1]
            state = state.masked_fill(new_doc_B[:, None, None, None], 0.0)
        o_BHV, state = delta_rule_step(
            q_BTHK[:, t], k_BTHK[:, t], v_BTHV[:, t], g[:, t], beta_BTH[:, t], state, scale,
            normalize_qk, fixed_order,
        )  # fmt: skip
        outputs.append(o_BHV)
    o_BTHV = torch.stack(outputs, dim=1) if outputs else v_BTHV.new_zeros(B, 0, H, V)
    return o_BTHV, state


def delta_rule_chunked(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    doc_ids_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as ``delta_rule_reference``, chunk by chunk (differentiable, fp32).

    With G the gates' cumulative sum inside a chunk (from its start) and S0 the state entering
    it, the state just after token i is ``diag(exp(G_i)) S0 + sum_{j<=i} diag(exp(G_i - G_j))
    k_j w_j^T``, where the corrections w solve ``(I + A) W = beta (V - (k exp(G)) S0)`` with
    ``A_ij = beta_i k_i^T diag(exp(G_i - G_j)) k_j`` for j < i. Every decay used is a relative
    one, exp(G_i - G_j) with j <= i (or of the chunk's end), so nothing grows past 1. A
    per-channel gate makes those decays a [C, C, K] tensor per chunk (memory ~C x the keys').
    Documents (``doc_ids_BT``) cut the chain: a decay across a document start is zero.
    """
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    scale = K**-0.5 if scale is None else scale
    state = _initial_state(state_BHKV, B, H, K, V, q_BTHK.device)
    per_channel = g.dim() == 4
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, ...] -> [B, H, N, C, ...], zero padded: a padded token has beta = 0 (no
        # correction) and g = 0 (no decay), so it leaves the state as it is.
        x = _ContiguousGrad.apply(x.float()).transpose(1, 2)
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, H, N, C, *x.shape[3:])

    q, k, v, beta = chunks(q_BTHK * scale), chunks(k_BTHK), chunks(v_BTHV), chunks(beta_BTH)
    G = chunks(g).cumsum(dim=3)  # [B, H, N, C] or [B, H, N, C, K]
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    links = _document_links(doc_ids_BT, N, C) if doc_ids_BT is not None else None
    visible = causal_CC if links is None else causal_CC & links[0]  # [(B, 1, N,) C, C]
    if per_channel:
        # exp(G_i - G_j) for j <= i, masked before the exp (j > i would grow).
        diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, N, C, C, K]
        decay = diff.masked_fill(~visible[..., None], float("-inf")).exp()
        kk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", k, k, decay)
        qk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", q, k, decay)
        G_end = G[..., -1:, :]  # [B, H, N, 1, K]
        to_end, from_start = (G_end - G).exp(), G.exp()  # each key's decay to the chunk's end
        end_decay = G_end.squeeze(3)[..., :, None]  # [B, H, N, K, 1]
    else:
        diff = G[..., :, None] - G[..., None, :]  # [B, H, N, C, C]
        decay = diff.masked_fill(~visible, float("-inf")).exp()
        kk = (k @ k.transpose(-1, -2)) * decay
        qk = (q @ k.transpose(-1, -2)) * decay
        G_end = G[..., -1:]  # [B, H, N, 1]
        to_end, from_start = (G_end - G).exp()[..., None], G.exp()[..., None]
        end_decay = G_end[..., None]  # [B, H, N, 1, 1]
    end_decay = end_decay.exp()
    if links is not None:  # only tokens of the document the state holds (carries on) see it
        _, from_start_mask, to_end_mask, carry = links
        from_start = from_start * from_start_mask[..., None]
        to_end = to_end * to_end_mask[..., None]
        end_decay = end_decay * carry[..., None, None]
    k_to_end = k * to_end
    q_from_start, k_from_start = q * from_start, k * from_start
    strict_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = (beta[..., None] * kk).masked_fill(~strict_CC, 0.0)
    eye = torch.eye(C, device=q.device)
    system = eye + A
    # W = U - Wk @ S0: the corrections' part from the chunk's own values, and from the state.
    U = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(
        system, beta[..., None] * k_from_start, upper=False, unitriangular=True
    )
    outputs = []
    for n in range(N):
        W_CV = U[:, :, n] - Wk[:, :, n] @ state
        outputs.append(q_from_start[:, :, n] @ state + qk[:, :, n] @ W_CV)
        state = end_decay[:, :, n] * state + k_to_end[:, :, n].transpose(-1, -2) @ W_CV
    o = torch.stack(outputs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
    return o.transpose(1, 2).to(v_BTHV.dtype), state


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: the inputs' gradients come back through
    transposes, and a compiled backward of the projection that made an input may ``view``
    its gradient (which a transposed layout refuses)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _document_links(
    doc_ids_BT: torch.Tensor, N: int, C: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For chunks of C tokens ([B, 1, N, ...] each, broadcasting over heads): which pairs share
    a document ([C, C]), which tokens are in the document of the state entering the chunk, which
    are in the document of the chunk's last token (the state leaving it), and whether that
    state carries the entering one on. Padding continues the last token's document."""
    B, T = doc_ids_BT.shape
    docs_BL = torch.cat([doc_ids_BT, doc_ids_BT[:, -1:].expand(B, N * C - T)], dim=1)
    docs_BNC = docs_BL.view(B, N, C)
    last_BN = docs_BNC[..., -1]
    entering_BN = torch.cat([docs_BNC[:, :1, 0], last_BN[:, :-1]], dim=1)  # row start: its own
    same_BNCC = docs_BNC[..., :, None] == docs_BNC[..., None, :]
    from_start_BNC = docs_BNC == entering_BN[..., None]
    to_end_BNC = docs_BNC == last_BN[..., None]
    carry_BN = last_BN == entering_BN
    return (
        same_BNCC[:, None],
        from_start_BNC[:, None].float(),
        to_end_BNC[:, None].float(),
        carry_BN[:, None].float(),
    )


def delta_rule(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str = "auto",
    doc_ids_BT: torch.Tensor | None = None,
    normalize_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule for a whole sequence. ``impl``: "torch" (``delta_rule_chunked``),
    "fla" (fla-core's Triton kernels, CUDA only), "auto" (fla on CUDA when importable and,
    when gradients are wanted, its backward is safe there: ``fla_backward_safe``) or
    "fixed_order" (``delta_rule_reference`` with fixed-order arithmetic: batch-invariant mode).
    q and k may have fewer heads than v; ``normalize_qk``: L2-normalise them (module
    docstring)."""
    if impl not in ("auto", "torch", "fla", "fixed_order"):
        raise ValueError(
            f"unknown delta rule impl {impl!r}: choose auto, torch, fla or fixed_order"
        )
    if impl == "fixed_order":
        return delta_rule_reference(
            q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, state_BHKV, scale, doc_ids_BT, normalize_qk,
            fixed_order=True,
        )  # fmt: skip
    if impl == "fla" or (impl == "auto" and _fla_suits(q_BTHK, k_BTHK, v_BTHV, g, beta_BTH)):
        return _delta_rule_fla(
            q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, state_BHKV, scale, doc_ids_BT, normalize_qk
        )
    q_BTHK, k_BTHK = _per_value_head(q_BTHK, k_BTHK, v_BTHV, normalize_qk, fixed_order=False)
    return delta_rule_chunked(
        q_BTHK, k_BTHK, v_BTHV, g, beta_BTH, state_BHKV, scale, doc_ids_BT=doc_ids_BT
    )


def _initial_state(
    state_BHKV: torch.Tensor | None, B: int, H: int, K: int, V: int, device: torch.device
) -> torch.Tensor:
    if state_BHKV is None:
        return torch.zeros(B, H, K, V, device=device, dtype=torch.float32)
    return state_BHKV.float()


# --- GPU fast path: fla-core's Triton kernels (not a dependency; untested on CPU) -------------


@functools.cache
def _fla_available() -> bool:
    try:
        import fla.ops  # noqa: F401
    except ImportError:
        return False
    fla_backend.register()  # before fla's first backward
    return True


@functools.cache
def fla_backward_safe() -> bool:
    """Whether fla's gated delta-rule backward gives right gradients here. fla 0.6's Triton
    kernel for one step of it is miscompiled on Hopper with Triton >= 3.4, < 3.7.1 (fla issue
    #640); there torchloom's own kernel of that step stands in, registered with fla's
    dispatch (``kernels/fla_backend.py``). False only for a fla without that dispatch."""
    if not fla_backend.triton_miscompiles_dqkwg() or not _fla_available():
        return True
    if fla_backend.register():
        return True
    import triton

    warnings.warn(
        f"fla's gated delta-rule backward gives wrong results with Triton {triton.__version__} "
        "on Hopper (fla issue #640) and this fla has no backend dispatch for torchloom's "
        "replacement, so training runs the delta rule's chunked PyTorch form, which is several "
        "times slower. Install fla-core >= 0.6, Triton >= 3.7.1 or tilelang.",
        stacklevel=2,
    )
    return False


def _fla_suits(*inputs: torch.Tensor) -> bool:
    """fla for ``impl="auto"``: CUDA tensors, fla installed, and, if gradients will flow, its
    backward safe."""
    if not inputs[0].is_cuda or not _fla_installed():
        return False
    wants_grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    return not wants_grad or _fla_backward_ok()


# Inside a compiled block Dynamo cannot trace the imports these checks make: it takes their
# (fixed) results as constants instead.
@torch.compiler.assume_constant_result
def _fla_installed() -> bool:
    return _fla_available()


@torch.compiler.assume_constant_result
def _fla_backward_ok() -> bool:
    return fla_backward_safe()


def fla_runs(device_type: str) -> bool:
    """Whether ``delta_rule(impl="auto")`` runs fla's kernels in training on this device type."""
    return device_type == "cuda" and _fla_available() and fla_backward_safe()


# Opaque to Dynamo as a whole: fla's kernels are hidden from it anyway, and its imports, casts
# and variable-length setup gain nothing from tracing; one graph break, at the call.
@torch.compiler.disable
def _delta_rule_fla(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g: torch.Tensor,
    beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None,
    scale: float | None,
    doc_ids_BT: torch.Tensor | None = None,
    normalize_qk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked kernels, [B, T, H, ...] layout, q/k heads grouped and normalised inside
    them; the final state comes back in fp32. Documents become fla's variable-length
    sequences: the rows flattened into one, cut at every document start (cu_seqlens)."""
    _fla_installed()  # registers torchloom's fla backend
    scale = q_BTHK.shape[-1] ** -0.5 if scale is None else scale
    # The kernels multiply q, k, v and beta together in one dtype (a tl.dot of two dtypes
    # fails); callers may hand over fp32 q/k (normalised outside) or beta next to a bf16 v.
    q_BTHK, k_BTHK, beta_BTH = (x.to(v_BTHV.dtype) for x in (q_BTHK, k_BTHK, beta_BTH))
    initial = None if state_BHKV is None else state_BHKV.float()
    varlen: dict = {}
    if doc_ids_BT is not None:
        B, T = doc_ids_BT.shape
        starts_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
        starts_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
        starts = starts_BT.flatten()
        end = torch.tensor([B * T], device=starts.device)
        varlen["cu_seqlens"] = torch.cat([starts.nonzero().flatten(), end])
        sequence_BT = (starts.cumsum(0) - 1).view(B, T)  # each token's sequence index
        if initial is not None:  # a row's state starts its first document
            per_sequence = initial.new_zeros(
                int(varlen["cu_seqlens"].numel()) - 1, *initial.shape[1:]
            )
            per_sequence[sequence_BT[:, 0]] = initial
            initial = per_sequence
        q_BTHK, k_BTHK, v_BTHV, g, beta_BTH = (
            x.flatten(0, 1)[None] for x in (q_BTHK, k_BTHK, v_BTHV, g, beta_BTH)
        )
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda

        kernel = chunk_kda
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        kernel = chunk_gated_delta_rule
    o, state = kernel(
        q_BTHK, k_BTHK, v_BTHV, g.float(), beta_BTH,
        scale=scale, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=normalize_qk, **varlen,
    )  # fmt: skip
    if doc_ids_BT is not None:  # back to rows; each row's state is its last document's
        o, state = o.view(B, T, *o.shape[2:]), state[sequence_BT[:, -1]]
    return o.to(v_BTHV.dtype), state.float()
