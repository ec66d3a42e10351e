"""The batch type, and cutting a token stream into training windows: inputs, next-token labels,
positions, doc ids.

Window k of a stream is ``tokens[k*T : k*T + T + 1]`` (consecutive windows share one token, so
every token but the first is a label exactly once per epoch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "Batch"]

IGNORE_INDEX = -100
"""The label of a token with nothing to predict (padding, prompts under an assistant-only loss,
a document's last token): every loss and count skips it. -100, as PyTorch's and HF's losses."""


def to_device(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device``; a non-blocking copy from the CPU to a GPU goes through pinned memory
    (torch's pinned allocator keeps the block until the copy has run)."""
    if non_blocking and device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


@dataclass
class Batch:
    """One micro-batch of packed sequences: ``[B, T]`` int64 token fields, plus optional fields
    that objectives and models read (the ``extras``)."""

    tokens: torch.Tensor
    """Input token ids."""
    labels: torch.Tensor
    """The token that follows each input, or IGNORE_INDEX where nothing should be predicted."""
    positions: torch.Tensor
    """Position of each token inside its document (restarting at 0 with document masking):
    ``[B, T]``, or ``[B, T, ...]`` for models with several position axes."""
    doc_ids: torch.Tensor | None = None
    """Document number of each token inside its row (0, 1, ...); attention must not cross
    documents. None when document masking is off."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token fields, ``[B, T, ...]`` (loss masks, advantages, the generator's log-probs):
    cut along T with the tokens (context parallelism) and along B (micro-batches)."""
    row_extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row fields, ``[B, ...]`` (a sequence's reward): cut along B only."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """The model's media inputs, per row and cut along B only: each row's images (and audio)
    at fixed shapes, N items x L patches padded (``pixel_values`` ``[B, N, L, P]``,
    ``image_grid_thw`` ``[B, N, 3]`` with zero rows for absent items; see
    data/multimodal.py). The model reads them (``model(..., media=batch.media)``); empty for
    text."""
    _num_label_tokens: int | None = field(default=None, repr=False, compare=False)

    @property
    def num_label_tokens(self) -> int:
        """Number of labels that count toward the loss (cached, so no device sync after .to)."""
        if self._num_label_tokens is None:
            self._num_label_tokens = int((self.labels != IGNORE_INDEX).sum())
        return self._num_label_tokens

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """This batch on ``device``. ``non_blocking`` to a GPU copies from pinned host memory:
        from pageable memory the copy may wait for the GPU's queued work, and the host would
        no longer run ahead of it."""
        count = self.num_label_tokens  # count on the source device: free on CPU
        move = functools.partial(to_device, device=torch.device(device), non_blocking=non_blocking)
        moved = self.map_tokens(move)
        moved.row_extras = {k: move(v) for k, v in self.row_extras.items()}
        moved.media = {k: move(v) for k, v in self.media.items()}
        moved._num_label_tokens = count
        return moved

    def map_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """A batch whose per-token fields are ``fn`` of these (e.g. one context-parallel rank's
        tokens); per-row fields are kept."""
        doc_ids = None if self.doc_ids is None else fn(self.doc_ids)
        extras = {name: fn(value) for name, value in self.extras.items()}
        return Batch(fn(self.tokens), fn(self.labels), fn(self.positions), doc_ids, extras,
                     dict(self.row_extras), dict(self.media))  # fmt: skip

    def named_tensors(self) -> dict[str, torch.Tensor | None]:
        """Every field by name (extras as ``extras.NAME``, ``row_extras.NAME``)."""
        return {
            "tokens": self.tokens, "labels": self.labels, "positions": self.positions,
            "doc_ids": self.doc_ids,
            **{f"extras.{k}": v for k, v in self.extras.items()},
            **{f"row_extras.{k}": v for k, v in self.row_extras.items()},
            **{f"media.{k}": v for k, v in self.media.items()},
        }  # fmt: skip

    def clone(self) -> Batch:
        """A batch of copies (its own memory, e.g. a CUDA graph's static inputs)."""
        copy = self.map_tokens(torch.clone)
        copy.row_extras = {k: v.clone() for k, v in self.row_extras.items()}
        copy.media = {k: v.clone() for k, v in self.media.items()}
        copy._num_label_tokens = self._num_label_tokens
        return copy

    def fields(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named fields (``labels`` or any extra), for an objective; KeyError naming the
        missing one."""
        found = {"labels": self.labels, **self.extras, **self.row_extras}
        missing = [name for name in names if name not in found]
        if missing:
            raise KeyError(
                f"the batch has no field {', '.join(missing)} (it has {', '.join(sorted(found))})"
            )
        return {name: found[name] for name in names}


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many full windows of ``seq_len`` inputs (+1 label) a stream of tokens holds."""
    return max(num_tokens - 1, 0) // seq_len


class TokenWindows:
    """The row source of pre-training: row k is window k of a flat token stream."""

    def __init__(self, tokens: np.ndarray, eos_id: int, seq_len: int, document_mask: bool) -> None:
        self.tokens = tokens
        self.eos_id = eos_id
        self.seq_len = seq_len
        self.document_mask = document_mask
        self.num_rows = num_windows(len(tokens), seq_len)

    def batch(self, rows_B: np.ndarray) -> Batch:
        """Windows ``rows_B`` as one batch."""
        return pack_windows(
            self.tokens, rows_B * self.seq_len, self.seq_len, self.eos_id, self.document_mask
        )

    def identity(self) -> dict[str, int]:
        """What decides the rows, for checking a resumed loader: the window count."""
        return {"num_windows": self.num_rows}

    def describe(self) -> str:
        return (
            f"{len(self.tokens)} tokens, and one sequence of seq_len={self.seq_len} needs "
            f"{self.seq_len + 1}"
        )


def pack_windows(
    tokens: np.ndarray, starts: np.ndarray, seq_len: int, eos_id: int, document_mask: bool
) -> Batch:
    """The batch of windows ``tokens[s : s + seq_len + 1]`` for each ``s`` in ``starts``.

    Row b holds inputs ``w[:-1]`` and labels ``w[1:]`` of window ``w``. With ``document_mask``,
    a document starts after every ``eos`` (and at the window start): positions restart there,
    doc ids count up, and the label after an ``eos`` (the next document's first token, which
    the current document cannot predict) is ignored.
    """
    offsets_W = np.arange(seq_len + 1)
    windows_BW = np.asarray(tokens[starts[:, None] + offsets_W], dtype=np.int64)
    inputs_BT, labels_BT = windows_BW[:, :-1], windows_BW[:, 1:].copy()
    batch_size = len(starts)
    if not document_mask:
        positions_BT = np.broadcast_to(offsets_W[:-1], (batch_size, seq_len))
        return Batch(_tensor(inputs_BT), _tensor(labels_BT), _tensor(positions_BT), None)

    is_eos_BT = inputs_BT == eos_id
    labels_BT[is_eos_BT] = IGNORE_INDEX
    # Token i opens a document when token i-1 is an eos (or i is the first of the window).
    starts_doc_BT = np.zeros_like(is_eos_BT)
    starts_doc_BT[:, 0] = True
    starts_doc_BT[:, 1:] = is_eos_BT[:, :-1]
    doc_ids_BT = np.cumsum(starts_doc_BT, axis=1) - 1
    # Position = distance to the latest document start at or before each token.
    latest_start_BT = np.maximum.accumulate(np.where(starts_doc_BT, offsets_W[:-1], 0), axis=1)
    positions_BT = offsets_W[:-1] - latest_start_BT
    return Batch(_tensor(inputs_BT), _tensor(labels_BT), _tensor(positions_BT), _tensor(doc_ids_BT))


def _tensor(array_BT: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array_BT, dtype=np.int64))
