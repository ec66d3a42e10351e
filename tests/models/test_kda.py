"""Kimi Delta Attention (models/components/kda.py) against transformers' KimiLinearDeltaAttention
with the same weights; generation state (prefill of right-padded rows, then decode steps) and
packed documents against whole-sequence forwards."""

from __future__ import annotations

import pytest
import torch
import transformers

from torchloom.models.components.cache import Binding
from torchloom.models.components.kda import KimiDeltaAttention
from torchloom.models.components.param_init import ParamInit

DIM, HEADS, HEAD_DIM, CONV = 64, 4, 16, 4


def _hf_layer(seed: int = 0) -> torch.nn.Module:
    config = transformers.KimiLinearConfig(
        vocab_size=128, hidden_size=DIM, num_hidden_layers=1, linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM, linear_conv_kernel_dim=CONV, layer_types=["linear_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    layer = transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention(config, 0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return layer.eval()


def _ours_from(hf_layer: torch.nn.Module) -> KimiDeltaAttention:
    ours = KimiDeltaAttention(DIM, HEADS, HEAD_DIM, CONV, norm_eps=1e-5)
    state = {k.removeprefix("forget_gate."): v for k, v in hf_layer.state_dict().items()}
    q, k, v = state.pop("conv1d.weight").chunk(3, dim=0)  # transformers stacks q, k, v
    state |= {"q_conv1d.weight": q, "k_conv1d.weight": k, "v_conv1d.weight": v}
    ours.load_state_dict(state)
    return ours.eval()


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 37, 70])
def test_matches_transformers(T: int) -> None:
    """Same weights, fp32 on the CPU: transformers' torch fallback (chunked, 64) and ours."""
    hf_layer = _hf_layer()
    ours = _ours_from(hf_layer)
    x = torch.randn(2, T, DIM, generator=torch.Generator().manual_seed(1))
    theirs = hf_layer(x)
    rel = _rel(ours(x), theirs)
    print(f"KDA T={T}: max abs diff / max abs output {rel:.1e}")
    assert rel < 1e-5


@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(padded_prefill) -> None:
    """Right-padded prompts of different lengths in a shared prefill, then one token per step
    (slots in another order): every output equals the full forward's."""
    ours = _ours_from(_hf_layer(seed=2))
    lengths, total = [5, 9, 1], 14
    x = torch.randn(3, total, DIM, generator=torch.Generator().manual_seed(3))
    full = ours(x)
    slots = torch.tensor([2, 0, 3])
    state, out = padded_prefill(ours, x, lengths, slots.tolist())
    worst = max(_rel(out[row, :n], full[row, :n]) for row, n in enumerate(lengths))
    order = [1, 0, 2]  # decode rows in another order than the prefill's
    for step in range(total - min(lengths)):
        rows = [r for r in order if lengths[r] + step < total]
        pos = torch.tensor([[lengths[r] + step] for r in rows])
        binding = Binding(slots[rows], pos, int(pos.max()) + 1, leading=False)
        token = torch.stack([x[r, lengths[r] + step] for r in rows])[:, None]
        out = ours(token, cache=state.bound(binding))
        for i, r in enumerate(rows):
            worst = max(worst, _rel(out[i, 0], full[r, lengths[r] + step]))
    print(f"KDA prefill + decode vs full forward: max relative diff {worst:.1e}")
    assert worst < 1e-5


@torch.no_grad()
def test_copy_slot_continues_the_same_sequence() -> None:
    ours = _ours_from(_hf_layer(seed=4))
    x = torch.randn(1, 7, DIM, generator=torch.Generator().manual_seed(5))
    full = ours(x)
    state = ours.new_state(slots=3, max_len=16, device=torch.device("cpu"), dtype=torch.float32)
    binding = Binding(torch.tensor([1]), torch.arange(6)[None], 6, leading=False)
    ours(x[:, :6], cache=state.bound(binding))
    state.copy_slot(1, torch.tensor([0, 2]), 6)
    binding = Binding(torch.tensor([0, 2]), torch.tensor([[6], [6]]), 7, leading=False)
    out = ours(x[:, 6:].expand(2, -1, -1), cache=state.bound(binding))
    for row in range(2):
        assert _rel(out[row, 0], full[0, 6]) < 1e-5


@torch.no_grad()
def test_packed_documents_equal_separate_sequences() -> None:
    ours = _ours_from(_hf_layer(seed=6))
    sizes = [[5, 12, 3], [20]]
    x = torch.randn(2, 20, DIM, generator=torch.Generator().manual_seed(7))
    doc_ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in sizes])
    packed = ours(x, None, None, doc_ids)
    worst = 0.0
    for row, docs in enumerate(sizes):
        start = 0
        for n in docs:
            alone = ours(x[row : row + 1, start : start + n])
            worst = max(worst, _rel(packed[row, start : start + n], alone[0]))
            start += n
    print(f"KDA packed documents vs separate: max relative diff {worst:.1e}")
    assert worst < 1e-5


def test_init_and_gradients() -> None:
    """Every parameter initialized (FLA's gate ranges); the gradient reaches all of them."""
    layer = KimiDeltaAttention(DIM, HEADS, HEAD_DIM, CONV)
    init = ParamInit(layer, seed=0)
    layer.init_weights(init)
    init.check_complete(layer)
    decay = layer.A_log.exp()
    assert decay.min() >= 1.0 and decay.max() <= 16.0
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert dt.min() >= 1e-3 * 0.99 and dt.max() <= 1e-1 * 1.01
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(8))
    layer(x).square().sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
