"""Streaming safetensors folders: sharded writing, flushed shard by shard, and reading tensor by
tensor, so converting or saving a model holds about one shard in host memory, never the model.

The layout is Hugging Face's, used for torchloom's model folder and HF import/export alike: one
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` mapping every tensor name to its file.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import safetensors
import safetensors.torch
import torch

from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.paths import check_can_create
from torchloom.models.components.param_init import local_box, local_tensor

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
NamedTensors = Iterable[tuple[str, torch.Tensor]]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# safetensors' dtype codes -> torch dtype names (those this torch lacks are left out).
_STORED_DTYPES = {
    code: getattr(torch, name)
    for code, name in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "I64": "int64",
        "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
        "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64",
    }.items()
    if hasattr(torch, name)
}  # fmt: skip


# The torch dtypes a model's weights may be given (Python API): floating types that run.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "float64": torch.float64}  # fmt: skip


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None, a torch dtype of WEIGHT_DTYPES, or one of DTYPES' names ('bf16', 'fp32')."""
    if dtype is None:
        return dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in WEIGHT_DTYPES:
            allowed = ", ".join(str(d) for d in WEIGHT_DTYPES)
            raise ConfigError(
                f"dtype {dtype} cannot hold a model's weights; give one of {allowed}."
            )
        return dtype
    if not isinstance(dtype, str):
        raise ConfigError(
            f"dtype must be {' or '.join(repr(d) for d in DTYPES)} or a torch dtype; got {dtype!r}."
        )
    if dtype in DTYPES:
        return DTYPES[dtype]
    named = _DTYPE_NAMES.get(dtype.removeprefix("torch."), getattr(torch, dtype, None))
    if isinstance(named, torch.dtype) and named in WEIGHT_DTYPES:
        return named  # 'bfloat16', 'float16', 'half', 'fp16': the names torch and HF use
    raise ConfigError(
        f"Unknown dtype '{dtype}'.{did_you_mean(dtype, [*DTYPES, *_DTYPE_NAMES])} Choose "
        f"{' or '.join(DTYPES)}, or a weight dtype torch names ({', '.join(_DTYPE_NAMES)})."
    )


@dataclass
class WriteSummary:
    """What a ShardWriter wrote."""

    num_tensors: int = 0
    total_bytes: int = 0
    files: list[str] = field(default_factory=list)
    float_dtypes: set[torch.dtype] = field(default_factory=set)


class ShardWriter:
    """Collects tensors into a shard and writes it as soon as the next tensor would not fit.

    Tensors are moved to the CPU (and floating-point ones cast to ``dtype``) one at a time, so a
    model on a GPU or a checkpoint being converted costs about one shard of host memory.
    """

    def __init__(
        self,
        folder: Path,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        dtype: torch.dtype | None = None,
    ) -> None:
        if max_shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self.dtype: torch.dtype | None = dtype
        self.summary = WriteSummary()
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._weight_map: dict[str, int] = {}  # name -> shard number

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._weight_map or name in self._shard:
            raise ValueError(f"tensor '{name}' written twice")
        tensor = tensor.detach()
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
        tensor = tensor.to("cpu", dtype=dtype).contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # a view into a larger buffer would save the whole buffer
        nbytes = tensor.nbytes
        if self._shard and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._shard[name] = tensor
        self._shard_bytes += nbytes
        self.summary.num_tensors += 1
        self.summary.total_bytes += nbytes
        if tensor.is_floating_point():
            self.summary.float_dtypes.add(tensor.dtype)

    def _flush(self) -> None:
        number = len(self.summary.files) + 1
        name = f"shard-{number:05d}.safetensors"  # renamed in close(), once the count is known
        safetensors.torch.save_file(self._shard, str(self.folder / name), metadata={"format": "pt"})
        self._weight_map |= dict.fromkeys(self._shard, number)
        self.summary.files.append(name)
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> WriteSummary:
        """Write the last shard, give the shards their final names and write the index."""
        if self._shard or not self.summary.files:
            self._flush()
        count = len(self.summary.files)
        if count == 1:
            final = [SINGLE_FILE]
        else:
            final = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        for temporary, name in zip(self.summary.files, final):
            (self.folder / temporary).rename(self.folder / name)
        self.summary.files = final
        if count > 1:
            index = {
                "metadata": {"total_size": self.summary.total_bytes},
                "weight_map": {n: final[i - 1] for n, i in self._weight_map.items()},
            }
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return self.summary


