"""Model families by name: each is a ModelSpec with its config class, named flavors, tensor-
parallel plan and Hugging Face adapter. A family's model is built from its config
(``config.build()``)."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.fields import check_type, from_dict, leaf_paths
from torchloom.kernels.batch_invariant import make_linears_batch_invariant
from torchloom.kernels.float8 import convert_linears_to_float8
from torchloom.models.components.decoder import DecoderConfig

if TYPE_CHECKING:
    from torchloom.models.hf_adapter import HFAdapter


@dataclass(frozen=True)
class ModelSpec:
    """A model family: its config class, named sizes, plans and adapters."""

    name: str
    """Family name used as ``--model.name`` (e.g. 'llama3')."""
    config_cls: type[DecoderConfig]
    """The family's config class; saved models and checkpoints store one as a dict."""
    flavors: dict[str, DecoderConfig]
    """Named architectures of this family ('debug', '8B', ...)."""
    description: str = ""
    """One line shown when listing models."""
    hf_adapter: HFAdapter | None = None
    """Maps Hugging Face config.json and tensor names to this family (None: no HF interop)."""
    tp_plan: Callable[..., dict] | None = None
    """``tp_plan(model, tp, loss_parallel, sequence_parallel=True) -> {module path:
    ParallelStyle}``: the family's tensor- (and sequence-) parallel plan, applied by
    torchloom.parallel (None: tensor parallelism refused)."""

    def __post_init__(self) -> None:
        for name, flavor in self.flavors.items():
            if not isinstance(flavor, self.config_cls):
                raise TypeError(f"flavor {name!r} of {self.name} is not a {self.config_cls}")

    def flavor(self, name: str) -> DecoderConfig:
        """The named flavor, or a ConfigError listing the available ones."""
        if name not in self.flavors:
            raise ConfigError(
                f"Unknown flavor '{name}' for model '{self.name}'.{did_you_mean(name, self.flavors)} "
                f"Available: {', '.join(self.flavors)}."
            )
        return self.flavors[name]


_MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a family; registering a name twice is a programming error."""
    if spec.name in _MODELS:
        raise ValueError(f"model family '{spec.name}' is already registered")
    _MODELS[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    """The family called ``name``, or a ConfigError with near matches."""
    if not isinstance(name, str):
        raise ConfigError(
            f"A model family name must be a str, got {name!r}; known: {', '.join(sorted(_MODELS))}."
        )
    if name not in _MODELS:
        raise ConfigError(
            f"Unknown model '{name}'.{did_you_mean(name, _MODELS)} "
            f"Available: {', '.join(sorted(_MODELS))}."
        )
    return _MODELS[name]


def list_models() -> list[ModelSpec]:
    """All registered families, sorted by name."""
    return [_MODELS[name] for name in sorted(_MODELS)]


def get_hf_model_spec(model_type: str | None) -> ModelSpec:
    """The family that reads Hugging Face checkpoints of ``model_type`` ('llama' -> llama3)."""
    adapters = [(s, s.hf_adapter) for s in _MODELS.values() if s.hf_adapter is not None]
    by_type = {t: s for s, a in adapters for t in (a.model_type, *a.reads_also)}
    if model_type not in by_type:
        known = ", ".join(f"{t} ({s.name})" for t, s in sorted(by_type.items()))
        hint = did_you_mean(str(model_type), by_type)
        raise ConfigError(
            f"Hugging Face model_type {model_type!r} is not supported.{hint} torchloom reads: "
            f"{known}."
        )
    return by_type[model_type]


_RETIRED_FIELDS = frozenset({"loss_impl"})
"""Config fields earlier versions saved that are no longer part of a model (the loss moved to
the job: --model.loss_impl); dropped when such a config is read."""


def config_from_dict(family: str, data: dict[str, Any]) -> DecoderConfig:
    """The family's config from a saved dict (a model folder's or a checkpoint marker's)."""
    kept = {key: value for key, value in data.items() if key not in _RETIRED_FIELDS}
    return from_dict(get_model_spec(family).config_cls, kept)


def check_field_types(config: Any, prefix: str = "model ") -> None:
    """ConfigError naming the first field of the config dataclass ``config`` (nested ones as
    'rope.theta') whose value does not fit its annotation: validate's comparisons assume the
    annotated types. A Literal field is only checked to be a str: validate names the choices
    and near matches."""
    for path, hint, value, _ in leaf_paths(config):
        if typing.get_origin(hint) is typing.Literal:
            hint = type(typing.get_args(hint)[0])
        check_type(value, hint, f"{prefix}{path}")


def build_model(config: DecoderConfig) -> nn.Module:
    """Construct the model of a resolved family config on the current default device (weights
    not yet initialized); a job's ModelConfig resolves to one with
    ``models.config.resolve_model_config``. For large models build under
    ``torch.device("meta")``, parallelize, then ``to_empty(device=...)`` and
    ``init_weights(seed)`` (or load weights).
    """
    if not isinstance(config, DecoderConfig):
        raise TypeError(
            f"build_model takes a family config (DecoderConfig); got {type(config).__name__}. "
            "Resolve a job's ModelConfig first: build_model(resolve_model_config(model_config))."
        )
    check_field_types(config)
    config.validate()
    model = config.build()
    if config.batch_invariant:
        make_linears_batch_invariant(model)
    if config.float8 != "none":
        convert_linears_to_float8(model, config.float8)
    return model
