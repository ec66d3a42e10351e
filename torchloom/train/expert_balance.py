"""Expert balancing after each optimizer step: the tokens every MoE layer sent to each expert,
summed over the step's micro-batches and data ranks, move the layers' choice bias
(auxiliary-loss-free balancing, models/components/moe.py) and are logged per layer as
``expert_load/<layer>/min``, ``/max`` (tokens per expert over the global batch) and ``/cv``
(their coefficient of variation, std / mean; 0 is perfectly balanced).

Every rank counts distinct tokens: the data ranks their rows, the cp and tp (sequence
parallel) ranks their parts of the sequences, and under pipeline parallelism each stage fills
the rows of its own layers only. So one sum over all ranks counts each token once and gives
every rank every layer's load. Expert parallelism changes nothing here: a token is counted
where it is routed, before it travels.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from torchloom.models import DecoderConfig
from torchloom.models.components.decoder import MOE_FFNS
from torchloom.parallel import ParallelDims

# A decoder layer's path: "layers.N." in the model, "S.layers.N." in pipeline stage S.
_LAYER = re.compile(r"(?:\d+\.)?layers\.(\d+)\.")


class ExpertBalance:
    """``balance() -> {metric: 0-d tensor}`` for the MoE layers of ``model`` (a model or a
    ModuleList of pipeline stages); a no-op returning {} for a model without them."""

    def __init__(
        self,
        model: nn.Module,
        moe_layers: list[int],
        num_experts: int,
        dims: ParallelDims,
        device: torch.device,
    ) -> None:
        self.dims, self.num_experts, self.device = dims, num_experts, device
        self.rows = {layer: row for row, layer in enumerate(moe_layers)}
        self.held: dict[int, nn.Module] = {}
        for name, module in model.named_modules():
            match = _LAYER.match(name + ".") if hasattr(module, "take_load") else None
            # The decoder's MoE layers only: a module elsewhere (multi-token prediction's
            # "mtp.layers.N.", DeepSeek-V4's numbered from 0) keeps its bias as loaded.
            if match and int(match.group(1)) in self.rows:
                self.held[int(match.group(1))] = module

    def __call__(self) -> dict[str, torch.Tensor]:
        if not self.rows:
            return {}
        loads_LE = torch.zeros(len(self.rows), self.num_experts, device=self.device)
        for layer, module in self.held.items():
            loads_LE[self.rows[layer]] = module.take_load()
        if dist.is_initialized() and self.dims.world_size > 1:
            dist.all_reduce(loads_LE)
        for layer, module in self.held.items():
            module.update_bias(loads_LE[self.rows[layer]])
        mean_L = loads_LE.mean(1)
        cv_L = loads_LE.std(1, correction=0) / mean_L.clamp_min(1e-9)
        stats_L3 = torch.stack([loads_LE.min(1).values, loads_LE.max(1).values, cv_L], dim=1)
        metrics = {}
        for layer, row in self.rows.items():
            for column, what in enumerate(("min", "max", "cv")):
                metrics[f"expert_load/{layer}/{what}"] = stats_L3[row, column]
        return metrics


def expert_balance(
    model: nn.Module, config: DecoderConfig, dims: ParallelDims, device: torch.device
) -> ExpertBalance | None:
    """The balancing of ``config``'s MoE layers as ``model`` holds them; None without any."""
    moe_layers = [i for i, spec in enumerate(config.layer_specs()) if spec.ffn in MOE_FFNS]
    if not moe_layers:
        return None
    return ExpertBalance(model, moe_layers, config.moe.num_experts, dims, device)
