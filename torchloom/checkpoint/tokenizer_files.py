"""The tokenizer files that travel with a model folder (torchloom's or Hugging Face's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torchloom.config.errors import ConfigError
from torchloom.config.paths import require_folder

# Copied verbatim when present: the tokenizer in its HF forms, its chat template, and the
# generation defaults (eos ids and sampling settings) that belong to the same release.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
# The files among SIDE_FILES that are a tokenizer themselves (the others only go with one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def write_tokenizer(folder: Path, tokenizer: Any) -> tuple[int | None, int | None]:
    """Put the tokenizer into ``folder``; returns its (bos id, eos id) when known.

    ``tokenizer`` is a torchloom Tokenizer (written with its own ``save``), a folder whose
    SIDE_FILES are copied as they are, or None (nothing written).
    """
    if tokenizer is None:
        return None, None
    if not isinstance(tokenizer, str | Path):
        tokenizer.save(folder / "tokenizer.json")
        return tokenizer.bos_id, tokenizer.eos_id
    source = Path(tokenizer)
    require_folder(source, "tokenizer folder", "tokenizer.json")
    copied = [name for name in SIDE_FILES if (source / name).is_file()]
    if not copied:
        raise ConfigError(f"{source} holds no tokenizer files (such as tokenizer.json).")
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    if "tokenizer.json" not in copied:
        return None, None
    from torchloom.data.tokenizer import Tokenizer

    try:
        loaded = Tokenizer.from_file(source)
    except ConfigError:  # no recognizable special tokens: the ids are then just not recorded
        return None, None
    return loaded.bos_id, loaded.eos_id


def check_tokenizer_folder(folder: Path, option: str) -> None:
    """Refuse ``folder``, given with ``option`` as the tokenizer to copy, unless it is a folder
    holding a tokenizer proper (one of TOKENIZER_FILES), not only the files that go with one."""
    require_folder(folder, "tokenizer folder", "tokenizer.json")
    if any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        return
    others = [name for name in SIDE_FILES if (Path(folder) / name).is_file()]
    only = f", only {', '.join(others)}" if others else ""
    raise ConfigError(
        f"{option} {folder} holds no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or "
        f"{TOKENIZER_FILES[-1]}){only}; pass the folder the model's tokenizer is saved in."
    )


def check_tokenizer_fits(folder: Path | None, vocab_size: int, fix: str) -> None:
    """Refuse the tokenizer.json in ``folder`` (if it has one) when it is not valid JSON, or
    when its ids reach past the model's ``vocab_size`` embedding rows; ``fix`` says what to do
    instead."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return
    from torchloom.data.tokenizer import Tokenizer

    json_path = Path(folder) / "tokenizer.json"
    try:
        json.loads(json_path.read_bytes())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(
            f"{json_path} is not valid JSON ({err}), so no tokenizer library can load it; {fix}."
        ) from None
    try:
        tokens = Tokenizer.from_file(folder).vocab_size
    except ConfigError:  # not loadable as a training tokenizer: copied as it is, unchecked
        return
    if tokens > vocab_size:
        raise ConfigError(
            f"The tokenizer in {folder} has {tokens} tokens but the model's vocabulary holds "
            f"only {vocab_size}; {fix}."
        )
