"""New weights into a model in place (``Generator.update_weights``): each parameter keeps its
storage, so a KV cache, CUDA graphs captured over the model and a compiled step go on working,
and nothing passes through host memory that was not there already.

Weights are named as the model names its parameters (``model.named_parameters()``, which is
also what ``state_dict()`` holds for torchloom's models). A weight may be a full tensor (a
sharded parameter takes its own box of it) or a DTensor laid out like the parameter (its local
shard is copied). Values are cast to the parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.config.errors import did_you_mean
from torchloom.models.components.param_init import local_box, local_tensor

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@torch.no_grad()
def copy_weights_(model: nn.Module, weights: Weights, partial: bool = False) -> None:
    """Copy every given weight into the parameter of that name, in place. Every name must be a
    parameter of ``model`` with the same shape, and (unless ``partial``) every parameter must
    be given; otherwise one ValueError lists what is wrong and nothing is copied."""
    params = dict(model.named_parameters())
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    problems = _problems(params, pairs, partial)
    if problems:
        raise ValueError("update_weights refused (nothing was copied): " + " ".join(problems))
    for name, value in pairs:
        param = params[name]
        local_tensor(param).copy_(_local_part(param, value))


def _problems(
    params: dict[str, nn.Parameter], pairs: list[tuple[str, torch.Tensor]], partial: bool
) -> list[str]:
    """What keeps ``pairs`` from being copied into ``params``, one sentence each."""
    problems = []
    unknown = [name for name, _ in pairs if name not in params]
    if unknown:
        problems.append(
            f"{len(unknown)} name(s) are not parameters of the model: {_listed(unknown)}."
            f"{did_you_mean(unknown[0], params)}"
        )
    given = {name for name, _ in pairs}
    missing = [name for name in params if name not in given]
    if missing and not partial:
        problems.append(
            f"{len(missing)} parameter(s) are not given: {_listed(missing)} (pass partial=True "
            "to update only some)."
        )
    for name, value in pairs:
        problem = _layout_problem(params[name], value) if name in params else None
        if problem:
            problems.append(f"'{name}' {problem}.")
    return problems


def _layout_problem(param: torch.Tensor, value: torch.Tensor) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a torch.Tensor: give torch.as_tensor(value)"
    if value.is_meta:
        return "is on the meta device, which holds no values to copy"
    if tuple(value.shape) != tuple(param.shape):
        return f"has shape {list(value.shape)}, the parameter {list(param.shape)}"
    if not isinstance(value, DTensor):
        return None
    # A DTensor's local shard is only this rank's box if it is split like the parameter.
    placements = param.placements if isinstance(param, DTensor) else None
    if value.placements != placements:
        return (
            f"is a DTensor placed {list(value.placements)}, the parameter "
            f"{'unsharded' if placements is None else list(placements)}: give the full tensor "
            "(DTensor.full_tensor()) or one placed like the parameter"
        )
    return None


def _local_part(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The part of ``value`` (shaped like ``param``) that this rank's shard of ``param`` holds."""
    if isinstance(value, DTensor):
        return value.to_local()
    return value[local_box(param)]  # the whole tensor when ``param`` is not sharded


def _listed(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more
