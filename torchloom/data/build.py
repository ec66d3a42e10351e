"""The data layer's entry point for the trainer: config in, tokenizer and loaders out."""

from __future__ import annotations

from typing import NamedTuple

from torchloom.data.cache import resolve_cache_dir
from torchloom.data.config import DataConfig
from torchloom.data.dataset import TokenDataset
from torchloom.data.loader import PretrainLoader, ValLoader
from torchloom.data.sources import resolve_sources
from torchloom.data.tokenizer import Tokenizer, load_tokenizer


class DataLoaders(NamedTuple):
    """What ``build_dataloaders`` returns; unpacks as ``tokenizer, train, val``."""

    tokenizer: Tokenizer
    train: PretrainLoader
    val: ValLoader | None
    """None when --data.val_fraction is 0."""


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The configured tokenizer (trained and cached on first use); its vocab_size sizes the model."""
    cfg.validate()
    return load_tokenizer(cfg.tokenizer, resolve_cache_dir(cfg.cache_dir), cfg.vocab_size)


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
    tokenizer = build_tokenizer(cfg)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    files = resolve_sources(cfg.sources, cfg.text_field, cache_dir)
    dataset = TokenDataset.build(files, tokenizer, cfg.val_fraction, cache_dir)
    train = PretrainLoader(
        dataset.train_tokens,
        eos_id=dataset.eos_id,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=cfg.shuffle,
        document_mask=cfg.document_mask,
    )
    val = None
    if cfg.val_fraction > 0:
        val = ValLoader(
            dataset.val_tokens,
            eos_id=dataset.eos_id,
            seq_len=seq_len,
            batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            document_mask=cfg.document_mask,
        )
    return DataLoaders(tokenizer, train, val)
