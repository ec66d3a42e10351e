"""torchloom's model folder: the resolved architecture as config.json (``format:
torchloom-model``), the weights as sharded safetensors under torchloom's parameter names, and
the tokenizer.

Weights stream tensor by tensor both ways (about one shard in host memory). The folder is
written into a staged sibling and renamed into place, so a folder that exists is always
complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    NamedTensors,
    SafetensorsFolder,
    WriteSummary,
    load_into,
    staged_folder,
    write_tensors,
)
from torchloom.checkpoint.tokenizer_files import write_tokenizer
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.models import DecoderConfig, build_model
from torchloom.models.registry import config_from_dict

_CONFIG = "config.json"
MODEL_FORMAT = "torchloom-model"
"""The ``format`` of a torchloom model folder's config.json."""


def save_model(
    model: nn.Module,
    family: str,
    config: DecoderConfig,
    path: Path,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write ``model`` (weights, architecture, optional tokenizer) to the folder ``path``."""
    write_model_folder(path, family, config, model.state_dict().items(), tokenizer, max_shard_bytes)


def write_model_folder(
    path: Path,
    family: str,
    config: DecoderConfig,
    named_tensors: NamedTensors,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> WriteSummary:
    """A model folder from tensors under torchloom names, streamed into shards.

    ``tokenizer``: a Tokenizer (saved with ``Tokenizer.save``), a folder whose tokenizer files
    are copied, or None.
    """
    with staged_folder(path) as tmp:
        summary = write_tensors(tmp, named_tensors, max_shard_bytes, dtype)
        meta = {"format": MODEL_FORMAT, "version": 1, "family": family, "config": to_dict(config)}
        (tmp / _CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        write_tokenizer(tmp, tokenizer)
    return summary


def read_model_folder(path: Path) -> tuple[str, DecoderConfig]:
    """(family, architecture) of a folder written by ``save_model``."""
    path = Path(path)
    config_file = path / _CONFIG
    if not config_file.is_file():
        raise ConfigError(
            f"{path} is not a torchloom model folder (no {_CONFIG}); one is written at the end "
            "of training to <output_dir>/model."
        )
    try:
        meta = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config_file} is not valid JSON ({err}).") from None
    if not isinstance(meta, dict) or meta.get("format") != MODEL_FORMAT:
        raise ConfigError(
            f"{config_file} was not written by torchloom's save_model (a Hugging Face folder? "
            "use torchloom.from_hf or `torchloom convert --from-hf`)."
        )
    return meta["family"], config_from_dict(meta["family"], meta["config"])


def parameter_shapes(family: str, config: DecoderConfig) -> dict[str, torch.Size]:
    """{name: shape} of every parameter of the model, from a build on ``meta`` (no memory)."""
    with torch.device("meta"):
        model = build_model(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def load_model(
    path: Path, device: str | torch.device = "cpu"
) -> tuple[nn.Module, str, DecoderConfig]:
    """Load a folder written by ``save_model``: (model in eval mode, family, architecture)."""
    family, config = read_model_folder(path)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    load_into(model, SafetensorsFolder(path), str(path))
    return model.eval(), family, config
