"""`torchloom convert`: Hugging Face folder <-> torchloom model folder, tensor by tensor.

No model is materialized: every parameter of a ``meta`` build of the architecture is read from
the source (through the family's HF adapter), checked, and streamed into shards. Peak host memory is about one
input file's touched pages plus one output shard.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from torchloom.checkpoint.hf import HFReader, check_tied_head, hf_architecture, save_hf
from torchloom.checkpoint.model_io import (
    MODEL_FORMAT,
    parameter_shapes,
    read_model_folder,
    write_model_folder,
)
from torchloom.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsFolder,
    TensorReader,
    WriteSummary,
    check_output_folder,
    parse_dtype,
    stream,
)
from torchloom.checkpoint.storage import (
    DCP_METADATA,
    MARKER,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorage,
)
from torchloom.checkpoint.tokenizer_files import (
    SIDE_FILES,
    check_tokenizer_fits,
    check_tokenizer_folder,
)
from torchloom.config.errors import ConfigError
from torchloom.config.paths import require_folder
from torchloom.models import DecoderConfig
from torchloom.models.registry import config_from_dict


@dataclass
class ModelSource:
    """A model to export or load: its family, architecture, and a reader of its tensors under
    torchloom names."""

    family: str
    config: DecoderConfig
    reader: TensorReader
    """Any tensor, or any box of one (a rank's shard), read on demand."""
    tokenizer_dir: Path | None
    """Where the model's tokenizer files are, if it has any."""
    name: str
    """How errors name the source (its path)."""

    @property
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, one at a time, checked against the architecture first."""
        return stream(self.reader, parameter_shapes(self.family, self.config), self.name)


def open_model_source(path: Path, option: str = "--from") -> ModelSource:
    """The one place that reads a model to export: a torchloom model folder, or one step of a
    training checkpoint (``<output_dir>/checkpoints/step-N``). ``option``: the command's flag
    that named ``path``, for the errors' hints."""
    path = Path(path)
    require_folder(path, "model folder", "config.json")
    if (path / MARKER).is_file():
        return _checkpoint_source(path, option)
    _check_not_another_folder(path, option)
    family, config = read_model_folder(path)
    tokenizer = path if _has_tokenizer(path) else None
    return ModelSource(family, config, SafetensorsFolder(path), tokenizer, str(path))


class _CheckpointReader:
    """The model part of a complete training checkpoint (DCP), one tensor at a time.
    ``damaged_hint`` says what to pass instead; it is worked out only when a read fails."""

    def __init__(self, step_dir: Path, damaged_hint: Callable[[], str]) -> None:
        self.step_dir, self.damaged_hint = step_dir, damaged_hint
        metadata = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        self.saved = {key.removeprefix("model."): value for key, value in metadata.items()
                      if key.startswith("model.")}  # fmt: skip

    def names(self) -> list[str]:
        return list(self.saved)

    def shape(self, name: str) -> list[int]:
        return list(self.saved[name].size)

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        meta = self.saved[name]
        tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:
            dcp.load({"model": {name: tensor}}, storage_reader=FileSystemReader(str(self.step_dir)))
        except (CheckpointException, RuntimeError, OSError) as err:  # a file altered in place
            raise CheckpointError(
                f"Reading {name} from the checkpoint {self.step_dir} failed ({_root_line(err)}): "
                f"its files are damaged; {self.damaged_hint()}."
            ) from None
        return tensor if not box else tensor[box]


def _root_line(err: BaseException) -> str:
    """The first sentence of the first rank's error inside DCP's CheckpointException."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    lines = str(err).strip().splitlines()
    return lines[0].split(". ")[0].rstrip(".") if lines else type(err).__name__


def _check_not_another_folder(path: Path, option: str) -> None:
    """Refuse, saying what it is and what to pass instead, a folder without a torchloom model's
    config.json that is a checkpoint step cut short, a training run's output folder, or a
    Hugging Face model folder."""
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and meta.get("format") == MODEL_FORMAT:
        return
    if meta is None and _looks_like_a_step(path):
        raise CheckpointError(
            f"{path} is an incomplete checkpoint (no {MARKER}: an interrupted save); "
            f"{_older_step_hint(path, option, _step_of(path))}."
        )
    if (path / "checkpoints").is_dir() or (path / "model" / "config.json").is_file():
        steps = CheckpointStorage.for_path(path / "checkpoints").complete_steps()
        step = path / "checkpoints" / (f"step-{steps[-1]}" if steps else "step-N")
        model = path / "model"
        final = f"its final model ({option} {model}) or " if model.is_dir() else ""
        raise ConfigError(
            f"{path} is a training run's output folder; pass {final}a checkpoint step "
            f"({option} {step})."
        )
    if isinstance(meta, dict) and "model_type" in meta:
        raise ConfigError(
            f"{path} is a Hugging Face model folder (model_type {meta['model_type']!r}); pass it "
            f"with --from-hf {path}."
        )


def _step_of(path: Path) -> int | None:
    """N of a folder named step-N."""
    name = path.name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def _looks_like_a_step(path: Path) -> bool:
    """A step folder by its name or by DCP's files."""
    return (
        _step_of(path) is not None or any(path.glob("*.distcp")) or (path / DCP_METADATA).exists()
    )


def _older_step_hint(step_dir: Path, option: str, step: int | None) -> str:
    """What to pass instead of a step folder that cannot be read: the newest undamaged step
    beside it (one ``verify`` passes), older than ``step`` if one is. Candidates are verified
    newest older first, then the newer ones, stopping at the first that passes, so a hint never
    points at another damaged step and most often costs one check."""
    storage = CheckpointStorage.for_path(step_dir.parent)
    others = [s for s in storage.complete_steps() if s != step and step_dir.name != f"step-{s}"]
    older = [s for s in others if step is not None and s < step]
    newer = [s for s in others if s not in older]
    for candidate in [*reversed(older), *reversed(newer)]:
        try:
            storage.verify(candidate)
        except CheckpointCorruptError:
            continue
        which = "an older" if candidate in older else "another"
        suggested = step_dir.parent / f"step-{candidate}"
        return f"use {which} step folder, e.g. {option} {suggested}"
    return (
        "no other step beside it is complete and undamaged, so use the run's model folder "
        "(<output_dir>/model)"
    )


def _checkpoint_source(step_dir: Path, option: str) -> ModelSource:
    """The model part of a complete training checkpoint, read one tensor at a time."""
    # The step comes from the marker, so a step folder copied under another name works too.
    storage, step = CheckpointStorage.for_step_folder(step_dir)
    hint = partial(_older_step_hint, step_dir, option, step)  # verifies steps: only on failure
    try:
        storage.verify(step)
    except CheckpointCorruptError as err:  # its hint names train's flags
        raise CheckpointError(f"Checkpoint file {err.path} {err.reason}; {hint()}.") from None
    extra = storage.read_marker(step)["extra"]
    if "family" not in extra or "model_config" not in extra:
        raise CheckpointError(
            f"{step_dir}/{MARKER} records no model (family, model_config); export the run's "
            "model folder (<output_dir>/model) instead."
        )
    family, config = extra["family"], config_from_dict(extra["family"], extra["model_config"])
    tokenizer = step_dir.parent.parent / "model"  # the run's final model folder, if written
    tokenizer_dir = tokenizer if _has_tokenizer(tokenizer) else None
    return ModelSource(
        family, config, _CheckpointReader(step_dir, hint), tokenizer_dir, str(step_dir)
    )


def convert_from_hf(
    hf_dir: Path,
    out_dir: Path,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> WriteSummary:
    """A Hugging Face folder -> a torchloom model folder (tokenizer files copied along)."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_output_folder({"source folder": hf_dir}, out_dir, overwrite)
    spec, config = hf_architecture(hf_dir)
    tokenizer = hf_dir if _has_tokenizer(hf_dir) else None
    check_tokenizer_fits(
        tokenizer, config.vocab_size, "replace the folder's tokenizer files with the model's own"
    )
    shapes = parameter_shapes(spec.name, config)
    reader = HFReader(hf_dir, spec.hf_adapter, list(shapes), config)
    check_tied_head(hf_dir, reader.folder, spec.hf_adapter, config)  # would drop a distinct head
    tensors = stream(reader, shapes, str(hf_dir), spec.hf_adapter.to_hf_name)
    return write_model_folder(
        out_dir, spec.name, config, tensors, tokenizer, max_shard_bytes, parse_dtype(dtype)
    )


def convert_to_hf(
    model_dir: Path,
    hf_dir: Path,
    dtype: str | torch.dtype | None = None,
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> WriteSummary:
    """A torchloom model -> a Hugging Face folder. The tokenizer files come from
    ``tokenizer_dir`` (which must hold a tokenizer, not only its companion files), else from
    the model folder."""
    model_dir, hf_dir = Path(model_dir), Path(hf_dir)
    source = open_model_source(model_dir)  # reads no tensor yet
    tokenizer = tokenizer_dir if tokenizer_dir is not None else source.tokenizer_dir
    inputs = {"source folder": model_dir, "tokenizer folder": tokenizer}
    check_output_folder(inputs, hf_dir, overwrite)
    if tokenizer_dir is not None:
        check_tokenizer_folder(tokenizer_dir, "--tokenizer")
    check_tokenizer_fits(tokenizer, source.config.vocab_size, "pass the model's own --tokenizer")
    return save_hf(
        hf_dir,
        source.family,
        source.config,
        source.tensors,
        tokenizer,
        dtype,
        max_shard_bytes,
        overwrite,
    )


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in SIDE_FILES)
