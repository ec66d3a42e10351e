"""Supervised fine-tuning data: conversations tokenized once (cached on disk), split into train
and validation, and packed whole into rows of ``seq_len`` tokens."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from bisect import bisect_left, insort
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from torchloom.config.errors import ConfigError
from torchloom.data.cache import atomic_write
from torchloom.data.conversations import (
    check_template_marks_replies,
    iter_conversations,
    tokenize_conversations,
)
from torchloom.data.dataset import SPLIT_SEED, chunked, held_out_mask
from torchloom.data.packing import IGNORE_INDEX, Batch
from torchloom.data.sources import SourceFile
from torchloom.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump when rendering, masking or the split change, so old caches are not reused.
SFT_DATASET_VERSION = 1
TOKENIZE_CHUNK = 256
PROBE_CONVERSATIONS = 16
"""Conversations the chat template is tried on before the whole set is tokenized."""


@dataclass
class Conversations:
    """Tokenized conversations, flat: conversation i is ``tokens[offsets[i]:offsets[i + 1]]``."""

    tokens: np.ndarray
    """1-D token ids of every conversation's chat-template rendering, back to back."""
    is_assistant: np.ndarray
    """1-D bool, aligned with tokens: True for assistant tokens (the only ones trained on)."""
    offsets: np.ndarray
    """1-D int64 of length len(self) + 1."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per conversation."""
        return np.diff(self.offsets)

    @classmethod
    def from_list(cls, items: list[tuple[np.ndarray, np.ndarray]]) -> Conversations:
        """From ``(ids, is_assistant)`` per conversation."""
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(ids) for ids, _ in items])
        if not items:
            return cls(np.zeros(0, np.int64), np.zeros(0, bool), offsets)
        tokens = np.concatenate([ids for ids, _ in items]).astype(np.int64)
        is_assistant = np.concatenate([mask for _, mask in items])
        return cls(tokens, is_assistant, offsets)


@dataclass
class ChatDataset:
    """A chat data set's train and validation conversations."""

    train: Conversations
    val: Conversations
    """Empty when val_fraction is 0."""

    @classmethod
    def build(
        cls, files: list[SourceFile], tokenizer: Tokenizer, val_fraction: float, cache_dir: Path
    ) -> ChatDataset:
        """Load the tokenized conversations of ``files`` from the cache, tokenizing if needed."""
        # The first conversations try the chat template (missing, failing, or dropping the
        # replies) before the whole set is read, and even when it is cached.
        check_template_marks_replies(
            tokenizer, list(islice(iter_conversations(files), PROBE_CONVERSATIONS))
        )
        path = cache_dir / "tokens" / f"{_cache_key(files, tokenizer, val_fraction)[:20]}.chat.npz"
        if not path.exists():
            _tokenize_to_cache(files, tokenizer, val_fraction, path)
        with np.load(path) as arrays:
            split = {
                name: Conversations(
                    arrays[f"{name}_tokens"].astype(np.int64),
                    arrays[f"{name}_is_assistant"],
                    arrays[f"{name}_offsets"],
                )
                for name in ("train", "val")
            }
        return cls(split["train"], split["val"])


