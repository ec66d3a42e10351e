"""Model families by name: each is a ModelSpec with its module class and named flavors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.kernels.batch_invariant import make_linears_batch_invariant
from torchloom.kernels.float8 import convert_linears_to_float8
from torchloom.models.components.transformer import Transformer, TransformerConfig

if TYPE_CHECKING:
    from torchloom.models.config import ModelConfig
    from torchloom.models.hf_adapter import HFAdapter


@dataclass(frozen=True)
class ModelSpec:
    """A model family: how to build it and its named sizes."""

    name: str
    """Family name used as ``--model.name`` (e.g. 'llama3')."""
    model_cls: type[nn.Module]
    """Module class, constructed as ``model_cls(TransformerConfig)``."""
    flavors: dict[str, TransformerConfig]
    """Named architectures of this family ('debug', '8B', ...)."""
    description: str = ""
    """One line shown when listing models."""
    hf_adapter: HFAdapter | None = None
    """Maps Hugging Face config.json and tensor names to this family (None: no HF interop)."""
    tp_plan: Callable[..., dict] | None = None
    """``tp_plan(model, tp, loss_parallel) -> {module path: ParallelStyle}``: the family's
    tensor-parallel plan, applied by torchloom.parallel (None: tensor parallelism refused)."""

    def flavor(self, name: str) -> TransformerConfig:
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
    by_type = {s.hf_adapter.model_type: s for s in _MODELS.values() if s.hf_adapter is not None}
    if model_type not in by_type:
        known = ", ".join(f"{t} ({s.name})" for t, s in sorted(by_type.items()))
        hint = did_you_mean(str(model_type), by_type)
        raise ConfigError(
            f"Hugging Face model_type {model_type!r} is not supported.{hint} torchloom reads: "
            f"{known}."
        )
    return by_type[model_type]


def build_model(config: ModelConfig | TransformerConfig, family: str | None = None) -> nn.Module:
    """Construct the model on the current default device (weights not yet initialized).

    From a job's ModelConfig the family is its ``name``; from a TransformerConfig pass the
    ``family`` (None builds the generic Transformer). For large models build under
    ``torch.device("meta")``, then ``to_empty(device=...)`` and ``init_weights()``.
    """
    if not isinstance(config, TransformerConfig):
        # Imported here because resolving a ModelConfig itself looks families up in this module.
        from torchloom.models.config import resolve_model_config

        family, config = config.name, resolve_model_config(config)
    config.validate()
    model_cls = Transformer if family is None else get_model_spec(family).model_cls
    model = model_cls(config)
    if config.batch_invariant:
        make_linears_batch_invariant(model)
    if config.float8 != "none":
        convert_linears_to_float8(model, config.float8)
    return model
