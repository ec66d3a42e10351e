"""Pinned-memory staging for asynchronous saves: the training stall is only the time to
enqueue the device-to-host copies.

The first save allocates one pinned host buffer per tensor of the state; later saves reuse
them, so host memory stays at one copy of the state however many saves run. Copies run on a
side CUDA stream that first waits for the work already queued on the training stream, inside a
one-thread staging executor (so the first save's pinned allocation does not stall training
either). The stage future completes when the copies have landed; the trainer waits for it
(``CheckpointManager.wait_for_staging``) before the optimizer changes the parameters.

A small implementation of DCP's ``AsyncStager`` protocol instead of DCP's ``DefaultStager``:
the latter's deep copy of the state fails on torch 2.11 (``KeyError: <class 'type'>`` on the
second save of a run).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class PinnedStager(AsyncStager):
    """Copies a state dict of device tensors into reused pinned host buffers, off the
    training thread; ``stage`` returns a future of the host copy."""

    _synchronize_after_execute = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-staging")

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the state as of this call
        return self._executor.submit(self._stage, state_dict, ready)

    def _stage(self, state_dict: dict[str, Any], ready: torch.cuda.Event) -> dict[str, Any]:
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            staged = self._copy(state_dict, ())
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        return staged

    def _copy(self, value: Any, path: tuple) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(v, (*path, i)) for i, v in enumerate(value))
        if isinstance(value, DTensor):
            local = self._copy(value.to_local(), path)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            if value.device.type != "cuda":
                return value.clone()
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                self._buffers[path] = buffer
            # The state dict may hold temporaries the training thread frees meanwhile.
            value.record_stream(self._stream)
            buffer.copy_(value, non_blocking=True)
            return buffer
        return value

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._buffers.clear()
