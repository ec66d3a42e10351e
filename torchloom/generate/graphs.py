"""Decode steps replayed from CUDA graphs.

A decode step of a small batch is hundreds of tiny kernels, so on the GPU its time is mostly
launch overhead. ``DecodeGraphs`` captures the model's one-token forward once per row count
bucket (1, 2, 4, ... up to the cache's slots) over the leading slots of the model's cache
(``ModelCache.bind_leading``: static shapes, no host synchronisation), and replays the smallest
bucket that covers the active slots. Rows of other slots inside a bucket (free, or kept for a
continuation: engine.py) compute on a dummy token and change nothing lasting: they sit at the
slot's last index, where no real token ever goes (a position-indexed state writes only there),
and are marked not live (a state not indexed by position keeps its slot as it was).

Each graph also runs ``finish`` on the step's logits (the generator's log-softmax and argmax)
and writes the next step's inputs for greedy rows, so a step costs one replay and one small
host transfer, and a run of greedy steps is launched one step ahead of the host reading them.
The graphs replay the same kernels an eager step would launch, so the numbers are the same.
With ``compile`` the step (model and ``finish``) is first compiled by inductor (batch size
dynamic, so one compile serves every bucket above 1), which fuses the hundreds of pointwise
kernels; the graphs then replay the compiled kernels.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchloom.generate.fused_step import decode_weights
from torchloom.kernels.fused_decode import FusedDecodeStep
from torchloom.models.components.cache import ModelCache


@contextlib.contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Python's cycle collector held off: a collection inside a capture may free a dead
    generator's graphs (any caught in a reference cycle), and destroying a graph while another
    is being captured invalidates that capture ("operation failed due to a previous error
    during capture": 2 of the 10 GPU tests of tests/generate failed so on an H200, every run).
    ``torch.cuda.graph`` no longer collects before capturing (torch 2.11)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def buckets(slots: int) -> list[int]:
    """Row counts a graph is captured for: powers of two below ``slots``, and ``slots``."""
    sizes, size = [], 1
    while size < slots:
        sizes.append(size)
        size *= 2
    return [*sizes, slots]


Finish = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class DecodeStep:
    """One launched decode step. ``logprobs_BV`` is the bucket's static output (valid until the
    next step is launched); ``best()`` waits for the step and returns its [2][bucket] argmax
    tokens and log-probabilities, copied to host memory as soon as the step ended."""

    def __init__(
        self, logprobs_BV: torch.Tensor, best_host: torch.Tensor, done: torch.cuda.Event | None
    ) -> None:
        self.logprobs_BV, self._best_host, self._done = logprobs_BV, best_host, done

    def best(self) -> list[list[float]]:
        if self._done is not None:
            self._done.synchronize()
        return self._best_host.tolist()


class DecodeGraphs:
    """One captured decode step per bucket; ``launch`` fills the inputs (or keeps the ones the
    last step left), replays, and returns the DecodeStep of the bucket's rows (row i = slot i).

    Every step also writes the next step's inputs on the device: each row's argmax token, one
    position further on. A step of greedy rows can therefore be launched before the host has
    read the previous one (``launch()`` without inputs), so the GPU does not wait for the
    Python between steps."""

    def __init__(
        self,
        model: nn.Module,
        cache: ModelCache,
        finish: Finish,
        capture: bool = True,
        compile: bool = False,
        fused_step: bool = False,
    ) -> None:
        """``capture=False`` runs the same static-shape steps without graphs (any device).
        ``fused_step``: the bucket of one row runs kernels/fused_decode.py's one-launch step
        (the model must be one that generate/fused_step.py accepts) instead of the forward."""
        self.cache, self.finish = cache, finish
        device = cache.device
        self.sizes = buckets(cache.slots)
        self._tokens_B1 = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
        self._positions_B1 = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
        self._live_B = torch.ones(cache.slots, dtype=torch.bool, device=device)
        # Two host buffers (pinned on CUDA) and events in turn: one for the step being read, one
        # for the step launched after it.
        pinned = device.type == "cuda"
        self._host = [torch.empty(2 * cache.slots, dtype=torch.float64, pin_memory=pinned)
                      for _ in range(2)]  # fmt: skip
        self._done = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self._turn = 0
        self._step = self._model_step(model)
        if compile:  # a compiled wrapper around the same module: the model is left as it is
            self._step = torch.compile(self._step, dynamic=True)
            # The buffers the buckets' rows are views of keep their size: static, the first
            # bucket's rows are not duck-sized to them (which recompiled the second bucket).
            for buffer in (self._tokens_B1, self._positions_B1, self._live_B):
                torch._dynamo.mark_static(buffer)
        self._fused = None
        if fused_step:  # reads slot 0's inputs and writes its next ones itself
            self._fused = FusedDecodeStep(
                decode_weights(model, cache), self._tokens_B1[:1], self._positions_B1[:1]
            )
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._bucket = 0  # the bucket of the last launched step
        if capture:
            self._capture(device)

    def _model_step(self, model: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        # Not closing over self: without a reference cycle a dropped generator's graphs and
        # cache are freed at once, not by the cycle collector (which could run in a capture).
        finish = self.finish

        def step(
            tokens_B1: torch.Tensor, positions_B1: torch.Tensor, cache: ModelCache
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return finish(model(tokens_B1, positions_B1, cache=cache)[:, 0])

        return step

    def _capture(self, device: torch.device, warmup: int = 2) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Warm-up on a side stream (as capture requires), largest first so the pool fits all.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for rows in reversed(self.sizes):
                for _ in range(warmup):
                    self._forward(rows)
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.no_grad(), _no_garbage_collection():
            for rows in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                # thread_local: a lagged RL run captures in its generator thread while the
                # trainer's thread goes on allocating; global mode would fail that capture.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._outputs[rows] = self._forward(rows)
                self._graphs[rows] = graph
        # The captures wrote dummy keys at position 0 of every slot: nothing is cached yet.

    def _forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if rows == 1 and self._fused is not None:
            # Slot 0 alone; not live (no slot decoding) it writes at the scratch index, as the
            # forward's dummy rows do: the cache is only indexed by position.
            return self._fused()
        tokens_B1, positions_B1 = self._tokens_B1[:rows], self._positions_B1[:rows]
        logprobs_BV, best_2B = self._step(
            tokens_B1, positions_B1, self.cache.bind_leading(positions_B1, self._live_B[:rows])
        )
        # The next step's inputs if every row is greedy (the host overwrites them otherwise).
        # Clamped: a row past its end keeps writing inside its own, by then unused, slot.
        tokens_B1.copy_(best_2B[0, :, None].long())
        positions_B1.add_(1).clamp_(max=self.cache.max_len - 1)
        return logprobs_BV, best_2B

    @property
    def bucket(self) -> int:
        """The bucket (row count) of the last launched step."""
        return self._bucket

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` rows."""
        return next(size for size in self.sizes if size >= rows)

    def launch(
        self, tokens_R: list[int] | None = None, positions_R: list[int | None] | None = None
    ) -> DecodeStep:
        """A decode step of slots 0..len(tokens_R)-1 over the smallest bucket that holds them;
        a row whose position is None (a slot not decoding) and the bucket's rows past them run
        a dummy row that changes nothing lasting (module docstring). Without inputs: the last
        step's bucket on the inputs it left (greedy rows, see the class). Read
        ``logprobs_BV`` before the next launch."""
        if tokens_R is not None and positions_R is not None:
            rows = len(tokens_R)
            self._bucket = self.bucket_for(rows)
            pad = self._bucket - rows
            scratch = self.cache.max_len - 1
            positions = [scratch if p is None else p for p in positions_R] + [scratch] * pad
            live = [p is not None for p in positions_R] + [False] * pad
            values_3R = torch.tensor([tokens_R + [0] * pad, positions, live])
            self._tokens_B1[: self._bucket, 0].copy_(values_3R[0])  # host-to-device copies
            self._positions_B1[: self._bucket, 0].copy_(values_3R[1])
            self._live_B[: self._bucket].copy_(values_3R[2].bool())
        bucket = self._bucket
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            logprobs_BV, best_2B = self._outputs[bucket]
        else:
            with torch.no_grad():
                logprobs_BV, best_2B = self._forward(bucket)
        host = self._host[self._turn][: 2 * bucket].view(2, bucket)
        done = self._done[self._turn]
        self._turn ^= 1
        host.copy_(best_2B, non_blocking=True)
        if done is not None:
            done.record()
        return DecodeStep(logprobs_BV, host, done)
