"""Full (unsharded) tensors of a parallelized model, one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def full_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on the CPU) for every state-dict entry, gathering DTensors one by one.

    Gathering is a collective: every rank must exhaust this iterator, in the same order, even
    the ranks that do not write anything. Peak extra memory is one full tensor.
    """
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach().cpu()