def write_tensors(
    folder: Path,
    named_tensors: NamedTensors,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> WriteSummary:
    """Stream ``named_tensors`` into sharded safetensors files (and an index) in ``folder``."""
    writer = ShardWriter(folder, max_shard_bytes, dtype)
    for name, tensor in named_tensors:
        writer.add(name, tensor)
    return writer.close()


def weight_map(folder: Path) -> dict[str, str]:
    """{tensor name: file name} of a safetensors folder; ConfigError if it has no weights."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{index} is not a valid safetensors index ({err}).") from None
        for file in sorted(set(mapping.values())):
            if not isinstance(file, str) or Path(file).name != file or file in (".", ".."):
                raise ConfigError(
                    f"{index} lists {file!r} as a shard; shards are files of the folder itself, "
                    "named without a path."
                )
            if not (folder / file).is_file():
                raise ConfigError(f"{folder / file}, listed in {index}, does not exist.")
        return mapping
    single = folder / SINGLE_FILE
    if single.is_file():
        with _open(single) as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise ConfigError(
        f"{folder} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are read)."
    )


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors folder, one at a time, one file open at a time."""
    folder = Path(folder)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map(folder).items():
        by_file.setdefault(file, []).append(name)
    for file in sorted(by_file):
        with _open(folder / file) as f:
            for name in by_file[file]:
                yield name, f.get_tensor(name)


def _open(path: Path):
    try:
        return safetensors.safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # the Rust side raises its own error types
        raise ConfigError(f"{path} is not a readable safetensors file ({err}).") from None


class SafetensorsFolder:
    """Random access to a safetensors folder: a tensor's shape, or any box of it, reading only
    the bytes of that box (how each rank loads just its shard)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.files = weight_map(self.folder)
        # One file open at a time: an open file stays mapped, and every page read from it would
        # count in this process's memory until it is closed.
        self._open_file: tuple[str, Any, set[str]] | None = None

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def path(self, name: str) -> Path:
        """The file that holds ``name``."""
        return self.folder / self.files[name]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` is stored in (read from the file's header, not its data)."""
        code = self._slice(name).get_dtype()
        if code not in _STORED_DTYPES:
            raise ConfigError(
                f"{self.path(name)}: tensor '{name}' has the safetensors dtype {code}, which this "
                "PyTorch cannot read; store it as float32 or bfloat16."
            )
        return _STORED_DTYPES[code]

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``name``'s values in ``box`` (one slice per dim; None: all of it), on the CPU."""
        view = self._slice(name)
        return view[:] if box is None or not box else view[box]

    def _slice(self, name: str):
        file = self.files[name]
        if self._open_file is None or self._open_file[0] != file:
            self._open_file = None  # closes the previous file
            handle = _open(self.folder / file)
            self._open_file = (file, handle, set(handle.keys()))
        _, handle, held = self._open_file
        if name not in held:  # the index maps it to a shard that does not hold it
            raise ConfigError(
                f"{self.folder / INDEX_FILE} maps tensor '{name}' to {file}, which does not hold "
                "it; fix the index's weight_map or the shard."
            )
        return handle.get_slice(name)


class TensorReader(Protocol):
    """What ``load_into`` reads from: tensors under torchloom's parameter names."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor: ...


def checked_names(
    reader: TensorReader,
    expected: dict[str, torch.Size],
    source: str,
    display: Callable[[str], str] = str,
) -> None:
    """ConfigError unless ``reader`` holds exactly the ``expected`` tensors, shapes included;
    ``display`` names a tensor as ``source`` spells it."""
    provided = set(reader.names())
    unexpected = sorted(provided - expected.keys())
    if unexpected:
        shown = [display(n) for n in expected]
        raise ConfigError(
            f"{source} has a tensor '{display(unexpected[0])}' the model does not have."
            f"{did_you_mean(display(unexpected[0]), shown)}"
        )
    missing = [display(name) for name in expected if name not in provided]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{source} is missing tensor(s) {', '.join(missing[:3])}{more}.")
    for name, shape in expected.items():
        if reader.shape(name) != list(shape):
            raise ConfigError(
                f"{source}: tensor '{display(name)}' has shape {reader.shape(name)}, but the "
                f"architecture in its config.json needs {list(shape)}."
            )


def stream(
    reader: TensorReader,
    expected: dict[str, torch.Size],
    source: str,
    display: Callable[[str], str] = str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``expected`` tensors, whole, one at a time (checked before the first is read)."""
    checked_names(reader, expected, source, display)
    for name in expected:
        yield name, reader.read(name)


@torch.no_grad()
def load_into(
    module: torch.nn.Module,
    reader: TensorReader,
    source: str,
    display: Callable[[str], str] = str,
) -> None:
    """Copy every parameter of ``module`` from ``reader`` (cast to its dtype and device), each
    rank reading only the box of its own shard when the parameter is a DTensor. Every parameter
    must be there, and nothing else; ``display`` names a tensor as ``source`` spells it."""
    targets = module.state_dict(keep_vars=True)
    checked_names(reader, {name: t.shape for name, t in targets.items()}, source, display)
    for name, target in targets.items():
        local_tensor(target).copy_(reader.read(name, local_box(target)))


# What writing a model folder (torchloom's or Hugging Face's) puts into its staging folder: the
# weights under their final or temporary shard names, config.json and the tokenizer files.
_STAGED_FILE = re.compile(
    r"model\.safetensors|model\.safetensors\.index\.json|config\.json"
    r"|shard-\d{5}\.safetensors|model-\d{5}-of-\d{5}\.safetensors"
)


def staging_folder(path: Path) -> Path:
    """``<path>.partial``, where ``staged_folder(path)`` writes before renaming."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def _replaced_folder(path: Path) -> Path:
    """``<path>.old``, where ``staged_folder(path)`` moves an earlier ``path`` until the new one
    is in place."""
    return path.with_name(path.name + ".old")


def check_staging(path: Path) -> list[Path]:
    """ConfigError when ``staged_folder(path)`` would have to delete something it did not write
    or could not replace: ``<path>.partial`` (where the new folder is written) and, when ``path``
    exists, ``<path>.old`` (where the folder it replaces is moved) must each be absent or a
    folder holding only what a model folder's write puts there. Returns those of them that are
    an earlier, interrupted write's leftovers, to be removed. Reads only the folder listings."""
    path = Path(path)
    tmp, old = staging_folder(path), _replaced_folder(path)
    staging = {tmp: "an interrupted write's staging folder"}
    if path.exists():
        staging[old] = "the folder an interrupted write replaced"
    leftovers = []
    for folder, what in staging.items():
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise ConfigError(
                f"{folder} exists and is not a folder, but the output {path} is staged there "
                "while it is written; move it away or choose another output folder."
            )
        if folder.is_dir():
            _check_only_model_files(folder, what)
            leftovers.append(folder)
    return leftovers


def _check_only_model_files(folder: Path, what: str) -> None:
    """ConfigError when ``folder`` holds a subfolder or a file that writing a model folder never
    puts there: then it is not ``what`` but someone's own folder, which must not be deleted."""
    from torchloom.checkpoint.tokenizer_files import SIDE_FILES

    for entry in sorted(folder.iterdir()):
        if entry.is_dir() or not (entry.name in SIDE_FILES or _STAGED_FILE.fullmatch(entry.name)):
            raise ConfigError(
                f"{folder} holds {entry.name}, which writing a model folder never puts there, so "
                f"it is not {what} (those are deleted); move it away or choose another output "
                "folder."
            )


def check_output_folder(
    inputs: dict[str, Path | None], output: Path, overwrite: bool, how: str = "pass --overwrite"
) -> None:
    """Never write over, into or around an input folder (``inputs``: what it is -> folder), nor
    over a non-empty folder unless asked to (``how`` says how: a flag, or an argument from
    Python); refuse an output folder that cannot be created, or
    whose staging paths (``<output>.partial``, ``<output>.old``) hold what no earlier write left
    there. All before anything is written."""
    for what, folder in inputs.items():
        if folder is not None:
            _check_apart(Path(folder), output, what)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"The output {output} exists and is not a folder; choose another path.")
    check_can_create(output)
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise ConfigError(
            f"The output folder {output} is not empty; choose another or {how} to replace it."
        )
    check_staging(output)


