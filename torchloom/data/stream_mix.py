"""Endless document streams over source files, mixed by weight and packed into one global
token stream. Everything here runs on the loader's background thread.

The packed stream is the same on every rank and for any data-parallel size: documents, in the
mix's seeded order, each tokenized and followed by eos, back to back. Its state (each source's
position, the mix's document counter and the tokens read but not yet served) is all a resume
needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from torchloom.config.errors import ConfigError
from torchloom.data.readers import Document, Position, read_documents, token_arrays
from torchloom.data.sources import SourceFile, check_entries_have_documents
from torchloom.data.tokenizer import Tokenizer

MIX_BLOCK = 4096
"""Mix choices drawn per seeded block: document n's source is block n // MIX_BLOCK's draw."""
DOCS_PER_READ = 32
"""At most this many documents are tokenized together (one encode_batch call, parallel on the
tokenizer's threads); fewer when the average document length says fewer fill the need, so the
carry (saved in checkpoints) stays near one document."""


class DocumentStream:
    """One source's documents in file order, restarting from its first file when it runs out.

    Its position is ``[epoch, file, a, b]``: passes completed, the file index, and that file's
    position after the last document returned (readers.py says what ``a, b`` mean per format).
    """

    def __init__(
        self,
        name: str,
        files: list[SourceFile],
        eos_id: int,
        vocab_size: int,
        sources: list[tuple[str, int]] | None = None,
    ) -> None:
        self.name = name
        self.files = files
        self.sources = sources or [(name, len(files))]
        """The --data.sources entries the files came from: (entry, its number of files), in
        order; a full pass in which one of them gave no document is refused, naming it."""
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.restore([0, 0, 0, 0])

    @property
    def position(self) -> list[int]:
        return [self._epoch, self._file, *self._after]

    def restore(self, position: list[int]) -> None:
        epoch, file, a, b = (int(v) for v in position)
        if not 0 <= file < len(self.files):
            raise ConfigError(
                f"The loader state points at file {file} of source '{self.name}', which has "
                f"{len(self.files)}: the source changed since the checkpoint."
            )
        self._epoch, self._file, self._after = epoch, file, (a, b)
        self._reader: Iterator[tuple[Document, Position]] | None = None
        # Documents of each file since the stream last stood at its very beginning (None: it
        # has not, as after a resume mid-source), to find a source entry with none in a pass.
        self._pass_docs: list[int] | None = (
            [0] * len(self.files) if (file, a, b) == (0, 0, 0) else None
        )

    def next(self) -> Document:
        """The next document (text, or token ids ending with eos)."""
        while True:
            if self._reader is None:
                file = self.files[self._file]
                self._reader = read_documents(
                    file.path, file.text_field, self._after, self.eos_id, self.vocab_size
                )
            found = next(self._reader, None)
            if found is not None:
                doc, self._after = found
                if self._pass_docs is not None:
                    self._pass_docs[self._file] += 1
                return doc
            self._reader, self._after = None, (0, 0)
            self._file += 1
            if self._file == len(self.files):
                if self._pass_docs is not None:
                    check_entries_have_documents(self.sources, self._pass_docs)
                self._file, self._epoch = 0, self._epoch + 1
                self._pass_docs = [0] * len(self.files)


class PackedStream:
    """The global token stream: mixed documents, tokenized, eos after each, back to back.

    ``take(n)`` returns the next ``n`` tokens plus everything read ahead (the carry); ``keep``
    puts back the unserved tail. With ``weights`` (one per stream, summing to 1) document n
    comes from the stream a seeded draw picks; without, there is one stream.
    """

    def __init__(
        self,
        streams: list[DocumentStream],
        weights: list[float] | None,
        tokenizer: Tokenizer,
        seed: int,
        row_tokens: int = 1,
    ) -> None:
        if weights is None and len(streams) != 1:
            raise ValueError("several streams need mix weights")
        self.streams = streams
        self.row_tokens = row_tokens
        """Tokens one row needs (seq_len + 1): a corpus whose every pass holds fewer is refused."""
        self._first_pass: int | None = None
        """Tokens of the streams' first passes so far; None when not counting (a stream did
        not start at its beginning, or the check is done)."""
        self.probabilities = None if weights is None else np.asarray(weights) / sum(weights)
        self.tokenizer = tokenizer
        self.seed = seed
        self.documents = 0
        """Documents drawn so far: the mix's position in its seeded sequence of choices."""
        self.carry = np.zeros(0, dtype=np.int64)
        """Tokens read but not yet served (a served row's last token is the next one's first)."""
        self._choices: tuple[int, np.ndarray] | None = None
        self._read_counts = [0, 0]  # documents and tokens read by this process: sizes reads
        self._watch_first_passes()

    def take(self, num_tokens: int) -> np.ndarray:
        """The carry extended by whole documents to at least ``num_tokens`` tokens."""
        parts, total = [self.carry], len(self.carry)
        while total < num_tokens:
            docs_read, tokens_read = self._read_counts
            average = tokens_read / docs_read if docs_read else num_tokens
            count = min(DOCS_PER_READ, max(1, math.ceil((num_tokens - total) / average)))
            docs = self._read(count)
            parts.extend(docs)
            total += sum(len(d) for d in docs)
            self._read_counts = [docs_read + count, tokens_read + sum(len(d) for d in docs)]
        return np.concatenate(parts)

    def keep(self, tail: np.ndarray) -> None:
        """``tail`` (the unserved end of what ``take`` returned) becomes the carry."""
        self.carry = np.array(tail, dtype=np.int64)

    def state(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "positions": [s.position for s in self.streams],
            "carry": self.carry.tolist(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        positions = state["positions"]
        if len(positions) != len(self.streams):
            raise ConfigError(
                f"The loader state holds {len(positions)} source position(s) but this run reads "
                f"{len(self.streams)} stream(s): --data.sources or --data.mix changed."
            )
        for stream, position in zip(self.streams, positions):
            stream.restore(position)
        self._watch_first_passes()
        self.documents = int(state["documents"])
        self.carry = np.asarray(state["carry"], dtype=np.int64)

    def _read(self, count: int) -> list[np.ndarray]:
        """The next ``count`` documents of the mix as token arrays ending with eos."""
        docs, passes = [], []
        for n in range(count):
            stream = self.streams[self._source_of(self.documents + n)]
            docs.append(stream.next())
            passes.append(stream.position[0])  # 0: the document is of a first pass
        self.documents += count
        arrays = token_arrays(docs, self.tokenizer)
        self._count_first_passes(passes, arrays)
        return arrays

    def _watch_first_passes(self) -> None:
        """Count the first passes' tokens if every stream stands at its very beginning."""
        at_start = all(s.position == [0, 0, 0, 0] for s in self.streams)
        self._first_pass = 0 if at_start else None

    def _count_first_passes(self, passes: list[int], arrays: list[np.ndarray]) -> None:
        """ConfigError once every stream has gone round and, together, their first passes
        hold fewer tokens than one row: the rows would repeat a few tokens over and over
        (the cached loader refuses such data before it starts)."""
        if self._first_pass is None:
            return
        self._first_pass += sum(len(a) for a, done in zip(arrays, passes) if done == 0)
        # A stream the mix gives weight 0 is never read, so it never goes round: only the
        # drawn ones must (else the check never ran, and a few tokens repeated forever).
        drawn = [s for i, s in enumerate(self.streams)
                 if self.probabilities is None or self.probabilities[i] > 0]  # fmt: skip
        if all(stream.position[0] >= 1 for stream in drawn):
            if self._first_pass < self.row_tokens:
                raise ConfigError(
                    f"The data sources hold {self._first_pass} tokens in all (each document "
                    f"followed by eos), and one sequence of seq_len={self.row_tokens - 1} needs "
                    f"{self.row_tokens}. Add data or lower seq_len."
                )
            self._first_pass = None  # checked

    def _source_of(self, document: int) -> int:
        if self.probabilities is None:
            return 0
        block = document // MIX_BLOCK
        if self._choices is None or self._choices[0] != block:
            rng = np.random.default_rng([self.seed, block])
            draw = rng.choice(len(self.probabilities), size=MIX_BLOCK, p=self.probabilities)
            self._choices = (block, draw)
        return int(self._choices[1][document % MIX_BLOCK])
