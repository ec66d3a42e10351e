"""Linears that read one input, run as one matmul (generation's decode steps).

At one token a step, a small weight streams far below the GPU's bandwidth: on an H200 the 1B
shape's k and v (2 MB each) ran at 0.37 TB/s from a CUDA graph, q/k/v stacked at 2.1 TB/s
(benchmarks/RESULTS.md, issue 35). ``fuse_linears`` stacks the weights by rows into one tensor
and makes each linear's weight a view of it, so nothing is stored twice and every in-place write
to a parameter (``Generator.update_weights``, an optimizer step) lands in the stacked weight.
The modules that can (Attention: q/k/v and gate_proj; SwiGLU: gate/up) have
``fuse_projections()``; ``fuse_projections_(model)`` calls it on all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.kernels import batch_invariant


def fuse_linears(linears: Sequence[nn.Linear], invariant: bool = False) -> torch.Tensor | None:
    """The linears' weights stacked by rows (output features) into one new tensor, each linear's
    weight now a view of its rows (the same Parameter objects). None, changing nothing, unless
    every one is an ``nn.Linear`` without bias whose weight is a plain (not sharded) tensor
    sharing one device and dtype, and there are at least two. ``invariant``: the linears run
    batch-invariant mode's matmul; then only where stacking changes no bit of their outputs
    (``batch_invariant.stacking_keeps_bits``), so the generator still matches the trainer."""
    weights = [linear.weight for linear in linears]
    plain = all(type(linear) is nn.Linear and linear.bias is None for linear in linears)
    if len(linears) < 2 or not plain or any(isinstance(w, DTensor) for w in weights):
        return None
    if len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1:
        return None
    if invariant and not batch_invariant.stacking_keeps_bits(weights[0]):
        return None
    with torch.no_grad():
        stacked = torch.cat([w.detach() for w in weights])
    row = 0
    for weight in weights:
        rows = weight.shape[0]
        weight.data = stacked[row : row + rows]  # same Parameter, storage now the stacked one
        row += rows
    return stacked


def fuse_projections_(model: nn.Module) -> int:
    """``fuse_projections()`` on every module of ``model`` that has it; how many fused. For a
    model that only generates: afterwards moving or re-allocating a parameter (``.to()``,
    ``load_state_dict(assign=True)``) would split it from the stacked weight."""
    fused = 0
    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None and fuse():
            fused += 1
    return fused