def _check_apart(source: Path, output: Path, what: str) -> None:
    """Refuse an output folder that is, holds or sits inside ``source`` (symlinks resolved), or
    whose staging folders (``<output>.partial``, ``<output>.old``, deleted by the write) hold it:
    writing would delete the input, or change it while it is read."""
    src, out = source.resolve(), output.resolve()
    staging = [out.with_name(out.name + suffix) for suffix in (".partial", ".old")]
    if src == out:
        message = f"The output folder {output} is the {what}; choose another output folder."
    elif src.is_relative_to(out):
        message = (
            f"The output folder {output} contains the {what} {source}, which writing the output "
            "would delete; choose an output folder that does not hold it."
        )
    elif out.is_relative_to(src):
        message = (
            f"The output folder {output} is inside the {what} {source}; choose an output folder "
            "outside it."
        )
    elif any(src.is_relative_to(folder) for folder in staging):
        message = (
            f"The {what} {source} is where the output {output} is staged ({out.name}.partial, "
            f"{out.name}.old), which writing it deletes; rename it or choose another output folder."
        )
    else:
        return
    raise ConfigError(message)


@contextmanager
def staged_folder(path: Path) -> Iterator[Path]:
    """A fresh ``<path>.partial`` folder to write into, renamed to ``path`` when the block
    succeeds (and removed when it fails), so ``path`` is never a half-written folder: an earlier
    folder there is moved to ``<path>.old`` and deleted only once the new one is in place. A
    ``<path>.partial`` or ``<path>.old`` an interrupted write left is removed first, with a
    printed line (``check_staging`` refuses any other)."""
    path = Path(path)
    tmp, old = staging_folder(path), _replaced_folder(path)
    for leftover in check_staging(path):
        shutil.rmtree(leftover)
        what = (
            "the staging folder of an earlier, interrupted write"
            if leftover == tmp
            else "the folder an earlier, interrupted write replaced"
        )
        print(f"removed {leftover}: {what}", flush=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
