"""The partitioner pass behind ``--remat.weight_casts recompute``, in a module of its own:
inductor's pass base class costs about 1.5 s to import, paid only by runs that use it."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

aten, prims = torch.ops.aten, torch.ops.prims
_CASTS = (prims.convert_element_type.default, aten._to_copy.default)
_MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
_RESHAPES = (aten._unsafe_view.default, aten.reshape.default, aten.clone.default)


class RecomputeInputCasts(CustomGraphPass):
    """Inductor joint-graph pass (``--remat.weight_casts recompute``): each cast of a graph
    input to a narrower float dtype that feeds a matmul is marked for recomputation, so the
    partitioner hands the backward the input itself instead of the cast's output. In a
    compiled block under autocast those inputs are the fp32 weights: keeping a parameter for
    the backward costs nothing (it lives anyway), its bf16 copy 2 bytes per element from the
    block's forward to its backward. Other inputs cast (RoPE's tables, cast for a multiply)
    keep their narrow copies; a block input cast for a matmul would be kept at its own width
    (blocks normalise their input before any matmul, so none is)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.find_nodes(op="placeholder"):
            source = node.meta.get("val")
            if node.name.startswith("tangents") or not _is_float(source):
                continue
            for user in node.users:
                target = user.meta.get("val")
                if (
                    user.target in _CASTS
                    and _is_float(target)
                    and target.element_size() < source.element_size()
                    and _feeds_matmul(user)
                ):
                    user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self) -> str:  # part of inductor's cache key
        return "torchloom.weight_casts.RecomputeInputCasts/2"


def _is_float(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _feeds_matmul(node: torch.fx.Node, hops: int = 4) -> bool:
    """Whether ``node`` reaches a matmul directly or through views and reshapes."""
    for user in node.users:
        if user.target in _MATMULS:
            return True
        reshapes = user.target in _RESHAPES or getattr(user.target, "is_view", False)
        if reshapes and hops > 0 and _feeds_matmul(user, hops - 1):
            return True
    return False
