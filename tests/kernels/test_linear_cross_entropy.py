"""The chunked fused head + cross-entropy against logits followed by cross_entropy."""

import pytest
import torch

from torchloom.kernels.linear_cross_entropy import (
    IGNORE_INDEX,
    cross_entropy_sum,
    linear_cross_entropy_sum,
)
from torchloom.models import ModelConfig, build_model, resolve_model_config


@pytest.mark.parametrize("chunk", [1, 64, 10_000])
def test_matches_full_logits_loss_and_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=gen, requires_grad=True)
    w = torch.randn(1000, 32, generator=gen, requires_grad=True)
    labels = torch.randint(0, 1000, (300,), generator=gen)
    labels[::7] = IGNORE_INDEX
    reference = cross_entropy_sum((h @ w.T)[None], labels[None])
    (2 * reference).backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    fused = linear_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
    (2 * fused).backward()
    diffs = [abs(fused.item() - reference.item()) / reference.item(),
             (h.grad - grads[0]).abs().max().item(), (w.grad - grads[1]).abs().max().item()]  # fmt: skip
    print(f"chunk {chunk}: rel loss diff {diffs[0]:.1e}, max |grad h diff| {diffs[1]:.1e}, "
          f"max |grad w diff| {diffs[2]:.1e}")  # fmt: skip
    assert diffs[0] < 1e-6 and diffs[1] < 1e-4 and diffs[2] < 1e-4
    with torch.no_grad():  # no gradients kept: only the loss
        assert torch.allclose(linear_cross_entropy_sum(h, w, labels), reference, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])  # untied head / tied embeddings
def test_model_loss_impls_agree(family):
    losses, grads = {}, {}
    for impl in ("full", "chunked"):
        config = resolve_model_config(ModelConfig(name=family, flavor="debug", loss_impl=impl))
        model = build_model(config, family)
        model.init_weights(torch.Generator().manual_seed(0))
        tokens = torch.randint(
            0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)
        )
        labels = tokens.roll(-1, 1)
        labels[:, -1] = IGNORE_INDEX
        losses[impl] = model(tokens, labels_BT=labels)
        losses[impl].backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    diff = max((grads["full"][n] - g).abs().max().item() for n, g in grads["chunked"].items())
    print(f"{family}: loss {losses['full'].item():.4f} vs {losses['chunked'].item():.4f}, "
          f"max |grad diff| {diff:.1e}")  # fmt: skip
    torch.testing.assert_close(losses["chunked"], losses["full"], rtol=1e-6, atol=0)
    assert diff < 1e-5
