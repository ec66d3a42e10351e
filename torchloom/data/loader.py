"""Stateful, data-parallel aware loaders over a row source: the windows of a token stream for
pre-training, or packed conversations for SFT. One loader serves both, with the same guarantees.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from torchloom.config.errors import ConfigError
from torchloom.data.packing import IGNORE_INDEX, Batch

LOADER_STATE_VERSION = 1


class RowSource(Protocol):
    """Rows of ``seq_len`` tokens, numbered 0..num_rows-1, that a loader batches."""

    seq_len: int
    num_rows: int

    def batch(self, rows_B: np.ndarray) -> Batch:
        """Rows ``rows_B`` (int64 indices) as one ``[B, seq_len]`` batch."""
        ...

    def identity(self) -> dict[str, int]:
        """Values that decide the rows (e.g. their count): a resume refuses if they changed."""
        ...

    def describe(self) -> str:
        """What the source holds, for the error when it has no row at all."""
        ...


class TrainLoader:
    """Endless, resumable training batches, identical in content whatever the parallel layout.

    Epoch e visits all rows in a permutation seeded by (seed, e). Optimizer step s takes the
    global batch of flat rows [s*G, (s+1)*G) of that endless sequence; dp rank r takes its
    contiguous share of G/dp_size rows, cut into micro-batches. So the union over ranks of a
    step's micro-batches depends only on (seed, G, the rows), not on dp_size or
    micro_batch_size, and losses match across layouts.
    """

    def __init__(
        self,
        rows: RowSource,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        tokenizer: str | None = None,
    ) -> None:
        check_batch_layout(global_batch_size, micro_batch_size, dp_size, dp_rank, rows.seq_len)
        if rows.num_rows == 0:
            raise ConfigError(
                f"The training split is too small for one sequence: {rows.describe()}. Add data "
                "or lower seq_len."
            )
        self.rows = rows
        self.seq_len = rows.seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.tokenizer = tokenizer
        """The tokenizer's fingerprint (its first 16 hex digits), checked on resume."""
        self.step = 0
        """Optimizer steps already served; the next call to next_step serves this one."""
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def num_rows(self) -> int:
        """Sequences in one epoch."""
        return self.rows.num_rows

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def epoch(self) -> float:
        """Passes over the training rows so far (fractional)."""
        return self.step * self.global_batch_size / self.num_rows

    @property
    def tokens_seen(self) -> int:
        """Input tokens consumed so far by all ranks together."""
        return self.step * self.global_batch_size * self.seq_len

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step (length grad_accum_steps)."""
        share = self.global_batch_size // self.dp_size
        first = self.step * self.global_batch_size + self.dp_rank * share
        rows_N = self._rows(np.arange(first, first + share, dtype=np.int64))
        self.step += 1
        return [self.rows.batch(chunk) for chunk in np.split(rows_N, self.grad_accum_steps)]

    def state_dict(self) -> dict[str, Any]:
        """Small, picklable state: the step plus what must not change for an exact resume."""
        return {"step": self.step, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the step ``state`` was saved at; refuse if the data changed."""
        identity = self._identity()
        if "tokenizer" not in state:  # saved before the loader recorded it
            del identity["tokenizer"]
        elif state["tokenizer"] != identity["tokenizer"]:
            raise ConfigError(
                f"The checkpoint was trained with another tokenizer (fingerprint "
                f"{state['tokenizer']}, this run's is {identity['tokenizer']}): its ids mean "
                "other text. Resume with the run's original --data.tokenizer."
            )
        changed = [
            f"{name} was {state.get(name)!r} in the checkpoint and is {value!r} now"
            for name, value in identity.items()
            if state.get(name) != value
        ]
        if changed:
            raise ConfigError(
                "Cannot resume the data loader exactly: " + "; ".join(changed) + ". Restore "
                "the original settings (the row count follows from the data, tokenizer and "
                "seq_len), or resume without the loader state: --checkpoint.exclude_from_loading "
                "'[\"dataloader\"]'."
            )
        self.step = int(state["step"])

    def _identity(self) -> dict[str, Any]:
        # micro_batch_size and dp_size are absent on purpose: steps do not depend on them.
        return {
            "version": LOADER_STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "tokenizer": self.tokenizer,
            **self.rows.identity(),
        }

    def _rows(self, flat_N: np.ndarray) -> np.ndarray:
        """Row index of each flat position in the endless sequence of epochs."""
        epoch_N, index_N = np.divmod(flat_N, self.num_rows)
        if not self.shuffle:
            return index_N
        rows_N = np.empty_like(index_N)
        for epoch in np.unique(epoch_N):
            in_epoch = epoch_N == epoch
            rows_N[in_epoch] = self._permutation(int(epoch))[index_N[in_epoch]]
        return rows_N

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a step spans at most a few epochs; keep memory flat
                self._permutations.pop(min(self._permutations))
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_rows)
        return self._permutations[epoch]


class ValLoader:
    """The validation rows in order, the same every pass, each dp rank taking a share.

    Each eval step covers batch_size * dp_size consecutive rows; rank r takes the r-th block
    of batch_size. The last step is padded with rows whose labels are all IGNORE_INDEX, so every
    rank runs the same number of batches and the token-averaged loss is the same for any layout.
    """

    def __init__(
        self, rows: RowSource, batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        check_batch_layout(batch_size * dp_size, batch_size, dp_size, dp_rank, rows.seq_len)
        if rows.num_rows == 0:
            raise ConfigError(
                f"The validation split is too small for one sequence: {rows.describe()}. Raise "
                "--data.val_fraction, or set it to 0 to skip validation."
            )
        self.rows = rows
        self.seq_len = rows.seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def num_batches(self) -> int:
        """Batches per rank for a full pass over the validation rows."""
        return -(-self.num_rows // (self.batch_size * self.dp_size))

    def batches(self, max_batches: int | None = None) -> Iterator[Batch]:
        """This rank's validation batches, at most ``max_batches`` of them."""
        count = self.num_batches if max_batches is None else min(max_batches, self.num_batches)
        for step in range(count):
            first = (step * self.dp_size + self.dp_rank) * self.batch_size
            rows_B = np.arange(first, first + self.batch_size, dtype=np.int64)
            is_padding_B = rows_B >= self.num_rows
            rows_B[is_padding_B] = 0  # any real row; its labels are ignored below
            batch = self.rows.batch(rows_B)
            batch.labels[torch.from_numpy(is_padding_B)] = IGNORE_INDEX
            yield batch

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()


def check_batch_layout(
    global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int, seq_len: int
) -> None:
    """Raise ConfigError unless G sequences split evenly into micro-batches on dp_size ranks."""
    for name, value in [
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("dp_size", dp_size),
        ("seq_len", seq_len),
    ]:
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an integer of at least 1.")
    if not _is_int(dp_rank) or not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank!r} must be an integer in [0, dp_size={dp_size}).")
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step == 0:
        return
    lower = global_batch_size // per_step * per_step
    options = [str(g) for g in (lower, lower + per_step) if g > 0]
    hint = f"global_batch_size={' or '.join(options)}"
    if global_batch_size % dp_size == 0:
        share = global_batch_size // dp_size
        divisors = [m for m in range(1, min(share, micro_batch_size) + 1) if share % m == 0]
        hint += f", or a micro_batch_size dividing {share} (e.g. {divisors[-1]})"
    raise ConfigError(
        f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size × dp_size "
        f"= {micro_batch_size} × {dp_size} = {per_step}: each optimizer step must split into "
        f"equal micro-batches on every data-parallel rank. Use {hint}."
    )


def _is_int(value: object) -> bool:
    """An integer (a numpy one too), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
