"""The tokenizer files that travel with a model folder (torchloom's or Hugging Face's)."""

from __future__ import annotations

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


def check_tokenizer_fits(folder: Path | None, vocab_size: int, fix: str) -> None:
    """Refuse the tokenizer in ``folder`` (if it has a tokenizer.json) when its ids reach past
    the model's ``vocab_size`` embedding rows; ``fix`` says what to do instead."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return
    from torchloom.data.tokenizer import Tokenizer

    try:
        tokens = Tokenizer.from_file(folder).vocab_size
    except ConfigError:  # not loadable as a training tokenizer: copied as it is, unchecked
        return
    if tokens > vocab_size:
        raise ConfigError(
            f"The tokenizer in {folder} has {tokens} tokens but the model's vocabulary holds "
            f"only {vocab_size}; {fix}."
        )
