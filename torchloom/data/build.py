"""The data layer's entry point for the trainer: config in, tokenizer and loaders out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from torchloom.config.errors import ConfigError
from torchloom.data.cache import resolve_cache_dir
from torchloom.data.chat import read_template_file
from torchloom.data.config import DataConfig
from torchloom.data.dataset import TokenDataset
from torchloom.data.loader import RowSource, TrainLoader, ValLoader, check_batch_layout
from torchloom.data.multimodal import (
    PackedMultimodal,
    load_multimodal_splits,
    resolve_audio_processing,
    resolve_image_processing,
    resolve_media_layout,
)
from torchloom.data.multimodal_format import MediaTokens
from torchloom.data.packing import TokenWindows
from torchloom.data.readers import check_source_file
from torchloom.data.sft import ChatDataset, PackedConversations
from torchloom.data.sources import resolve_chat_sources, resolve_sources
from torchloom.data.stream_mix import DocumentStream, PackedStream
from torchloom.data.streaming import StreamingLoader
from torchloom.data.tokenizer import Tokenizer, load_tokenizer


class DataLoaders(NamedTuple):
    """What ``build_dataloaders`` returns; unpacks as ``tokenizer, train, val``."""

    tokenizer: Tokenizer
    train: TrainLoader | StreamingLoader
    val: ValLoader | None
    """None when --data.val_fraction is 0."""


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The configured tokenizer (trained and cached on first use); its vocab_size sizes the model.

    With --data.chat_template the file's template replaces the tokenizer's own.
    """
    cfg.validate()
    tokenizer = load_tokenizer(cfg.tokenizer, resolve_cache_dir(cfg.cache_dir), cfg.vocab_size)
    if cfg.chat_template:
        path = Path(cfg.chat_template).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"--data.chat_template '{cfg.chat_template}' is not a file: give a .jinja file "
                "holding a chat template, or leave it empty to use the tokenizer's own."
            )
        source = read_template_file(path)
        if not source.strip():
            raise ConfigError(
                f"--data.chat_template '{cfg.chat_template}' is empty, so every conversation "
                "would render as nothing: put a chat template in it, or leave the option empty "
                "to use the tokenizer's own."
            )
        tokenizer.set_chat_template(source, f"from --data.chat_template {path}")
    return tokenizer


