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
    check_output_folder,
    load_into,
    staged_folder,
    write_tensors,
)
from torchloom.checkpoint.tokenizer_files import write_tokenizer
from torchloom.config.devices import checked_device
from torchloom.config.errors import ConfigError
from torchloom.config.fields import to_dict
from torchloom.models import DecoderConfig, build_model
from torchloom.models.registry import config_from_dict, get_model_spec

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
    overwrite: bool = False,
) -> None:
    """Write ``model`` (weights, architecture, optional tokenizer) to the folder ``path``.
    ConfigError, before anything is written, unless ``family`` is a registered family,
    ``config`` its architecture and ``model``'s parameters exactly what that builds: a folder
    that ``load_model`` could not read back is never written. A ``path`` that is a non-empty
    folder is replaced only with ``overwrite=True``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_model takes the model (an nn.Module) first; got {model!r}.")
    spec = get_model_spec(family)
    if not isinstance(config, spec.config_cls):
        raise ConfigError(
            f"save_model: config is a {type(config).__name__}, not the {family} family's "
            f"{spec.config_cls.__name__}; pass the family the config belongs to."
        )
    held = {name: tensor.shape for name, tensor in model.state_dict().items()}
    wanted = parameter_shapes(family, config)
    if held != wanted:
        extra, missing = sorted(held.keys() - wanted.keys()), sorted(wanted.keys() - held.keys())
        shaped = [n for n in sorted(held.keys() & wanted.keys()) if held[n] != wanted[n]]
        problem = (
            f"the model has '{extra[0]}', which the architecture does not" if extra
            else f"the model lacks '{missing[0]}'" if missing
            else f"'{shaped[0]}' is {list(held[shaped[0]])}, the architecture's "
            f"{list(wanted[shaped[0]])}"
        )  # fmt: skip
        raise ConfigError(
            f"save_model: the model does not match its config ({problem}); pass the config the "
            "model was built from."
        )
    check_output_folder({}, Path(path), overwrite, how="pass overwrite=True")
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
    missing = [key for key in ("family", "config") if key not in meta]
    if missing or not isinstance(meta["config"], dict):
        raise ConfigError(
            f"{config_file} is damaged: it lacks {' and '.join(missing) or 'a config object'}; "
            "write the folder again (save_model, or the training run's export)."
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
    device = checked_device(device, "device=")
    family, config = read_model_folder(path)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device=device)
    load_into(model, SafetensorsFolder(path), str(path))
    return model.eval(), family, config
