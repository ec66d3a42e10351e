"""The chunked gated delta rule and the decode step against the token-by-token definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchloom.kernels import batch_invariant
from torchloom.kernels.delta_rule import (
    _fla_suits,
    delta_rule,
    delta_rule_chunked,
    delta_rule_reference,
    delta_rule_step,
    fla_backward_safe,
)

B, H, K, V = 2, 3, 8, 6


def _inputs(T: int, per_channel: bool, seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    gate_shape = (B, T, H, K) if per_channel else (B, T, H)
    # Strong decays in places (down to exp(-8) per token), so unstable forms would overflow.
    g = -F.softplus(torch.randn(gate_shape, generator=gen) * 3)
    beta = torch.rand(B, T, H, generator=gen)
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("per_channel", [False, True], ids=["head_gate", "channel_gate"])
@pytest.mark.parametrize("T", [1, 16, 37, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_reference(per_channel: bool, T: int, with_state: bool) -> None:
    q, k, v, g, beta = _inputs(T, per_channel)
    state = torch.randn(B, H, K, V) if with_state else None
    o_ref, s_ref = delta_rule_reference(q, k, v, g, beta, state)
    o, s = delta_rule_chunked(q, k, v, g, beta, state, chunk_size=16)
    print(f"output rel {_rel(o, o_ref):.2e}, state rel {_rel(s, s_ref):.2e}")
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


def test_strong_channel_decay_stays_finite() -> None:
    """Cumulative log decays far below exp's range: relative decays keep everything finite."""
    q, k, v, g, beta = _inputs(64, per_channel=True)
    g = g * 0 - 30.0  # cumulative -1920 over a chunk: exp(-G) alone would be inf
    o_ref, s_ref = delta_rule_reference(q, k, v, g, beta)
    o, s = delta_rule_chunked(q, k, v, g, beta, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["head_gate", "channel_gate"])
def test_gradients_match_reference(per_channel: bool) -> None:
    inputs = _inputs(21, per_channel, seed=1)
    state0 = torch.randn(B, H, K, V)
    grads = []
    for fn in (delta_rule_reference, lambda *a: delta_rule_chunked(*a, chunk_size=8)):
        leaves = [x.clone().requires_grad_() for x in [*inputs, state0]]
        o, s = fn(*leaves)
        ((o * torch.linspace(-1, 1, V)).sum() + s.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, ref, got in zip(
        ["q", "k", "v", "g", "beta", "state"], grads[0], grads[1], strict=True
    ):
        print(f"grad {name}: rel {_rel(got, ref):.2e}")
        assert _rel(got, ref) < 1e-4, name


def test_prefill_then_steps_equal_whole_sequence() -> None:
    q, k, v, g, beta = _inputs(12, per_channel=False, seed=2)
    o_all, s_all = delta_rule_chunked(q, k, v, g, beta, chunk_size=4)
    o_pre, state = delta_rule_chunked(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7])
    steps = []
    for t in range(7, 12):
        o_t, state = delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        steps.append(o_t)
    o = torch.cat([o_pre, torch.stack(steps, dim=1)], dim=1)
    assert _rel(o, o_all) < 1e-5 and _rel(state, s_all) < 1e-5


def test_grouped_unnormalised_qk_as_the_layers_pass_them() -> None:
    """q/k with a third of v's heads, unnormalised, ``normalize_qk``: the same as normalising
    them and repeating each for its consecutive value heads (whole sequence and one step)."""
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(B, 9, 1, K, generator=gen) * 3 for _ in range(2))
    _, _, v, g, beta = _inputs(9, per_channel=False, seed=4)
    explicit = [F.normalize(x, dim=-1, eps=0).repeat_interleave(H, dim=2) for x in (q, k)]
    o, s = delta_rule(q, k, v, g, beta, normalize_qk=True)
    o_ref, s_ref = delta_rule_reference(*explicit, v, g, beta)
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    o_t, _ = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                               torch.zeros(B, H, K, V), normalize_qk=True)  # fmt: skip
    assert _rel(o_t, o_ref[:, 0]) < 1e-5


