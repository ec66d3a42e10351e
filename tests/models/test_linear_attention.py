"""Gated DeltaNet (models/components/linear_attention.py): its two projection layouts, and its
generation state: right-padded prefill then decode steps equal the full forward, slot copies,
and the whole hybrid model (DeltaNet + gated attention) through a ModelCache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torchloom.kernels import batch_invariant
from torchloom.models.components.cache import Binding
from torchloom.models.components.linear_attention import GatedDeltaNet
from torchloom.models.qwen3_next import QWEN3_NEXT_FLAVORS

DIM, KEY_HEADS, VALUE_HEADS, DK, DV = 32, 2, 4, 8, 12


def _layer(fused: bool = False, seed: int = 0, invariant: bool = False) -> GatedDeltaNet:
    layer = GatedDeltaNet(
        DIM, KEY_HEADS, VALUE_HEADS, DK, DV, conv_kernel=4, fused_projections=fused,
        invariant=invariant,
    )  # fmt: skip
    if invariant:
        batch_invariant.make_linears_batch_invariant(layer)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return layer.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def test_fused_layout_is_a_permutation_of_the_split_one() -> None:
    """Qwen3-Next's per-key-head fused rows, reordered, are Qwen3.5's separate projections."""
    fused, split = _layer(fused=True), _layer(fused=False, seed=1)
    group, gv = VALUE_HEADS // KEY_HEADS, VALUE_HEADS // KEY_HEADS * DV
    rows = fused.in_proj_qkvz.weight.view(KEY_HEADS, 2 * DK + 2 * gv, DIM)
    q, k, v, z = rows.split([DK, DK, gv, gv], dim=1)
    for name, part in (("in_proj_q", q), ("in_proj_k", k), ("in_proj_v", v)):
        split.get_submodule(name).weight.copy_(part.reshape(-1, DIM))
    split.in_proj_z.weight.copy_(z.reshape(-1, DIM))
    b, a = fused.in_proj_ba.weight.view(KEY_HEADS, 2 * group, DIM).chunk(2, dim=1)
    split.in_proj_b.weight.copy_(b.reshape(-1, DIM))
    split.in_proj_a.weight.copy_(a.reshape(-1, DIM))
    for name in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log",
                 "norm.weight", "out_proj.weight"):  # fmt: skip
        split.get_parameter(name).copy_(fused.get_parameter(name))
    x = torch.randn(2, 19, DIM, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(split(x), fused(x), rtol=1e-6, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("invariant", [False, True], ids=["chunked", "batch_invariant"])
def test_prefill_then_decode_equals_full_forward(invariant: bool, padded_prefill) -> None:
    """Rows of different lengths prefilled together (right-padded) into slots 2 and 0, then
    decoded token by token: every output equals the full forward's, and so does the state.
    In batch-invariant mode bit for bit, and the full forward of a row alone equals its
    forward in the batch."""
    layer = _layer(invariant=invariant)
    lengths, total = [5, 9], 14
    x = torch.randn(2, total, DIM, generator=torch.Generator().manual_seed(3))
    full = layer(x)

    def check(got: torch.Tensor, want: torch.Tensor, label: object) -> None:
        if invariant:
            diff = (got - want).abs().max().item()
            assert torch.equal(got, want), f"{label}: max |diff| {diff:.1e}"
        else:
            assert _rel(got, want) < 1e-5, label

    if invariant:
        check(layer(x[1:]), full[1:], "row alone vs in the batch")
    slots = torch.tensor([2, 0])
    state, out = padded_prefill(layer, x, lengths, slots.tolist())
    for row, n in enumerate(lengths):
        check(out[row, :n], full[row, :n], f"prefill row {row}")
    position = torch.tensor(lengths)
    for _ in range(total - max(lengths) + 4):
        live = position < total
        rows = live.nonzero().flatten()
        token = x[rows, position[rows]][:, None]
        pos = position[rows][:, None]
        binding = Binding(slots[rows], pos, int(pos.max()) + 1, leading=False)
        step = layer(token, cache=state.bound(binding))
        expected = full[rows, position[rows]][:, None]
        check(step, expected, (rows, position))
        position[rows] += 1


@torch.no_grad()
def test_copied_slot_continues_like_the_original() -> None:
    layer = _layer()
    x = torch.randn(1, 8, DIM, generator=torch.Generator().manual_seed(4))
    state = layer.new_state(slots=3, max_len=16, device=torch.device("cpu"), dtype=torch.float32)
    layer(x[:, :6], cache=state.bound(Binding(torch.tensor([1]), torch.arange(6)[None], 6, False)))
    state.copy_slot(1, torch.tensor([0, 2]), 6)
    binding = Binding(torch.tensor([0, 2]), torch.tensor([[6], [6]]), 7, leading=False)
    out = layer(x[:, 6:7].expand(2, -1, -1), cache=state.bound(binding))
    expected = layer(x[:, :7])[:, 6:7]
    torch.testing.assert_close(out, expected.expand(2, -1, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", [None, ("full_attention",) + ("linear_attention",) * 3])
@torch.no_grad()
def test_hybrid_model_decodes_like_its_full_forward(layers, randomize) -> None:
    """The debug Qwen3-Next (DeltaNet, gated attention with partial RoPE, MoE) through a
    ModelCache: prefill then greedy-style decode steps give the full forward's logits."""
    cfg = QWEN3_NEXT_FLAVORS["debug"]
    if layers:
        cfg = replace(cfg, layer_types=layers)
    model = cfg.build().eval()
    randomize(model, 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    full = model(tokens)
    cache = model.new_cache(slots=2, max_len=16, device=torch.device("cpu"), dtype=torch.float32)
    slots = torch.tensor([1, 0])
    prefill = model(tokens[:, :7], cache=cache.bind(slots, torch.arange(7).expand(2, -1)))
    outputs = [prefill]
    for t in range(7, 12):
        positions = torch.full((2, 1), t)
        outputs.append(model(tokens[:, t : t + 1], positions, cache=cache.bind(slots, positions)))
    rel = _rel(torch.cat(outputs, dim=1), full)
    print(f"cached vs full logits: rel {rel:.1e}")
    assert rel < 1e-5


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@torch.no_grad()
def test_packed_documents_equal_each_document_alone(fused: bool) -> None:
    """A row of documents of 3, 70 and 11 tokens: each document's outputs are its own forward
    (the convolution and the delta rule restart at its first token)."""
    layer = _layer(fused)
    lengths = [3, 70, 11]
    x = torch.randn(1, sum(lengths), DIM, generator=torch.Generator().manual_seed(6))
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    packed = layer(x, doc_ids_BT=docs)
    start = 0
    for n in lengths:
        alone = layer(x[:, start : start + n])
        rel = _rel(packed[:, start : start + n], alone)
        print(f"document of {n}: rel {rel:.1e}")
        assert rel < 1e-5
        start += n


@torch.no_grad()
def test_bf16_layer_and_state_follow_fp32() -> None:
    """In bf16 the outputs (and the convolution state) are bf16, the recurrent state fp32, and
    prefill + decode stay within bf16 rounding of the fp32 forward."""
    layer = _layer()
    x = torch.randn(2, 10, DIM, generator=torch.Generator().manual_seed(7))
    reference = layer(x)
    layer = layer.to(torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    full = layer(x16)
    state = layer.new_state(2, 16, torch.device("cpu"), torch.bfloat16)
    assert state.conv.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
    slots = torch.tensor([0, 1])
    prefill = layer(
        x16[:, :6], cache=state.bound(Binding(slots, torch.arange(6).expand(2, -1), 6, False))
    )
    steps = [prefill]
    for t in range(6, 10):
        positions = torch.full((2, 1), t)
        steps.append(
            layer(x16[:, t : t + 1], cache=state.bound(Binding(slots, positions, t + 1, False)))
        )
    cached = torch.cat(steps, dim=1)
    assert full.dtype == cached.dtype == torch.bfloat16
    for label, out in (("full", full), ("cached", cached)):
        rel = _rel(out.float(), reference)
        print(f"bf16 {label} vs fp32: rel {rel:.1e}")
        assert rel < 2e-2


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_compiled_layer_matches_eager_with_gradients(fused: bool) -> None:
    """torch.compile (fullgraph, AOT autograd) of the layer, packed documents included: the
    same outputs and gradients (compiled backwards once refused the kernel's transposed
    gradient layouts)."""
    layer = _layer(fused)
    x = torch.randn(2, 40, DIM, generator=torch.Generator().manual_seed(8))
    docs = torch.cat([torch.zeros(2, 15), torch.ones(2, 25)], dim=1).long()
    grads = []
    for run in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        layer.zero_grad()
        leaf = x.clone().requires_grad_()
        out = run(leaf, doc_ids_BT=docs)
        out.square().sum().backward()
        grads.append((out.detach(), leaf.grad, layer.in_proj_a.weight.grad if not fused
                      else layer.in_proj_ba.weight.grad))  # fmt: skip
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
