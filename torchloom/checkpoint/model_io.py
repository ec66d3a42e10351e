"""Model-only export: weights as safetensors, the resolved architecture as JSON, the tokenizer.

Written to a temporary sibling folder and renamed into place, so a folder that exists is always
complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.config.fields import from_dict, to_dict
from torchloom.models import TransformerConfig, build_model

_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"
_TOKENIZER = "tokenizer.json"


def save_model(
    model: nn.Module, family: str, config: TransformerConfig, path: Path, tokenizer: Any = None
) -> None:
    """Write ``model`` (weights, architecture, optional tokenizer) to the folder ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    safetensors.torch.save_model(model, str(tmp / _WEIGHTS))
    meta = {"format": "torchloom-model", "version": 1, "family": family, "config": to_dict(config)}
    (tmp / _CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp / _TOKENIZER)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def load_model(
    path: Path, device: str | torch.device = "cpu"
) -> tuple[nn.Module, str, TransformerConfig]:
    """Load a folder written by ``save_model``: (model in eval mode, family, architecture)."""
    path = Path(path)
    config_file = path / _CONFIG
    if not config_file.is_file() or not (path / _WEIGHTS).is_file():
        raise ConfigError(
            f"{path} is not a torchloom model folder (expected {_CONFIG} and {_WEIGHTS}); it is "
            "written at the end of training to <output_dir>/model."
        )
    meta = json.loads(config_file.read_text())
    if meta.get("format") != "torchloom-model":
        raise ConfigError(f"{config_file} was not written by torchloom's save_model.")
    config = from_dict(TransformerConfig, meta["config"])
    with torch.device("meta"):
        model = build_model(config, meta["family"])
    model.to_empty(device=device)
    missing, unexpected = safetensors.torch.load_model(
        model, str(path / _WEIGHTS), device=str(device)
    )
    if missing or unexpected:
        raise ConfigError(
            f"{path / _WEIGHTS} does not match its config.json: missing {missing}, "
            f"unexpected {unexpected}."
        )
    return model.eval(), meta["family"], config