def build_dataloaders(
    cfg: DataConfig,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
) -> DataLoaders:
    """Tokenize (or load from cache) the configured sources and build this rank's loaders.

    Every rank may call this at once: caches are written atomically, so ranks that race just
    repeat the work and agree on the result.
    """
    # Before the tokenizer is loaded (or trained): a bad seq_len would fail deep in packing.
    check_batch_layout(global_batch_size, micro_batch_size, dp_size, dp_rank, seq_len)
    tokenizer = build_tokenizer(cfg)
    if cfg.streaming:
        train = streaming_loader(
            cfg, tokenizer, seq_len, global_batch_size, micro_batch_size, dp_rank, dp_size, seed
        )
        return DataLoaders(tokenizer, train, None)  # validate() refuses val_fraction > 0
    if cfg.format == "chat":
        train_rows, val_rows = _chat_rows(cfg, tokenizer, seq_len)
    elif cfg.format == "multimodal":
        train_rows, val_rows = _multimodal_rows(cfg, tokenizer, seq_len)
    else:
        train_rows, val_rows = _text_rows(cfg, tokenizer, seq_len)
    train = TrainLoader(
        train_rows,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=cfg.shuffle,
        tokenizer=tokenizer.fingerprint()[:16],
    )
    val = None
    if cfg.val_fraction > 0:
        val = ValLoader(val_rows, batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    return DataLoaders(tokenizer, train, val)


def _text_rows(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int) -> tuple[RowSource, RowSource]:
    """Pre-training: windows of the train and validation token streams."""
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    groups = [resolve_sources([source], cfg.text_field, cache_dir) for source in cfg.sources]
    files = [file for group in groups for file in group]
    entries = [(source, len(group)) for source, group in zip(cfg.sources, groups)]
    dataset = TokenDataset.build(files, tokenizer, cfg.val_fraction, cache_dir, entries)
    train = TokenWindows(dataset.train_tokens, dataset.eos_id, seq_len, cfg.document_mask)
    val = TokenWindows(dataset.val_tokens, dataset.eos_id, seq_len, cfg.document_mask)
    if train.num_rows == 0 and len(dataset.train_tokens) + len(dataset.val_tokens) > seq_len:
        raise ConfigError(
            f"The training split is too small for one sequence: {train.describe()}, while "
            f"--data.val_fraction {cfg.val_fraction} holds out {len(dataset.val_tokens)} tokens "
            "for validation. Lower --data.val_fraction, add data or lower seq_len."
        )
    return train, val


def streaming_loader(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
) -> StreamingLoader:
    """Pre-training text streamed from the sources (mixed by --data.mix), no cache pass."""
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    groups = [resolve_sources([source], cfg.text_field, cache_dir) for source in cfg.sources]
    for files in groups:
        for file in files:
            check_source_file(file.path, file.text_field)
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_id
    if cfg.mix:
        streams = [DocumentStream(name, files, eos, vocab)
                   for name, files in zip(cfg.sources, groups)]  # fmt: skip
    else:  # one after the other, as the cached path concatenates them
        all_files = [file for files in groups for file in files]
        entries = [(source, len(files)) for source, files in zip(cfg.sources, groups)]
        streams = [DocumentStream(", ".join(cfg.sources), all_files, eos, vocab, entries)]
    identity = {
        "seed": seed,
        "sources": json.dumps(cfg.sources),
        "mix": json.dumps(cfg.mix),
        "text_field": cfg.text_field,
        "tokenizer": tokenizer.fingerprint()[:16],
        # A saved position is a file's index within its source: a folder that gained or lost
        # a file would resume in another file at the saved offset.
        "files": json.dumps([[str(f.path) for f in files] for files in groups]),
    }
    return StreamingLoader(
        PackedStream(streams, cfg.mix or None, tokenizer, seed, row_tokens=seq_len + 1),
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        document_mask=cfg.document_mask,
        prefetch_steps=cfg.prefetch_steps,
        identity=identity,
    )


def _chat_rows(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int) -> tuple[RowSource, RowSource]:
    """SFT: the train and validation conversations, each packed whole into rows."""
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    files = resolve_chat_sources(cfg.sources, cache_dir)
    dataset = ChatDataset.build(files, tokenizer, cfg.val_fraction, cache_dir)
    pad_id = tokenizer.eos_id if tokenizer.pad_id is None else tokenizer.pad_id
    overlong = cfg.overlong_conversations
    train = PackedConversations(dataset.train, seq_len, pad_id, overlong, split="training")
    val = PackedConversations(dataset.val, seq_len, pad_id, overlong, split="validation")
    return train, val


def _multimodal_rows(
    cfg: DataConfig, tokenizer: Tokenizer, seq_len: int
) -> tuple[RowSource, RowSource]:
    """Multimodal SFT: the train and validation samples packed whole with their media."""
    files = resolve_chat_sources(cfg.sources, resolve_cache_dir(cfg.cache_dir), multimodal=True)
    layout = resolve_media_layout(cfg)
    media = MediaTokens.from_tokenizer(tokenizer, layout)
    processing = resolve_image_processing(cfg, tokenizer, layout)
    audio = resolve_audio_processing(cfg, layout)
    splits = load_multimodal_splits(files, tokenizer, media, processing, cfg.val_fraction, audio)
    pad_id = tokenizer.eos_id if tokenizer.pad_id is None else tokenizer.pad_id
    train, val = (
        PackedMultimodal(samples, seq_len, pad_id, media, processing, cfg.max_images_per_row,
                         cfg.max_image_patches, split, audio, cfg.max_audios_per_row)
        for samples, split in zip(splits, ("training", "validation"))
    )  # fmt: skip
    return train, val