def test_fixed_order_step_is_the_defined_arithmetic() -> None:
    """Batch-invariant mode's step computes what the module docstring defines, bit for bit:
    its products over K as the pairwise tree of elementwise adds, exp through ``pointwise``.
    (Trainer-vs-generator checks cannot show a library sum swapped in on a host whose BLAS
    happens to give the same bits for every batch; this can.)"""
    gen = torch.Generator().manual_seed(6)
    Kd, Vd = 64, 48
    q, k = (F.normalize(torch.randn(B, H, Kd, generator=gen), dim=-1) for _ in range(2))
    v, state = torch.randn(B, H, Vd, generator=gen), torch.randn(B, H, Kd, Vd, generator=gen)
    g, beta = -F.softplus(torch.randn(B, H, generator=gen)), torch.rand(B, H, generator=gen)
    o, new_state = delta_rule_step(q, k, v, g, beta, state, fixed_order=True)

    def tree(x: torch.Tensor) -> torch.Tensor:  # lane i + lane i + half, halving
        while x.shape[-1] > 1:
            x = x[..., : x.shape[-1] // 2] + x[..., x.shape[-1] // 2 :]
        return x[..., 0]

    decayed = state * batch_invariant.pointwise(torch.exp, g)[..., None, None]
    u = v - tree((k[..., :, None] * decayed).transpose(-1, -2))
    want_state = decayed + beta[..., None, None] * k[..., :, None] * u[..., None, :]
    want_o = tree(((q * Kd**-0.5)[..., :, None] * want_state).transpose(-1, -2))
    assert torch.equal(new_state, want_state) and torch.equal(o, want_o)


def test_bf16_inputs_return_bf16_outputs_fp32_state() -> None:
    q, k, v, g, beta = _inputs(10, per_channel=True, dtype=torch.bfloat16)
    o, s = delta_rule(q, k, v, g, beta, impl="torch")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, _ = delta_rule_reference(q, k, v, g, beta)
    assert _rel(o, o_ref) < 1e-2


def test_unknown_impl_is_refused() -> None:
    q, k, v, g, beta = _inputs(2, per_channel=False)
    with pytest.raises(ValueError, match="unknown delta rule impl"):
        delta_rule(q, k, v, g, beta, impl="cuda")


def _documents(T: int) -> torch.Tensor:
    """Row 0: documents of 5, 30 and T - 35 tokens (one crossing a chunk edge, one ending on
    it); row 1: a single document."""
    row0 = torch.cat([torch.zeros(5), torch.ones(30), torch.full((T - 35,), 2.0)])
    return torch.stack([row0, torch.full((T,), 7.0)]).long()


@pytest.mark.parametrize("per_channel", [False, True], ids=["head_gate", "channel_gate"])
@pytest.mark.parametrize("with_state", [False, True])
def test_documents_restart_the_state(per_channel: bool, with_state: bool) -> None:
    """Packed rows: the chunked form equals the reference, and each document equals itself
    run alone (the initial state belongs to the row's first document)."""
    T = 50
    q, k, v, g, beta = _inputs(T, per_channel, seed=3)
    docs = _documents(T)
    state = torch.randn(B, H, K, V) if with_state else None
    o_ref, s_ref = delta_rule_reference(q, k, v, g, beta, state, doc_ids_BT=docs)
    o, s = delta_rule_chunked(q, k, v, g, beta, state, chunk_size=16, doc_ids_BT=docs)
    print(f"output rel {_rel(o, o_ref):.2e}, state rel {_rel(s, s_ref):.2e}")
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5
    for start, stop in ((0, 5), (5, 35), (35, T)):
        alone = [x[:1, start:stop] for x in (q, k, v, g, beta)]
        first = state[:1] if state is not None and start == 0 else None
        o_alone, s_alone = delta_rule_reference(*alone, first)
        assert _rel(o[:1, start:stop], o_alone) < 1e-5, (start, stop)
    assert _rel(s[:1], s_alone) < 1e-5
    row1_state = None if state is None else state[1:]
    o_row1, _ = delta_rule_chunked(*(x[1:] for x in (q, k, v, g, beta)), row1_state)
    assert _rel(o[1:], o_row1) < 1e-5


def test_document_gradients_match_reference() -> None:
    inputs = _inputs(40, per_channel=True, seed=4)
    docs = _documents(40)
    grads = []
    for fn in (delta_rule_reference, lambda *a, **kw: delta_rule_chunked(*a, **kw, chunk_size=8)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, s = fn(*leaves, doc_ids_BT=docs)
        ((o * torch.linspace(-1, 1, V)).sum() + s.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, ref, got in zip(["q", "k", "v", "g", "beta"], grads[0], grads[1], strict=True):
        print(f"grad {name}: rel {_rel(got, ref):.2e}")
        assert _rel(got, ref) < 1e-4, name


def test_fla_dispatch_check_compiles_in_one_graph() -> None:
    """The check impl "auto" makes on CUDA (is fla installed, is its backward safe here) runs
    inside compiled blocks: Dynamo cannot trace its imports, so it takes the results as
    constants (found on the H200: a fullgraph block failed with "Import failure")."""
    x = torch.ones(2, requires_grad=True)
    check = torch.compile(lambda x: x * float(_fla_suits(x)), fullgraph=True, backend="eager")
    torch.testing.assert_close(check(x), x * float(_fla_suits(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [False, True], ids=["head_gate", "channel_gate"])
def test_fla_kernels_match_the_chunked_form_on_gpu(per_channel: bool) -> None:
    """fla's Triton kernels (impl "fla": chunk_gated_delta_rule / chunk_kda, documents as
    variable-length sequences) against the fp32 chunked form: outputs, final states and
    gradients, with an initial state and packed documents, as the layers call them: q and k
    unnormalised in fp32 (``normalize_qk``; Gated DeltaNet's with half as many heads as v),
    v in bf16."""
    pytest.importorskip("fla.ops", reason="fla-core is not installed (pip install fla-core)")
    gen = torch.Generator().manual_seed(5)
    B, T, H = 2, 200, 4
    qk_heads = H if per_channel else H // 2  # KDA: as many; Gated DeltaNet: grouped
    q = torch.randn(B, T, qk_heads, 64, generator=gen)
    k = torch.randn(B, T, qk_heads, 64, generator=gen)
    v = torch.randn(B, T, H, 64, generator=gen)
    g = -F.softplus(torch.randn(B, T, H, *((64,) if per_channel else ()), generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, 64, 64, generator=gen) * 0.1
    docs = torch.cat([torch.zeros(B, 70), torch.ones(B, 130)], dim=1).long().cuda()
    inputs = [q.cuda(), k.cuda(), v.cuda().to(torch.bfloat16), g.cuda(), beta.cuda()]
    # fla's backward is only asked for where it is safe (fla_backward_safe: everywhere but a fla
    # without backend dispatch on Hopper with Triton >= 3.4, < 3.7.1); the forward everywhere.
    grads = fla_backward_safe()
    results = []
    for impl in ("torch", "fla"):
        leaves = [x.clone().requires_grad_(grads) for x in inputs]
        o, s = delta_rule(*leaves, state.cuda(), impl=impl, doc_ids_BT=docs, normalize_qk=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        if grads:
            (o.float().square().sum() + s.square().sum()).backward()
        results.append([o, s] + ([x.grad for x in leaves] if grads else []))
    names = ["o", "state", "dq", "dk", "dv", "dg", "dbeta"]
    rounded = _normalised_grads(inputs, state.cuda(), docs) if grads else {}
    for name, ours, theirs in zip(names, results[0], results[1], strict=False):
        error = (theirs.float() - ours.float()).norm().item()
        # 2% of the gradient, plus for dq and dk bf16's rounding of what fla rounds
        allowed = 2e-2 * ours.float().norm().item()
        if name in rounded:
            allowed += 5e-3 * rounded[name].norm().item()
        print(f"fla vs torch {name}: rel {error / ours.float().norm().item():.1e}, "
              f"allowed {allowed / ours.float().norm().item():.1e}")  # fmt: skip
        assert error < allowed, name


def _normalised_grads(inputs: list[torch.Tensor], state, docs) -> dict[str, torch.Tensor]:
    """dq and dk of the chunked form taken at the normalised q and k, over |q| and |k|: the
    size of what fla stores in bf16 before its in-kernel l2norm backward projects out the
    radial part. For Gated DeltaNet's k here that part is most of it (these norms are 20x dk's),
    so bf16's rounding of it is 5e-2 of dk: an H200 measured 5.2e-2, and on the CPU fla's
    kernels in fp32 through Triton's interpreter, with every tensor fla keeps in bf16 rounded
    to bf16, give 4.9e-2 with fla's own dqkwg kernel and with torchloom's alike, and 2.8e-1
    with a step whose dk is 0.8x (benchmarks/fla_bf16_emulation.py)."""
    q, k, *rest = inputs
    leaves = [F.normalize(x, dim=-1).detach().requires_grad_() for x in (q, k)]
    o, s = delta_rule(*leaves, *rest, state, impl="torch", doc_ids_BT=docs, normalize_qk=False)
    (o.float().square().sum() + s.square().sum()).backward()
    return {
        name: leaf.grad / x.norm(dim=-1, keepdim=True)
        for name, leaf, x in zip(("dq", "dk"), leaves, (q, k))
    }
