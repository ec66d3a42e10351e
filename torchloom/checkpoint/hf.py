"""Hugging Face model folders (config.json + safetensors) in and out.

The family comes from config.json's ``model_type`` and its ModelSpec's HF adapter maps the
config and the tensor names; weights stream tensor by tensor (see safetensors_io).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from torchloom.checkpoint.model_io import MODEL_FORMAT
from torchloom.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    NamedTensors,
    SafetensorsFolder,
    TensorReader,
    WriteSummary,
    check_output_folder,
    checked_names,
    load_into,
    parse_dtype,
    staged_folder,
    weight_map,
    write_tensors,
)
from torchloom.checkpoint.tokenizer_files import write_tokenizer
from torchloom.config.devices import checked_device
from torchloom.config.errors import ConfigError, did_you_mean
from torchloom.config.paths import require_folder
from torchloom.models import (
    DecoderConfig,
    HFAdapter,
    ModelConfig,
    ModelSpec,
    build_model,
    get_hf_model_spec,
    get_model_spec,
)
from torchloom.models.config import apply_component_choices
from torchloom.models.hf_adapter import FusedExperts, RowSlice


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model folder."""
    hf_dir = Path(hf_dir)
    require_folder(hf_dir, "Hugging Face model folder", "config.json")
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{hf_dir} is not a Hugging Face model folder: it has no config.json.")
    try:
        hf_config = json.loads(config_file.read_text(), parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{config_file} is not valid JSON ({err}).") from None
    except ValueError as err:  # NaN or Infinity: no architecture field takes one
        raise ConfigError(f"{config_file} holds {err}; give the field its number.") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{config_file} does not hold a JSON object.")
    _check_switches(hf_config, config_file)
    if hf_config.get("format") == MODEL_FORMAT:
        raise ConfigError(
            f"{hf_dir} is a torchloom model folder, not a Hugging Face one: generate reads it "
            f"with --checkpoint {hf_dir}, and `torchloom convert --from {hf_dir} --to-hf OUT` "
            "makes a Hugging Face folder of it."
        )
    if "model_type" not in hf_config:
        raise ConfigError(
            f"{config_file} has no model_type, which names the architecture; add the one its "
            'weights are (e.g. "model_type": "llama").'
        )
    return hf_config


_SWITCHES = frozenset({
    "tie_word_embeddings", "attention_bias", "mlp_bias", "use_qk_norm", "norm_topk_prob",
    "use_sliding_window", "use_cache", "qk_layernorm",
})  # fmt: skip
"""config.json keys transformers reads as booleans: a string there ("false") is truthy, so
reading it as Python would tie a head or add a bias the checkpoint does not have."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} (not a number JSON allows)")


def _check_switches(hf_config: dict[str, Any], config_file: Path) -> None:
    """ConfigError for a boolean key (``_SWITCHES``), at the top or in a nested config, whose
    value is not a JSON true/false (or null, the default)."""
    for key, value in hf_config.items():
        if isinstance(value, dict):
            _check_switches(value, config_file)
        elif key in _SWITCHES and value is not None and not isinstance(value, bool):
            raise ConfigError(
                f"{config_file}: {key} must be true or false (JSON booleans), got "
                f"{json.dumps(value)}."
            )


def hf_architecture(hf_dir: Path) -> tuple[ModelSpec, DecoderConfig]:
    """The family (from ``model_type``) and architecture of a Hugging Face model folder."""
    hf_config = read_hf_config(hf_dir)
    try:
        spec = get_hf_model_spec(hf_config.get("model_type"))
        config = spec.hf_adapter.config_from_hf(hf_config)
        config = spec.hf_adapter.config_for_tensors(config, lambda: weight_map(hf_dir))
    except ConfigError as err:
        raise ConfigError(f"{Path(hf_dir) / 'config.json'}: {err}") from None
    _check_vocab_rows(Path(hf_dir), spec, config)
    return spec, config


def _check_vocab_rows(hf_dir: Path, spec: ModelSpec, config: DecoderConfig) -> None:
    """ConfigError when config.json's vocab_size is not the embedding's row count: checked from
    the file headers before anything else compares vocabularies, so a wrong config.json is
    named as such (not as a tokenizer that does not fit the model). A folder without weights,
    or without the embedding under its usual name, is left to the load's own checks."""
    try:
        folder = SafetensorsFolder(hf_dir)
    except ConfigError:
        return
    adapter = spec.hf_adapter
    name = adapter.held_name(adapter.to_hf_name("embed_tokens.weight"), set(folder.names()))
    if name not in folder.files:
        return
    rows = folder.shape(name)[0]
    if rows != config.vocab_size:
        raise ConfigError(
            f"{hf_dir / 'config.json'} gives vocab_size {config.vocab_size}, but the embedding "
            f"'{name}' in its weights has {rows} rows; config.json does not describe these "
            f"weights: set its vocab_size to {rows}."
        )


# What a weight may be stored as: casting between these keeps its values (up to rounding).
# Anything else (integers, FP8 without its scales) would load as different numbers.
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class HFTensors(TensorReader, Protocol):
    """Hugging Face-named tensors and the dtype each is stored in."""

    def dtype(self, name: str) -> torch.dtype: ...


class HFReader:
    """A Hugging Face folder's tensors under torchloom's parameter names, through the family's
    adapter: each parameter from one HF tensor, from several stacked (per-expert weights) or
    from some rows of one (a part of a fused tensor); any box of it read without the rest (a
    rank's shard). Tensors of the folder that no
    parameter uses are refused, except those the adapter says carry nothing to load and a tied
    checkpoint's copy of the head; so is a tensor a parameter uses that is not stored in one of
    LOADABLE_DTYPES (this is where every HF load, convert and initial load reads). A decoder
    layer's tensor left over or missing because config.json's num_hidden_layers is not the
    weights' layer count is named as that count, before any tensor is read. ``tensors`` reads
    the HF-named tensors from elsewhere than the folder's safetensors (a model in memory);
    ``hf_dir`` then only names the source."""

    def __init__(
        self,
        hf_dir: Path,
        adapter: HFAdapter,
        names: list[str],
        config: DecoderConfig,
        tensors: HFTensors | None = None,
    ) -> None:
        self.folder: HFTensors = tensors if tensors is not None else SafetensorsFolder(hf_dir)
        available = set(self.folder.names())
        tied = config.tie_embeddings
        self.sources: dict[str, str | list[str] | RowSlice | FusedExperts] = {}
        for name in names:
            source = adapter.hf_names(name, config)
            if isinstance(source, str):
                source = adapter.held_name(source, available)
            elif isinstance(source, RowSlice | FusedExperts):
                source = source._replace(name=adapter.held_name(source.name, available))
            else:
                source = [adapter.held_name(part, available) for part in source]
            if source == "lm_head.weight" and source not in available:
                if not tied:
                    raise ConfigError(
                        f"{Path(hf_dir) / 'config.json'} does not set tie_word_embeddings true, "
                        f"but the weights in {hf_dir} have no lm_head.weight (the output head); "
                        "set tie_word_embeddings to true if the head is the embedding, or add "
                        "lm_head.weight to the weights."
                    )
                source = adapter.to_hf_name("embed_tokens.weight")  # untying a tied checkpoint
            self.sources[name] = source
        absent = [n for n, source in self.sources.items() if set(_as_list(source)) - available]
        if any(_OUR_LAYER_INDEX.match(name) for name in absent):  # config.json's count may be off
            _check_layer_count(Path(hf_dir), config, _held_layers(adapter, available, self.sources))
        used = {n for source in self.sources.values() for n in _as_list(source)}
        for hf_name in sorted(available - used):
            try:
                ours = adapter.from_hf_name(hf_name)
            except ConfigError as err:
                raise ConfigError(f"{hf_dir}: {err}") from None
            if ours is None:
                continue  # a buffer old checkpoints saved
            if tied and ours == "output.weight":
                continue  # a tied checkpoint's head, as transformers ignores it
            if _OUR_LAYER_INDEX.match(ours):
                held = _held_layers(adapter, available, self.sources)
                _check_layer_count(Path(hf_dir), config, held)
            raise ConfigError(
                f"{hf_dir} has a tensor '{hf_name}' the model does not have."
                f"{did_you_mean(hf_name, sorted(used))}"
            )
        self._available = available
        integers = {n for n in used & available if adapter.loads_integer(n)}
        self._check_dtypes(Path(hf_dir), used & available - integers)

    def _check_dtypes(self, hf_dir: Path, hf_names: set[str]) -> None:
        """ConfigError for the first of ``hf_names`` not stored in one of LOADABLE_DTYPES, before
        any tensor is read; from the file headers only."""
        folder = self.folder

        def file(hf_name: str) -> Path:
            return folder.path(hf_name) if isinstance(folder, SafetensorsFolder) else hf_dir

        for hf_name in sorted(hf_names, key=lambda n: (file(n), n)):  # one file open at a time
            dtype = folder.dtype(hf_name)
            if dtype in LOADABLE_DTYPES:
                continue
            stored = str(dtype).removeprefix("torch.")
            fix = (
                "an FP8 weight means nothing without its block scales: dequantize the "
                "checkpoint to bfloat16 first"
                if dtype.is_floating_point
                else "store that tensor as float32 or bfloat16 and load again"
            )
            raise ConfigError(
                f"{file(hf_name)}: tensor '{hf_name}' is stored as {stored}, not a floating-point "
                f"type torchloom loads weights from (float32, bfloat16, float16, float64); casting it "
                f"would change its values. Fix: {fix}."
            )

    def names(self) -> list[str]:
        return [n for n, s in self.sources.items() if set(_as_list(s)) <= self._available]

    def shape(self, name: str) -> list[int]:
        source = self.sources[name]
        if isinstance(source, str):
            return self.folder.shape(source)
        if isinstance(source, RowSlice):
            shape = list(self.folder.shape(source.name))
            shape[source.dim] = source.stop - source.start
            return shape
        if isinstance(source, FusedExperts):
            experts, first, second = self.folder.shape(source.name)
            cols = first if self._stored_transposed(source) else second
            return [experts, source.stop - source.start, cols]
        return [len(source), *self.folder.shape(source[0])]

    def _stored_transposed(self, source: FusedExperts) -> bool:
        """Whether a fused experts tensor is stored [experts, cols, rows] (FusedExperts)."""
        return self.folder.shape(source.name)[1] != source.rows

    def read(self, name: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        source = self.sources[name]
        if isinstance(source, str):
            return self.folder.read(source, box)
        if isinstance(source, RowSlice):
            full = list(box or ()) + [slice(None)] * (source.dim + 1 - len(box or ()))
            rows = range(source.start, source.stop)[full[source.dim]]
            full[source.dim] = slice(rows.start, rows.stop)
            return self.folder.read(source.name, tuple(full))
        if isinstance(source, FusedExperts):
            experts, rows_box, cols_box = box or (slice(None),) * 3
            rows = range(source.start, source.stop)[rows_box]
            rows_box = slice(rows.start, rows.stop)
            if not self._stored_transposed(source):
                return self.folder.read(source.name, (experts, rows_box, cols_box))
            return self.folder.read(source.name, (experts, cols_box, rows_box)).transpose(1, 2)
        rows = range(len(source))[box[0]] if box else range(len(source))
        inner = box[1:] if box else None
        return torch.stack([self.folder.read(source[i], inner) for i in rows])


def check_tied_head(
    hf_dir: Path, folder: HFTensors, adapter: HFAdapter, config: DecoderConfig
) -> None:
    """ConfigError when config.json ties the head to the embedding but the folder's tensors
    (``folder``, e.g. an HFReader's) also hold an lm_head.weight with other values: loading
    ignores it (as transformers does), so a conversion would silently drop a trained head.
    Compared a block of rows at a time."""
    if not config.tie_embeddings:
        return
    available = set(folder.names())
    head = adapter.held_name(adapter.to_hf_name("output.weight"), available)
    embedding = adapter.held_name(adapter.to_hf_name("embed_tokens.weight"), available)
    if head not in available or embedding not in available:
        return  # nothing to drop; a missing embedding is named by the load
    shape = folder.shape(embedding)
    same = folder.shape(head) == shape
    step = max(1, _COMPARE_BYTES // max(1, math.prod(shape[1:]) * 8))
    for start in range(0, shape[0] if same else 0, step):
        rows = (slice(start, min(start + step, shape[0])),)
        a, b = folder.read(head, rows), folder.read(embedding, rows)
        if not torch.equal(a.double(), b.double()):
            same = False
            break
    if not same:
        raise ConfigError(
            f"{hf_dir / 'config.json'} sets tie_word_embeddings true, but {hf_dir} holds an "
            f"{head} that differs from the embedding '{embedding}': tying would drop that "
            f"head. Set tie_word_embeddings to false to keep it (or delete {head} to use the "
            "embedding as the head)."
        )


# How much of a tied checkpoint's head and embedding is compared at once (rows of each, as
# float64).
_COMPARE_BYTES = 64 * 2**20
_OUR_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _held_layers(
    adapter: HFAdapter,
    available: set[str],
    sources: dict[str, str | list[str] | RowSlice | FusedExperts],
) -> set[int]:
    """The indices of the decoder layers the folder holds tensors of (``available``, HF names),
    under the adapter's names. Tensors that parameters outside the decoder layers read
    (``sources``: parameter -> its HF tensors) are left out: an MTP depth is stored as a layer
    past the decoder's."""
    elsewhere = {n for name, s in sources.items() if not _OUR_LAYER_INDEX.match(name)
                 for n in _as_list(s)}  # fmt: skip
    held: set[int] = set()
    for hf_name in available - elsewhere:
        try:
            layer = _OUR_LAYER_INDEX.match(adapter.from_hf_name(hf_name) or "")
        except ConfigError:
            continue
        if layer:
            held.add(int(layer[1]))
    return held


def _check_layer_count(hf_dir: Path, config: DecoderConfig, held: set[int]) -> None:
    """ConfigError naming both counts when the decoder layers the weights hold (``held``, their
    indices) are more or fewer than config.json's num_hidden_layers: called when a layer's
    tensor is left over or missing, so that a wrong count is named as such, not as the tensors
    it leaves over or misses."""
    num_layers = getattr(config, "num_layers", None)
    if num_layers is None or not held or max(held) + 1 == num_layers:
        return
    count = max(held) + 1
    layers = f"layers 0-{count - 1}" if len(held) == count else f"layers up to {count - 1}"
    raise ConfigError(
        f"The weights in {hf_dir} hold {layers}, but {hf_dir / 'config.json'} gives "
        f"num_hidden_layers {num_layers}; config.json does not describe these weights: set its "
        f"num_hidden_layers to {count}."
    )


def _as_list(source: str | list[str] | RowSlice | FusedExperts) -> list[str]:
    if isinstance(source, RowSlice | FusedExperts):
        return [source.name]
    return [source] if isinstance(source, str) else source


@torch.no_grad()
def load_hf_weights(model: nn.Module, hf_dir: Path) -> None:
    """Copy a Hugging Face checkpoint's weights into ``model`` (built from its config.json,
    possibly with other component slots or transforms, possibly parallelized: each rank reads
    its shards only), casting to the model's dtype."""
    reader, display = _reader_for(model, hf_dir)
    load_into(model, reader, str(hf_dir), display)


def _reader_for(
    model: nn.Module, hf_dir: Path, architecture: tuple[ModelSpec, DecoderConfig] | None = None
) -> tuple[HFReader, Callable[[str], str]]:
    """The reader of ``hf_dir``'s tensors under ``model``'s names, and how to name them;
    ``architecture``: ``hf_architecture(hf_dir)`` when the caller has it already."""
    spec, hf_config = architecture or hf_architecture(hf_dir)
    if model.config.tie_embeddings and not hf_config.tie_embeddings:
        raise ConfigError(
            f"{hf_dir} has its own lm_head.weight; tying the head to the embedding would "
            "discard it. Drop the tie_embeddings transform."
        )
    names = list(model.state_dict().keys())
    return HFReader(hf_dir, spec.hf_adapter, names, hf_config), spec.hf_adapter.to_hf_name


def from_hf(
    hf_dir: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> nn.Module:
    """The torchloom model (eval mode) holding a Hugging Face checkpoint's weights.

    Built on ``meta`` and materialized with ``to_empty``, so no time or memory goes into a
    random initialization; fp32 unless ``dtype`` ('bf16', 'fp32' or a torch dtype) is given.
    """
    if not isinstance(hf_dir, str | Path):
        raise ConfigError(f"from_hf takes a folder path (str or Path); got {hf_dir!r}.")
    target_dtype = parse_dtype(dtype)
    device = checked_device(device, "device=")
    architecture = hf_architecture(Path(hf_dir))
    with torch.device("meta"):
        model = build_model(architecture[1])
    if target_dtype is not None:
        model.to(target_dtype)
    # Names and shapes from the file headers before allocating: a config.json whose sizes are
    # not the weights' is named as such, not found out by allocating its shapes (a 10**7-wide
    # MLP asked for 2.6 GB before the mismatch was seen).
    reader, display = _reader_for(model, Path(hf_dir), architecture)
    shapes = {name: t.shape for name, t in model.state_dict(keep_vars=True).items()}
    checked_names(reader, shapes, str(hf_dir), display)
    model.to_empty(device=device)
    load_into(model, reader, str(hf_dir), display)
    return model.eval()


def model_config_from_hf(hf_dir: Path, model_cfg: ModelConfig) -> DecoderConfig:
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
    config: DecoderConfig,
    named_tensors: NamedTensors,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> WriteSummary:
    """Write a folder that transformers' ``from_pretrained`` loads, from tensors under
    torchloom names (a model's ``state_dict().items()`` or a stream read from disk).

    ``tokenizer``: a Tokenizer, a folder whose tokenizer files are copied, or None. ``dtype``
    casts floating-point tensors; None keeps theirs. A tied model writes no lm_head.weight. A
    ``path`` that is a non-empty folder is replaced only with ``overwrite=True``.
    """
    adapter = _adapter(family)
    adapter.config_to_hf(config)  # refuse what transformers cannot hold before writing anything
    check_output_folder({}, Path(path), overwrite, how="pass overwrite=True")
    target_dtype = parse_dtype(dtype)
    hf_tensors = adapter.tensors_to_hf(named_tensors)
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
