"""What a training checkpoint holds, part by part: anything with ``state_dict`` and
``load_state_dict`` joins the registry a CheckpointManager is given (an RL rollout buffer, a
reference model, an expert-bias buffer...). The model and its optimizers go through DCP's
state-dict utilities, which name every tensor by its single-process parameter name and keep
DTensor shards, so any layout resumes any other's checkpoint."""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """A model's (or a pipeline rank's stages') parameters and buffers."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState:
    """The optimizers' state of ``model``'s parameters, by parameter name; a container of
    several optimizers (train/optim.py) saves as their union."""

    def __init__(self, model: nn.Module, optimizer: Optimizer) -> None:
        self.model = model
        self.optimizers = getattr(optimizer, "optimizers", [optimizer])

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers, state_dict)
