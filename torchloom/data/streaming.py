"""The streaming training loader: tokenizes and packs on a background thread, no cache pass.

Step s serves global rows ``s*G ... (s+1)*G - 1`` of the packed token stream (stream_mix.py),
row k being the window ``tokens[k*T : k*T + T + 1]`` of what remains, exactly as TokenWindows
cuts a cached stream; dp rank r takes the r-th contiguous block of ``G / dp_size`` rows. Every
rank reads and tokenizes the whole stream and keeps its block, so the rows of a step, and the
loader state after it, do not depend on the number of ranks: a checkpoint resumes on any
data-parallel size, repeating and skipping nothing.

A worker thread runs up to ``prefetch_steps`` steps ahead through a bounded queue; each step
comes with the stream state after it, which becomes the loader state once the step is served.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from typing import Any

import numpy as np

from torchloom.config.errors import ConfigError
from torchloom.data.loader import check_batch_layout
from torchloom.data.packing import Batch, pack_windows
from torchloom.data.stream_mix import PackedStream

STREAM_STATE_VERSION = 1


class StreamingLoader:
    """Endless, resumable training batches packed on the fly; the same interface as TrainLoader
    (``next_step``, ``state_dict``, ``load_state_dict``, ``tokens_seen``)."""

    def __init__(
        self,
        stream: PackedStream,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        document_mask: bool = True,
        prefetch_steps: int = 4,
        identity: dict[str, Any] | None = None,
    ) -> None:
        check_batch_layout(global_batch_size, micro_batch_size, dp_size, dp_rank, seq_len)
        self.stream = stream
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.document_mask = document_mask
        self.prefetch_steps = max(prefetch_steps, 1)
        self.identity = {"version": STREAM_STATE_VERSION, **(identity or {})}
        self.step = 0
        """Optimizer steps already served."""
        self.tokens_seen = 0
        """Input tokens served so far to all ranks together."""
        self._stream_state = stream.state()
        self._queue: queue.Queue[Any] | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step (length grad_accum_steps)."""
        if self._worker is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        batches, self._stream_state = item
        self.step += 1
        self.tokens_seen += self.global_batch_size * self.seq_len
        return batches

    def state_dict(self) -> dict[str, Any]:
        """The position after the last served step (the same on every rank), plus the
        values that must not change for an exact resume. Flat: DCP stores each value."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "stream": json.dumps(self._stream_state),
            **self.identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the step ``state`` was saved at; refuse if the data changed.

        seq_len, the global and micro batch sizes and dp_size may all differ from the saved
        run's: the next rows are cut from the saved stream position whatever they are.
        """
        changes = (_change(name, state, value) for name, value in self.identity.items())
        changed = [change for change in changes if change]
        if changed:
            raise ConfigError(
                "Cannot resume the streaming data loader: " + "; ".join(changed) + ". Restore "
                "the original --data settings, or resume without the loader state: "
                "--checkpoint.exclude_from_loading '[\"dataloader\"]'."
            )
        self.close()
        stream_state = json.loads(state["stream"])
        self.stream.restore(stream_state)
        self._stream_state = stream_state
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    def close(self) -> None:
        """Stop the worker thread (a later next_step starts a new one from the loader state)."""
        if self._worker is None:
            return
        self._stop.set()
        assert self._queue is not None
        while self._worker.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)  # unblock a worker waiting to put
        self._worker.join()
        self._worker, self._queue = None, None
        self.stream.restore(self._stream_state)  # the worker read ahead of what was served

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch_steps)
        self._worker = threading.Thread(
            target=self._produce, args=(self._queue, self._stop), name="torchloom-data",
            daemon=True,
        )  # fmt: skip
        self._worker.start()

    def _produce(self, out: queue.Queue[Any], stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                batches = self._pack_step()
                item = (batches, self.stream.state())
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # raised again by next_step, on the trainer's thread
            out.put(err)

    def _pack_step(self) -> list[Batch]:
        """Cut the next global batch from the stream; this rank's share, in micro-batches."""
        T, G = self.seq_len, self.global_batch_size
        tokens = self.stream.take(G * T + 1)
        self.stream.keep(tokens[G * T :])
        share = G // self.dp_size
        starts = (self.dp_rank * share + np.arange(share, dtype=np.int64)) * T
        return [
            pack_windows(tokens, chunk, T, self.stream.tokenizer.eos_id, self.document_mask)
            for chunk in np.split(starts, self.grad_accum_steps)
        ]


def _change(name: str, state: dict[str, Any], now: Any) -> str | None:
    """What changed in identity value ``name`` since the checkpoint ``state``, or None. The
    files are named by what was added and removed (a checkpoint from before they were
    recorded has none to compare)."""
    saved = state.get(name)
    if saved == now or (name == "files" and saved is None):
        return None
    if name != "files":
        return f"{name} was {saved!r} in the checkpoint and is {now!r} now"
    before = {path for files in json.loads(saved) for path in files}
    after = {path for files in json.loads(now) for path in files}
    parts = [f"{len(paths)} {what}: " + ", ".join(sorted(paths)[:3]) + (" ..." if len(paths) > 3 else "")
             for what, paths in (("added", after - before), ("removed", before - after)) if paths]  # fmt: skip
    return ("the sources' files changed since the checkpoint (" + "; ".join(parts or ["reordered"])
            + "), so its positions would point into other files")  # fmt: skip
