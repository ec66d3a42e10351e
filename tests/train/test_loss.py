"""Objectives (torchloom/train/loss.py) against direct formulas."""

from __future__ import annotations

import torch

from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.loss import IGNORE_INDEX, CrossEntropy, TokenLogProbs


def _model_and_batch():
    model = build_model(resolve_model_config(ModelConfig(name="qwen3")))  # tied head
    model.init_weights(0)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 4096, (2, 10), generator=gen)
    labels = torch.randint(0, 4096, (2, 10), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # a prompt
    labels[1, -1] = IGNORE_INDEX
    return model, tokens, labels


def test_token_logprobs_and_entropy_by_the_formula() -> None:
    model, tokens, labels = _model_and_batch()
    out = model(tokens, objective=TokenLogProbs(), targets={"labels": labels})
    with torch.no_grad():
        logprobs_BTV = torch.log_softmax(model(tokens).double(), -1)
    valid = labels != IGNORE_INDEX
    want = logprobs_BTV.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * valid
    entropy = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1) * valid
    got = out.per_token["logprobs"]
    print(f"max |logprob diff| {(got.double() - want).abs().max():.1e}")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.per_token["entropy"].double(), entropy, atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all() and (out.per_token["entropy"][~valid] == 0).all()
    # Its loss is the cross-entropy sum, with a gradient.
    ce = model(tokens, objective=CrossEntropy(), targets={"labels": labels}).loss
    torch.testing.assert_close(out.loss, ce)
    out.loss.backward()
    assert model.embed_tokens.weight.grad is not None


def test_normalizer_is_the_label_count() -> None:
    from torchloom.data.packing import Batch

    _, tokens, labels = _model_and_batch()
    batch = Batch(tokens, labels, torch.arange(10).expand(2, 10))
    assert CrossEntropy().normalizer(batch) == TokenLogProbs().normalizer(batch) == 20 - 4
