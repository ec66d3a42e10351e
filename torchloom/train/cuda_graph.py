"""The whole training step (forward, backward, gradient clipping, AdamW) as one CUDA graph.

A CUDA graph records the step's kernels once and replays them with a single launch, so the host
no longer issues thousands of small kernels per step. Replay reruns the recorded kernels on the
same memory, so everything the step reads or writes must stay at fixed addresses: the batch is
copied into static input buffers, the learning rate lives in a device tensor that is refilled
before each replay, gradients are allocated once (by the captured backward, in the graph's
memory pool), and the parameters and AdamW's moments never move. The step may not synchronize
with the host either, which is why non-finite losses are checked after the replay and
``--training.skip_nonfinite`` is refused.

The captured kernels are the eager step's kernels: warm-up steps and replays run the same
forward, backward, gradient clipping and AdamW (fused or Triton), so losses are bitwise those of
an uncaptured run (the learning rate is a float32 either way, see ``build_lr_scheduler``).
Compiled regions are compiled during the warm-up steps and captured like any other kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from torchloom.config.errors import ConfigError
from torchloom.data.packing import Batch
from torchloom.models.components.moe import experts_reading_the_host

StepFn = Callable[[Sequence[Batch], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def check_cuda_graph_runtime(
    device: torch.device, world_size: int, model: nn.Module, compute_dtype: torch.dtype
) -> None:
    """ConfigError unless the resolved device, launch and model can capture a step."""
    if device.type != "cuda":
        raise ConfigError(
            f"--training.cuda_graph true needs a CUDA GPU, but training runs on {device.type}; "
            "drop --training.cuda_graph."
        )
    if world_size > 1:
        raise ConfigError(
            f"--training.cuda_graph true captures a single-GPU step, but {world_size} processes "
            "were launched; launch one process or drop --training.cuda_graph."
        )
    if (found := experts_reading_the_host(model, compute_dtype)) is not None:
        raise ConfigError(
            f"--training.cuda_graph true cannot capture this model's step: its experts "
            f"({found[0]}) run as a loop in {compute_dtype} on this GPU, which reads each "
            "expert's row count on the host. Grouped matmuls need bf16 on a Hopper or newer "
            "GPU (--training.mixed_precision bf16 or auto); otherwise drop "
            "--training.cuda_graph."
        )


class StepGraph:
    """Runs ``step_fn(batches, num_tokens) -> (loss_sum, grad_norm)``: eagerly for the first
    ``warmup_steps`` calls, then captured once and replayed on every later call.

    ``step_fn`` does the whole step, optimizer included, and must not sync with the host; the
    batches of every call must have the shapes (and the doc_ids or not) of the captured ones.
    """

    def __init__(self, step_fn: StepFn, optimizer: torch.optim.Optimizer, warmup_steps: int = 3):
        self.step_fn = step_fn
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.side_stream = torch.cuda.Stream()
        self.static_batches: list[Batch] = []
        self.static_num_tokens: torch.Tensor | None = None
        self.static_lrs: list[torch.Tensor] = []
        self.static_outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self, batches: Sequence[Batch], num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None and self.eager_steps < self.warmup_steps:
            self.eager_steps += 1
            return self._eager(batches, num_tokens)
        if self.graph is None:
            self._capture(batches, num_tokens)
        self._copy_in(batches, num_tokens)
        for group, lr in zip(self.optimizer.param_groups, self.static_lrs, strict=True):
            lr.fill_(group["lr"])  # the scheduler's rate for this step
        self.graph.replay()
        loss_sum, grad_norm = self.static_outputs
        return loss_sum.clone(), grad_norm.clone()

    def _eager(
        self, batches: Sequence[Batch], num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Warm-up runs on a side stream, as capture requires: lazily created state (cuBLAS
        # handles and workspaces, compiled kernels, AdamW's moments) must exist before capture.
        # The optimizer runs as it will in the graph (rate from a tensor, capturable), so every
        # kernel the capture launches was compiled and loaded here: a Triton kernel first
        # specialized inside the capture (the Triton AdamW's rate-on-device variant) would load
        # a module there, which invalidates the capture.
        self.side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side_stream), self._as_captured(num_tokens.device):
            outputs = self.step_fn(batches, num_tokens)
            self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(self.side_stream)
        return outputs

    def _capture(self, batches: Sequence[Batch], num_tokens: torch.Tensor) -> None:
        self.static_batches = [batch.clone() for batch in batches]
        self.static_num_tokens = num_tokens.clone()
        # Grads set to None, so the captured backward allocates them from the graph's pool and
        # every replay writes the same tensors.
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with self._as_captured(num_tokens.device), torch.cuda.graph(graph):
            self.static_outputs = self.step_fn(self.static_batches, self.static_num_tokens)
        self.graph = graph

    @contextlib.contextmanager
    def _as_captured(self, device: torch.device) -> Iterator[None]:
        """The optimizer's groups read their rates from ``static_lrs`` (a float would be frozen
        into the graph; filled with this step's rates) with capturable=True, as a captured
        step needs; the fused and Triton AdamW compute the same either way. Put back
        afterwards, so the scheduler, checkpoints and an eager resume see the usual groups."""
        groups = self.optimizer.param_groups
        if not self.static_lrs:
            self.static_lrs = [torch.zeros((), dtype=torch.float32, device=device) for _ in groups]
        saved = [(g["lr"], g["capturable"]) for g in groups]
        for group, lr in zip(groups, self.static_lrs, strict=True):
            lr.fill_(group["lr"])
            group["lr"], group["capturable"] = lr, True
        try:
            yield
        finally:
            for group, (lr, capturable) in zip(groups, saved, strict=True):
                group["lr"], group["capturable"] = lr, capturable

    def _copy_in(self, batches: Sequence[Batch], num_tokens: torch.Tensor) -> None:
        if len(batches) != len(self.static_batches):
            raise RuntimeError(
                f"a CUDA-graph step was captured for {len(self.static_batches)} micro-batches, "
                f"got {len(batches)}"
            )
        for static, batch in zip(self.static_batches, batches, strict=True):
            targets, sources = static.named_tensors(), batch.named_tensors()
            for name in targets.keys() | sources.keys():
                target, source = targets.get(name), sources.get(name)
                if (target is None) != (source is None) or (
                    target is not None and target.shape != source.shape
                ):
                    raise RuntimeError(
                        f"a CUDA-graph step needs batches of one layout; {name} changed from "
                        f"{_shape(target)} to {_shape(source)}"
                    )
                if target is not None:
                    target.copy_(source, non_blocking=True)
        self.static_num_tokens.copy_(num_tokens, non_blocking=True)


def _shape(tensor: torch.Tensor | None) -> str:
    return "None" if tensor is None else str(tuple(tensor.shape))
