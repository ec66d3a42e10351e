"""Decode steps replayed from CUDA graphs.

A decode step of a small batch is hundreds of tiny kernels, so on the GPU its time is mostly
launch overhead. ``DecodeGraphs`` captures the model's one-token forward once per row count
bucket (1, 2, 4, ... up to the cache's slots) over the leading slots of the KV cache
(``KVCache.bind_leading``: static shapes, no host synchronisation), and replays the smallest
bucket that covers the active slots. Rows of free slots inside a bucket compute on a dummy
token at position 0 of their own slot, which the next prefill of that slot overwrites.

Each graph also runs ``finish`` on the step's logits (the generator's log-softmax and argmax),
so a step costs one replay and one small host transfer. The graphs replay the same kernels an
eager step would launch, so the numbers are the same.
With ``compile`` the step is first compiled by inductor (batch size dynamic, so one compile
serves every bucket above 1), which fuses the hundreds of pointwise kernels; the graphs then
replay the compiled kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchloom.generate.cache import KVCache


def buckets(slots: int) -> list[int]:
    """Row counts a graph is captured for: powers of two below ``slots``, and ``slots``."""
    sizes, size = [], 1
    while size < slots:
        sizes.append(size)
        size *= 2
    return [*sizes, slots]


Finish = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


class DecodeGraphs:
    """One captured decode step per bucket; ``step`` fills the inputs, replays, and returns
    ``finish(logits)`` of the bucket's rows (row i = slot i)."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCache,
        finish: Finish,
        capture: bool = True,
        compile: bool = False,
    ) -> None:
        """``capture=False`` runs the same static-shape steps without graphs (any device)."""
        self.cache, self.finish = cache, finish
        # A compiled wrapper around the same module: the model itself is left as it is.
        self.model = torch.compile(model, dynamic=True) if compile else model
        device = cache.k[0].device
        self.sizes = buckets(cache.slots)
        self._tokens_B1 = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
        self._positions_B1 = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture(device)

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
        with torch.no_grad():
            for rows in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[rows] = self._forward(rows)
                self._graphs[rows] = graph
        # The captures wrote dummy keys at position 0 of every slot: nothing is cached yet.

    def _forward(self, rows: int) -> tuple[torch.Tensor, ...]:
        tokens_B1, positions_B1 = self._tokens_B1[:rows], self._positions_B1[:rows]
        logits_B1V = self.model(
            tokens_B1, positions_B1, cache=self.cache.bind_leading(positions_B1)
        )
        return self.finish(logits_B1V[:, 0])

    def step(self, tokens_R: list[int], positions_R: list[int]) -> tuple[torch.Tensor, ...]:
        """``finish(logits)`` of one decode step of slots 0..len(tokens_R)-1 (free slots among
        them get token 0 at position 0), over the bucket's rows (past len(tokens_R): padding).
        Replayed outputs are the graph's static tensors: read them before the next step."""
        rows = len(tokens_R)
        bucket = next(size for size in self.sizes if size >= rows)
        pad = bucket - rows
        values_2R = torch.tensor([tokens_R + [0] * pad, positions_R + [0] * pad])
        self._tokens_B1[:bucket, 0].copy_(values_2R[0])  # host-to-device copies
        self._positions_B1[:bucket, 0].copy_(values_2R[1])
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            return self._outputs[bucket]
        with torch.no_grad():
            return self._forward(bucket)
