"""`torchloom convert --from-gguf`: a GGUF file (llama.cpp's format) -> a Hugging Face folder or a
torchloom model folder, in float weights.

transformers (with the ``gguf`` package) does the reading: it maps the file's metadata to a
config, dequantizes every tensor (Q4_1, Q8_0, ... become floats), undoes llama.cpp's q/k row
order and rebuilds the tokenizer and its chat template. torchloom then checks the architecture
with the family's HF adapter, as for any Hugging Face folder, and writes the folder through the
usual staged writers, so the output is either complete or absent. The dequantized model is held
in host memory once, in the output dtype.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from torchloom.checkpoint.hf import HFReader, save_hf
from torchloom.checkpoint.model_io import parameter_shapes, write_model_folder
from torchloom.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    WriteSummary,
    check_output_folder,
    parse_dtype,
    stream,
)
from torchloom.config.errors import ConfigError
from torchloom.models import DecoderConfig, ModelSpec, get_hf_model_spec

INSTALL_HINT = "pip install 'torchloom[gguf]'"
_MAGIC = b"GGUF"
# The float type of a file whose matrices are all stored as floats; anything quantized -> fp32.
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Keys transformers' GGUF reader adds to the config that describe the file, not the network.
_FILE_KEYS = ("quantization_config", "_model_name_or_path", "unk_token_id")


def convert_from_gguf(
    gguf_file: Path,
    out_dir: Path,
    to_hf: bool = True,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> WriteSummary:
    """A GGUF file -> a Hugging Face folder (``to_hf``) or a torchloom model folder, with the
    file's tokenizer and chat template. ``dtype``: the weights' dtype (default: the file's float
    type when its matrices are not quantized, else fp32)."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    _check_gguf_file(gguf_file)
    check_output_folder({"GGUF file": gguf_file}, out_dir, overwrite)
    target = parse_dtype(dtype)
    transformers = _import_readers()
    reader = _read_metadata(gguf_file)
    arch = _field(reader, "general.architecture")
    _refuse_dropped_rope_scaling(reader, arch, gguf_file)
    hf_config = _hf_config(transformers, gguf_file, arch)
    spec, config = _architecture(hf_config.to_dict(), gguf_file, arch)
    target = target or _file_float_type(reader)
    del reader  # its memory map of the whole file

    location = {"pretrained_model_name_or_path": str(gguf_file.parent), "gguf_file": str(gguf_file)}
    tokenizer = _tokenizer(transformers, location, gguf_file)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        **location, config=hf_config, dtype=target, **_dequantize_all(transformers)
    )
    shapes = parameter_shapes(spec.name, config)
    in_memory = _InMemory(model.state_dict())
    hf_reader = HFReader(gguf_file, spec.hf_adapter, list(shapes), config, tensors=in_memory)
    tensors = stream(hf_reader, shapes, str(gguf_file), spec.hf_adapter.to_hf_name)
    if to_hf:
        return save_hf(
            out_dir, spec.name, config, tensors, tokenizer, target, max_shard_bytes, overwrite
        )
    return write_model_folder(
        out_dir, spec.name, config, tensors, tokenizer, max_shard_bytes, target
    )


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"GGUF file {path} {what}; pass the path of a .gguf file.")
    with path.open("rb") as f:
        magic = f.read(len(_MAGIC))
    if magic != _MAGIC:
        raise ConfigError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf "
            "file such as llama.cpp writes, or a Hugging Face folder with --from-hf."
        )


def _import_readers() -> Any:
    """transformers, once it and the packages its GGUF reader needs are importable."""
    missing = []
    for name in ("gguf", "transformers", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ConfigError(
            f"Reading GGUF files needs {', '.join(missing)} (not installed): {INSTALL_HINT}"
        )
    import transformers

    return transformers


def _read_metadata(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as err:  # a truncated or damaged file
        raise ConfigError(f"{path} is not a readable GGUF file ({err}).") from None


def _field(reader: Any, key: str) -> str | None:
    """A string field of the file's metadata (None when absent)."""
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def _refuse_dropped_rope_scaling(reader: Any, arch: str | None, path: Path) -> None:
    """transformers' GGUF reader ignores RoPE scaling (the rope.scaling keys and Llama 3.1's
    rope_freqs tensor), which would give a model that silently differs from the file's."""
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    freqs = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    if freqs or scaling not in (None, "none"):
        what = "a rope_freqs tensor" if freqs else f"{arch}.rope.scaling.type={scaling}"
        raise ConfigError(
            f"{path} scales RoPE ({what}), which transformers' GGUF reader drops, so the "
            "converted model would differ; convert the model's Hugging Face release instead."
        )


def _hf_config(transformers: Any, path: Path, arch: str | None) -> Any:
    """transformers' config for the file (from its metadata alone)."""
    try:
        return transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=str(path))
    except (ValueError, KeyError, NotImplementedError) as err:
        raise ConfigError(
            f"{path} holds a '{arch}' model, which transformers cannot read from GGUF ({err})."
        ) from None


def _architecture(
    hf_config: dict[str, Any], path: Path, arch: str | None
) -> tuple[ModelSpec, DecoderConfig]:
    """The torchloom family and architecture of the file, before any weight is read."""
    for key in _FILE_KEYS:
        hf_config.pop(key, None)
    model_type = hf_config.get("model_type")
    try:
        spec = get_hf_model_spec(model_type)
    except ConfigError as err:
        raise ConfigError(
            f"{path} holds a '{arch}' model, which torchloom has no family for: {err}"
        ) from None
    try:
        config: DecoderConfig = spec.hf_adapter.config_from_hf(hf_config)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return spec, config


def _file_float_type(reader: Any) -> torch.dtype:
    """The float type the file stores its matrices in, or fp32 when they are quantized."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    if len(kinds) == 1 and kinds <= _FLOAT_TYPES.keys():
        return _FLOAT_TYPES[kinds.pop()]
    return torch.float32


def _dequantize_all(transformers: Any) -> dict[str, Any]:
    """from_pretrained's option to unpack every weight: transformers >= 5.x would otherwise keep
    some quantized in GGUF layers when a matmul kernel is installed."""
    config_class = getattr(transformers, "GgufConfig", None)
    return {} if config_class is None else {"quantization_config": config_class(dequantize=True)}


def _tokenizer(transformers: Any, location: dict[str, str], path: Path) -> Any:
    """The file's tokenizer, as a torchloom Tokenizer (written as tokenizer.json and a
    tokenizer_config.json that names the special tokens and holds the chat template)."""
    from torchloom.data.tokenizer import Tokenizer

    try:
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(**location)
    except (ValueError, KeyError, OSError) as err:  # no or an unknown tokenizer in the metadata
        raise ConfigError(f"{path}: transformers cannot build its tokenizer ({err}).") from None
    with tempfile.TemporaryDirectory() as folder:
        hf_tokenizer.save_pretrained(folder)
        try:
            return Tokenizer.from_file(folder)
        except ConfigError as err:
            raise ConfigError(f"{path}: its tokenizer does not load in torchloom: {err}") from None


class _InMemory:
    """A dict of tensors (a model's state dict) as a TensorReader."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        return self.tensors[name][box] if box else self.tensors[name]
