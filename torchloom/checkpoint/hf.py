"""Hugging Face model folders (config.json + safetensors) in and out.

The family comes from config.json's ``model_type`` and its ModelSpec's HF adapter maps the
config and the tensor names; weights stream tensor by tensor (see safetensors_io).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchloom.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    NamedTensors,
    WriteSummary,
    iter_tensors,
    load_into,
    parse_dtype,
    staged_folder,
    write_tensors,
)
from torchloom.checkpoint.tokenizer_files import write_tokenizer
from torchloom.config.errors import ConfigError
from torchloom.models import (
    HFAdapter,
    ModelConfig,
    ModelSpec,
    TransformerConfig,
    build_model,
    get_hf_model_spec,
    get_model_spec,
)
from torchloom.models.config import apply_component_choices


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model folder."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConfigError(f"Hugging Face model folder {hf_dir} does not exist.")
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{hf_dir} is not a Hugging Face model folder: it has no config.json.")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config_file} is not valid JSON ({err}).") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{config_file} does not hold a JSON object.")
    return hf_config


def hf_architecture(hf_dir: Path) -> tuple[ModelSpec, TransformerConfig]:
    """The family (from ``model_type``) and architecture of a Hugging Face model folder."""
    hf_config = read_hf_config(hf_dir)
    try:
        spec = get_hf_model_spec(hf_config.get("model_type"))
        return spec, spec.hf_adapter.config_from_hf(hf_config)
    except ConfigError as err:
        raise ConfigError(f"{Path(hf_dir) / 'config.json'}: {err}") from None


def iter_hf_tensors(
    hf_dir: Path, adapter: HFAdapter, config: TransformerConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors under torchloom names, one at a time. A tied checkpoint's
    ``lm_head.weight`` (some write it, some do not) is skipped: the head is the embedding."""
    for hf_name, tensor in iter_tensors(hf_dir):
        try:
            name = adapter.from_hf_name(hf_name)
        except ConfigError as err:
            raise ConfigError(f"{hf_dir}: {err}") from None
        if name is None or (config.tie_embeddings and name == "output.weight"):
            continue
        yield name, tensor


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_dir: Path) -> None:
    """Copy a Hugging Face checkpoint's weights into ``model`` (built from its config.json,
    possibly with other component slots or transforms), casting to the model's dtype."""
    spec, hf_config = hf_architecture(hf_dir)
    tensors = iter_hf_tensors(hf_dir, spec.hf_adapter, hf_config)
    if model.config.tie_embeddings != hf_config.tie_embeddings:
        if model.config.tie_embeddings:
            raise ConfigError(
                f"{hf_dir} has its own lm_head.weight; tying the head to the embedding would "
                "discard it. Drop the tie_embeddings transform."
            )
        tensors = _head_from_embedding(tensors)
    load_into(model, tensors, str(hf_dir), spec.hf_adapter.to_hf_name)


def _head_from_embedding(tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """Untying a tied checkpoint: the new output head starts as a copy of the embedding."""
    for name, tensor in tensors:
        yield name, tensor
        if name == "embed_tokens.weight":
            yield "output.weight", tensor


def from_hf(
    hf_dir: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> nn.Module:
    """The torchloom model (eval mode) holding a Hugging Face checkpoint's weights.

    Built on ``meta`` and materialized with ``to_empty``, so no time or memory goes into a
    random initialization; fp32 unless ``dtype`` ('bf16', 'fp32' or a torch dtype) is given.
    """
    spec, config = hf_architecture(Path(hf_dir))
    with torch.device("meta"):
        model = build_model(config, spec.name)
    target_dtype = parse_dtype(dtype)
    if target_dtype is not None:
        model.to(target_dtype)
    model.to_empty(device=device)
    load_hf_weights(model, Path(hf_dir))
    return model.eval()


def model_config_from_hf(hf_dir: Path, model_cfg: ModelConfig) -> TransformerConfig:
    """The training architecture for ``--checkpoint.initial_load_hf``: config.json's, plus the
    job's component slots and transforms (flavor does not apply; overrides are refused)."""
    spec, config = hf_architecture(hf_dir)
    if model_cfg.name != spec.name:
        raise ConfigError(
            f"{hf_dir} holds a {spec.name} model (model_type "
            f"'{spec.hf_adapter.model_type}'), but --model.name is {model_cfg.name}; pass "
            f"--model.name {spec.name}."
        )
    if model_cfg.overrides:
        raise ConfigError(
            f"--model.overrides {json.dumps(model_cfg.overrides)} cannot change a model loaded "
            f"with --checkpoint.initial_load_hf (its architecture is {hf_dir}/config.json); "
            "pass --model.overrides '{}'."
        )
    return apply_component_choices(config, model_cfg)


def save_hf(
    path: Path,
    family: str,
    config: TransformerConfig,
    named_tensors: NamedTensors,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> WriteSummary:
    """Write a folder that transformers' ``from_pretrained`` loads, from tensors under
    torchloom names (a model's ``state_dict().items()`` or a stream read from disk).

    ``tokenizer``: a Tokenizer, a folder whose tokenizer files are copied, or None. ``dtype``
    casts floating-point tensors; None keeps theirs. A tied model writes no lm_head.weight.
    """
    adapter = _adapter(family)
    adapter.config_to_hf(config)  # refuse what transformers cannot hold before writing anything
    target_dtype = parse_dtype(dtype)
    hf_tensors = ((adapter.to_hf_name(name), tensor) for name, tensor in named_tensors)
    with staged_folder(path) as tmp:
        summary = write_tensors(tmp, hf_tensors, max_shard_bytes, target_dtype)
        bos_id, eos_id = write_tokenizer(tmp, tokenizer)
        written = summary.float_dtypes
        dtype_name = str(next(iter(written))).removeprefix("torch.") if len(written) == 1 else None
        hf_config = adapter.config_to_hf(config, dtype_name, bos_id, eos_id)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return summary


def _adapter(family: str) -> HFAdapter:
    spec = get_model_spec(family)
    if spec.hf_adapter is None:
        raise ConfigError(f"Model family '{family}' has no Hugging Face adapter to export with.")
    return spec.hf_adapter
