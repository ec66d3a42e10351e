"""Greedy completion by repeated full forward passes: the simplest generator, used for the
end-of-training sample. It runs the trained module itself, unchanged."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_complete(
    model: nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] | None = None
) -> list[int]:
    """The ``max_new_tokens`` (or fewer: up to a stop id) tokens that greedy decoding appends."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(model(tokens)[0, -1].argmax())
        if stop_ids and next_id in stop_ids:
            break
        new.append(next_id)
        tokens = torch.cat([tokens, tokens.new_tensor([[next_id]])], dim=1)
    model.train(was_training)
    return new
