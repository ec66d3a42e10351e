"""Stacked projections (models/components/fused_linear.py): the same parameters, now views of one
weight per module; forwards without autograd run the stacked matmul and match the separate ones;
training still reaches every weight; in-place writes reach the stacked weight."""

import pytest
import torch

from torchloom.generate.weights import copy_weights_
from torchloom.kernels import batch_invariant
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.attention import Attention
from torchloom.models.components.fused_linear import fuse_linears, fuse_projections_
from torchloom.models.components.mlp import SwiGLU


def tiny(family: str):
    model = build_model(resolve_model_config(ModelConfig(name=family, flavor="debug")))
    model.init_weights(0)
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_next", "muse_glimmer", "deepseek_v3"])
def test_fused_forward_matches_and_parameters_stay(family):
    """llama3/qwen3: q/k/v and gate/up; qwen3_next: output gate inside q_proj, shared experts;
    muse_glimmer: a fourth projection (gate_proj); deepseek_v3: MLA (left alone) and SwiGLU."""
    model = tiny(family)
    ids = tokens(model.config.vocab_size)
    before = {name: (id(p), p.shape) for name, p in model.named_parameters()}
    with torch.no_grad():
        want = model(ids)
    fused = fuse_projections_(model)
    modules = [m for m in model.modules() if isinstance(m, Attention | SwiGLU)]
    assert fused == len(modules) > 0
    assert {name: (id(p), p.shape) for name, p in model.named_parameters()} == before
    for module in modules:
        stacked = module.fused_in if isinstance(module, Attention) else module.gate_up
        for linear in module._in_projections() if isinstance(module, Attention) else (
            module.gate_proj, module.up_proj):  # fmt: skip
            assert (
                linear.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
            )
    with torch.no_grad():
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fuse_projections_(model) == 0  # once only


def test_training_reaches_every_weight_and_writes_reach_the_stacked_weight():
    model, reference = tiny("qwen3"), tiny("qwen3")
    fuse_projections_(model)
    ids = tokens(model.config.vocab_size)
    model(ids).float().logsumexp(-1).sum().backward()
    reference(ids).float().logsumexp(-1).sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6)

    # New weights copied in place (the generator's update_weights) drive the stacked path.
    other = tiny("qwen3")
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.5)
        copy_weights_(model, dict(other.named_parameters()))
        torch.testing.assert_close(model(ids), other(ids), rtol=1e-5, atol=1e-5)


def test_fuse_linears_leaves_what_it_cannot_stack():
    biased = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]
    widths = [torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(6, 4, bias=False)]
    dtypes = [torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False).double()]
    for linears in (biased, widths, dtypes, widths[:1]):
        pointers = [lin.weight.data_ptr() for lin in linears]
        assert fuse_linears(linears) is None
        assert [lin.weight.data_ptr() for lin in linears] == pointers


def invariant(dtype: torch.dtype):
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug", batch_invariant=True))
    model = build_model(config)
    model.init_weights(0)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariant_stacking_changes_no_bit(dtype):
    """Batch-invariant mode stacks where its matmul gives every column the same bits whatever
    the weight's width (the CPU references: each output is its own fixed-order sum), so the
    stacked forward equals the separate one bit for bit, not merely closely. The GPU side:
    tests/generate/test_batch_invariant.py's generators stack on sm_90 and match the trainer."""
    model, separate = invariant(dtype), invariant(dtype)
    assert fuse_projections_(model) == len(model.layers) * 2
    ids = tokens(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids), separate(ids))


def test_batch_invariant_model_is_not_stacked_where_bits_would_change(monkeypatch):
    monkeypatch.setattr(batch_invariant, "stacking_keeps_bits", lambda weight: False)
    model = invariant(torch.float32)
    assert fuse_projections_(model) == 0
    assert all(m.fused_in is None for m in model.modules() if isinstance(m, Attention))