def _cache_key(files: list[SourceFile], tokenizer: Tokenizer, val_fraction: float) -> str:
    parts = {
        "version": SFT_DATASET_VERSION,
        "sources": [f.fingerprint() for f in files],
        "tokenizer": tokenizer.fingerprint(),
        "chat_template": tokenizer.chat_template,
        "template_tokens": tokenizer.template_tokens,
        "val_fraction": val_fraction,
        "split_seed": SPLIT_SEED,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()


def _tokenize_to_cache(
    files: list[SourceFile], tokenizer: Tokenizer, val_fraction: float, path: Path
) -> None:
    start = time.perf_counter()
    # The first pass checks every line, so a bad line fails before any tokenizing.
    num_conversations = sum(1 for _ in iter_conversations(files))
    if num_conversations == 0:
        raise ConfigError(f"The chat sources {[str(f.path) for f in files]} hold no conversation.")
    is_val = held_out_mask(num_conversations, val_fraction)
    splits: dict[bool, list[tuple[np.ndarray, np.ndarray]]] = {False: [], True: []}
    index = 0
    for chunk in chunked(iter_conversations(files), TOKENIZE_CHUNK):
        for item in tokenize_conversations(tokenizer, chunk):
            splits[bool(is_val[index])].append(item)
            index += 1
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    arrays = {}
    for name, held_out in (("train", False), ("val", True)):
        conversations = Conversations.from_list(splits[held_out])
        arrays[f"{name}_tokens"] = conversations.tokens.astype(dtype)
        arrays[f"{name}_is_assistant"] = conversations.is_assistant
        arrays[f"{name}_offsets"] = conversations.offsets
    atomic_write(path, lambda f: np.savez(f, **arrays))
    log.info(
        "Tokenized %d conversations (%d held out) in %.1fs (cached in %s)",
        num_conversations,
        int(is_val.sum()),
        time.perf_counter() - start,
        path,
    )


def pack_best_fit(
    sizes: np.ndarray,
    capacity: int,
    counts: np.ndarray | None = None,
    max_counts: tuple[int, ...] = (),
) -> list[list[int]]:
    """Bins of item indices, each holding at most ``capacity``: best-fit decreasing.

    Items go largest first, each into the fullest bin it still fits, which wastes little space
    and depends only on the sizes, so every run (and every rank) packs identically. With
    ``counts`` ``[items, K]`` (say, images and audio clips per item), a bin also holds at most
    ``max_counts[k]`` of kind k: an item goes into the fullest bin with room for all.
    """
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted
    held: list[list[int]] = []  # counts per bin
    if counts is None:
        counts = np.zeros((len(sizes), 0), np.int64)
    counts_NK = (counts if counts.ndim == 2 else counts[:, None]).tolist()
    for item in np.argsort(-sizes, kind="stable").tolist():
        size, count = int(sizes[item]), counts_NK[item]
        at = bisect_left(free, (size, -1))
        while any(count) and at < len(free) and not _room(held[free[at][1]], count, max_counts):
            at += 1
        if at == len(free):
            bins.append([item])
            held.append(list(count))
            space, index = capacity - size, len(bins) - 1
        else:
            space, index = free.pop(at)
            bins[index].append(item)
            held[index] = [h + c for h, c in zip(held[index], count)]
            space -= size
        if space > 0:
            insort(free, (space, index))
    return bins


def _room(held: list[int], count: list[int], limits: tuple[int, ...]) -> bool:
    return all(h + c <= m for h, c, m in zip(held, count, limits, strict=True))


class PackedConversations:
    """The row source of SFT: whole conversations packed into rows of ``seq_len`` tokens.

    A conversation of n tokens fills n - 1 slots of a row: inputs ``ids[:-1]``, labels
    ``ids[1:]`` kept only where the label is an assistant token. No conversation is ever split
    across rows; doc ids count the conversations of a row (0, 1, ...) and positions restart at
    each, so packed conversations never see each other. The rest of a row is padding, with its
    own doc id and ignored labels. With ``media_counts`` ``[conversations, K]`` (images and
    audio clips of each), a row holds at most ``max_media_per_row[k]`` of kind k.
    """

    def __init__(
        self,
        conversations: Conversations,
        seq_len: int,
        pad_id: int,
        overlong: Literal["drop", "truncate"] = "drop",
        split: str = "training",
        media_counts: np.ndarray | None = None,
        max_media_per_row: tuple[int, ...] = (),
    ) -> None:
        self.conversations = conversations
        self.seq_len = seq_len
        self.pad_id = pad_id
        lengths_N = conversations.lengths
        is_long_N = lengths_N > seq_len + 1
        truncate = overlong == "truncate"
        self.kept_lengths = np.minimum(lengths_N, seq_len + 1) if truncate else lengths_N
        """Tokens used of each conversation."""
        # Assistant tokens among the labels (tokens 1..kept-1) of each conversation.
        starts_N = conversations.offsets[:-1]
        first_label_N = starts_N + np.minimum(self.kept_lengths, 1)
        assistant_cumsum = np.concatenate([[0], np.cumsum(conversations.is_assistant)])
        num_labels_N = (
            assistant_cumsum[starts_N + self.kept_lengths] - assistant_cumsum[first_label_N]
        )
        usable_N = (num_labels_N > 0) & (truncate | ~is_long_N)
        self.num_dropped = int((~usable_N).sum())
        """Conversations left out: too long (unless truncating) or without assistant tokens."""
        self.num_truncated = int((usable_N & is_long_N).sum())
        if len(lengths_N) and not usable_N.any():
            has_labels_N = assistant_cumsum[starts_N + lengths_N] > assistant_cumsum[first_label_N]
            raise ConfigError(
                _none_usable(lengths_N, is_long_N, has_labels_N, truncate, seq_len, split,
                             can_truncate=media_counts is None)
            )  # fmt: skip
        self._report(lengths_N, is_long_N, usable_N, truncate, split, media_counts is None)
        usable = np.flatnonzero(usable_N)
        counts = None if media_counts is None else media_counts[usable]
        bins = pack_best_fit(self.kept_lengths[usable] - 1, seq_len, counts, max_media_per_row)
        self.row_offsets = np.zeros(len(bins) + 1, dtype=np.int64)
        self.row_offsets[1:] = np.cumsum([len(b) for b in bins])
        self.row_conversations = np.array([usable[i] for b in bins for i in b], dtype=np.int64)
        """Conversation indices of row r: ``row_conversations[row_offsets[r]:row_offsets[r+1]]``."""
        self.num_rows = len(bins)

    def conversations_of(self, row: int) -> np.ndarray:
        """Indices of the conversations packed into ``row``, in order."""
        return self.row_conversations[self.row_offsets[row] : self.row_offsets[row + 1]]

    def batch(self, rows_B: np.ndarray) -> Batch:
        """Rows ``rows_B`` as one batch."""
        B, T = len(rows_B), self.seq_len
        tokens_BT = np.full((B, T), self.pad_id, dtype=np.int64)
        labels_BT = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
        positions_BT = np.zeros((B, T), dtype=np.int64)
        doc_ids_BT = np.zeros((B, T), dtype=np.int64)
        starts = self.conversations.offsets
        for b, row in enumerate(rows_B.tolist()):
            column = 0
            conversations = self.conversations_of(row)
            for doc, index in enumerate(conversations.tolist()):
                start, n = starts[index], self.kept_lengths[index]
                ids_N = self.conversations.tokens[start : start + n]
                is_label_N = self.conversations.is_assistant[start + 1 : start + n]
                end = column + n - 1
                tokens_BT[b, column:end] = ids_N[:-1]
                labels_BT[b, column:end] = np.where(is_label_N, ids_N[1:], IGNORE_INDEX)
                positions_BT[b, column:end] = np.arange(n - 1)
                doc_ids_BT[b, column:end] = doc
                column = end
            positions_BT[b, column:] = np.arange(T - column)
            doc_ids_BT[b, column:] = len(conversations)
        return Batch(
            *(torch.from_numpy(a) for a in (tokens_BT, labels_BT, positions_BT, doc_ids_BT))
        )

    def identity(self) -> dict[str, int]:
        """What decides the rows, for checking a resumed loader."""
        return {"num_rows": self.num_rows, "num_conversations": len(self.row_conversations)}

    def describe(self) -> str:
        return (
            f"{len(self.conversations)} conversations, {self.num_dropped} of them left out as "
            f"longer than seq_len + 1 = {self.seq_len + 1} tokens or without assistant tokens"
        )

    def _report(
        self,
        lengths_N: np.ndarray,
        is_long_N: np.ndarray,
        usable_N: np.ndarray,
        truncate: bool,
        split: str,
        can_truncate: bool,
    ) -> None:
        """Say once, when packing, what was truncated or left out and how to avoid it."""
        num_long, total, limit = int(is_long_N.sum()), len(lengths_N), self.seq_len + 1
        if num_long:
            longest = int(lengths_N.max())
            if truncate:
                log.warning(
                    "Truncated %d of %d %s conversations longer than seq_len + 1 = %d tokens "
                    "(the longest has %d) to their first %d tokens.",
                    num_long, total, split, limit, longest, limit,
                )  # fmt: skip
            else:
                log.warning(
                    "Dropped %d of %d %s conversations longer than seq_len + 1 = %d tokens "
                    "(the longest has %d). Raise --training.seq_len%s.",
                    num_long, total, split, limit, longest,
                    ", or keep their start with --data.overlong_conversations truncate"
                    if can_truncate else "",
                )  # fmt: skip
        unlabelled = int((~usable_N & (truncate | ~is_long_N)).sum())
        if unlabelled:
            log.warning(
                "Dropped %d of %d %s conversations without assistant tokens in their first "
                "%d tokens: there is nothing to train on in them.",
                unlabelled, total, split, limit,
            )  # fmt: skip


def _none_usable(
    lengths_N: np.ndarray,
    is_long_N: np.ndarray,
    has_labels_N: np.ndarray,
    truncate: bool,
    seq_len: int,
    split: str,
    can_truncate: bool,
) -> str:
    """Why every conversation of a split was left out, and the fix that helps: too long for a
    sequence, assistant tokens only beyond the truncation, or none at all (the template)."""
    limit = seq_len + 1
    unlabelled_N = ~has_labels_N  # no assistant token anywhere: the chat template's doing
    long_N = is_long_N & has_labels_N & (not truncate)
    cut_N = is_long_N & has_labels_N & truncate  # their assistant tokens all lie past the cut
    causes, fixes = [], []
    if long_N.any():
        longest = int(lengths_N[long_N].max())
        causes.append(f"{int(long_N.sum())} longer than seq_len + 1 = {limit} tokens (the "
                      f"longest has {longest})")  # fmt: skip
        fixes.append(f"raise --training.seq_len (to {longest - 1} to keep them all)"
                     + (", or keep their start with --data.overlong_conversations truncate"
                        if can_truncate else ""))  # fmt: skip
    if cut_N.any():
        causes.append(f"{int(cut_N.sum())} without an assistant token in their first {limit} "
                      f"tokens (the longest has {int(lengths_N[cut_N].max())})")  # fmt: skip
        fixes.append("raise --training.seq_len so that their replies fit")
    if unlabelled_N.any():
        causes.append(f"{int(unlabelled_N.sum())} without any assistant token after chat "
                      "templating")  # fmt: skip
        fixes.append("check that the chat template renders the assistant messages (or give "
                     "one with --data.chat_template FILE.jinja)")  # fmt: skip
    return (
        f"All {len(lengths_N)} {split} conversations were left out, so there is nothing to "
        f"train on: {' and '.join(causes)}; {', and '.join(fixes)}."
    )
