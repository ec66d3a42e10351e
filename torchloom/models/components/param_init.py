"""Layout-invariant weight initialization: a parameter's values depend on the seed and on its
name in the single-process model, never on how it is sharded.

Every module initializes its own parameters through a ``ParamInit`` (``normal_``,
``trunc_normal_``, ``ones_``...). Random draws come in fixed blocks of a parameter's rows, each
block from its own generator seeded by (seed, parameter name, block index), so a rank holding a
shard draws only the blocks that cover it, and any layout (one process, FSDP, TP, PP, both)
gets bitwise the same weights. After a model's ``init_weights``, ``check_complete`` fails loudly
for a parameter nobody initialized (a new parameter kind would otherwise keep uninitialized
memory).

Values depend on the device type's generator (CPU and CUDA draw different numbers for a seed).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

_BLOCK_ELEMENTS = 1 << 20
"""Elements per random block (whole rows; at least one row): a function of the global shape."""

Draw = Callable[[torch.Tensor, torch.Generator], None]


class ParamInit:
    """Initializes the parameters of one model (or pipeline stage), each by its name."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.seed = seed
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.done: set[int] = set()

    # -- what modules call ------------------------------------------------------------------

    def normal_(self, param: torch.Tensor, std: float, mean: float = 0.0) -> None:
        self._fill_random(param, lambda block, g: block.normal_(mean, std, generator=g))

    def trunc_normal_(self, param: torch.Tensor, std: float, bound: float = 3.0) -> None:
        """Normal(0, std) truncated at +-``bound`` standard deviations."""
        self._fill_random(
            param,
            lambda block, g: nn.init.trunc_normal_(
                block, std=std, a=-bound * std, b=bound * std, generator=g
            ),
        )

    def uniform_(self, param: torch.Tensor, low: float, high: float) -> None:
        self._fill_random(param, lambda block, g: block.uniform_(low, high, generator=g))

    def constant_(self, param: torch.Tensor, value: float) -> None:
        local_tensor(param).fill_(value)
        self._mark(param)

    def ones_(self, param: torch.Tensor) -> None:
        self.constant_(param, 1.0)

    def zeros_(self, param: torch.Tensor) -> None:
        self.constant_(param, 0.0)

    def copy_(self, param: torch.Tensor, value: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        """A deterministic value (e.g. a range), given as a function of the global shape."""
        full = value(tuple(param.shape))
        local_tensor(param).copy_(full[local_box(param)])
        self._mark(param)

    # -- checks -----------------------------------------------------------------------------

    def check_complete(self, model: nn.Module) -> None:
        """Raise naming every parameter of ``model`` that no module initialized."""
        missing = [name for name, p in model.named_parameters() if id(p) not in self.done]
        if missing:
            raise RuntimeError(
                f"init_weights left {len(missing)} parameter(s) uninitialized: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. The module that "
                "owns each must initialize it in its init_weights (see models/components/"
                "param_init.py)."
            )

    # -- internals --------------------------------------------------------------------------

    def _mark(self, param: torch.Tensor) -> None:
        if id(param) not in self.names:
            raise KeyError("ParamInit was given a tensor that is not a parameter of its model")
        self.done.add(id(param))

    def _fill_random(self, param: torch.Tensor, draw: Draw) -> None:
        self._mark(param)
        local = local_tensor(param)
        if local.device.type == "meta":
            return
        shape = tuple(param.shape)  # global
        data = param.data if isinstance(param, nn.Parameter) else param
        strided = isinstance(data, DTensor) and any(
            isinstance(p, _StridedShard) for p in data.placements
        )
        # A strided split (a fused qkv's, vision_plan.FusedColwiseParallel) holds no box of the
        # whole: draw all of it, then keep this rank's part.
        target = torch.empty(shape, device=local.device) if strided else local
        box = tuple(slice(0, n) for n in shape) if strided else local_box(param)
        rows = shape[0] if shape else 1
        width = math.prod(shape[1:])
        block_rows = max(1, _BLOCK_ELEMENTS // max(width, 1))
        first, last = (box[0].start, box[0].stop) if shape else (0, 1)
        name = self.names[id(param)]
        for block in range(first // block_rows, -(-last // block_rows)):
            start, stop = block * block_rows, min(rows, (block + 1) * block_rows)
            generator = torch.Generator(local.device).manual_seed(self._block_seed(name, block))
            values = torch.empty((stop - start, *shape[1:]), device=local.device)
            draw(values, generator)
            if not shape:
                target.copy_(values.reshape(()))
                continue
            lo, hi = max(start, first), min(stop, last)  # the rows this rank holds
            rest = box[1:]
            target[lo - first : hi - first].copy_(values[(slice(lo - start, hi - start), *rest)])
        if strided:
            mine = distribute_tensor(target, data.device_mesh, data.placements, src_data_rank=None)
            local.copy_(mine.to_local())

    def _block_seed(self, name: str, block: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}/{name}/{block}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``param`` (a DTensor's local shard, else itself)."""
    data = param.data if isinstance(param, nn.Parameter) else param
    return data.to_local() if isinstance(data, DTensor) else data


def replicated_local(param: torch.Tensor) -> torch.Tensor:
    """``param`` for a forward that mixes it with plain tensors: under tensor parallelism a
    replicated DTensor's local copy (differentiable; its gradient comes back replicated), else
    ``param`` itself. For a table indexed by positions computed on the host side of a module
    (the ViTs' position embeddings)."""
    return param.to_local() if isinstance(param, DTensor) else param


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's shard of ``param`` sits in the global tensor, one slice per dim (the
    whole tensor when it is not a DTensor)."""
    data = param.data if isinstance(param, nn.Parameter) else param
    if not isinstance(data, DTensor):
        return tuple(slice(0, n) for n in data.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        data.shape, data.device_mesh, data.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
