"""Tensor-parallel plan of the vision encoder (``VisionEncoder``) and of a decoder with one in
front (``MultimodalDecoder``).

The encoder runs on replicated activations: every tp rank holds every patch. Each block's
attention is split by heads (the fused qkv column-wise, proj row-wise) and its MLP by hidden
units (fc1 column-wise, fc2 row-wise); the mergers' MLPs likewise. So a block costs two
all-reduces, as a Megatron block without sequence parallelism does. The patch embedding, the
position table and the LayerNorms are small and stay replicated: their gradients are equal on
every rank, since so are their inputs and output gradients.

The fused qkv's output is q, k and v side by side, each all heads wide: a plain column split
would give rank 0 all of q and part of k. Its weight is split as ``_StridedShard(0, 3)``
instead (each rank takes its share of each of the three blocks), so a rank's local output is
its own heads' q, k and v in order, which the attention views with -1 heads.

Kimi K2.5's MoonViT (``moonvit_tp_plan``) splits the same way with separate q/k/v projections
(each column-wise) and a projector whose in_proj is split column-wise and out_proj row-wise.

The decoder then scatters the image tokens into the embedding over the full sequence: under
sequence parallelism the embedding's output is all-reduced (not reduce-scattered), and the
model's ``residual_entry`` cuts it, and each DeepStack addition, along the sequence before the
first block (``media_entry_plan``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.components.moonvit import MoonViT
from torchloom.models.components.multimodal import MediaEmbedding, MultimodalDecoder
from torchloom.models.components.vision import VisionEncoder


class FusedColwiseParallel(ParallelStyle):
    """Column-wise split of a linear whose output is ``parts`` equal blocks side by side: each
    rank holds its share of every block of the weight (the bias whole). Replicated local input,
    local output."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.placement = _StridedShard(0, split_factor=parts)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(module.named_parameters(recurse=False)):
                # The bias stays whole (DTensor slices it to the output's split): FSDP's split
                # of a strided vector would nest two strided splits, which gather permuted.
                placement = self.placement if param.ndim == 2 else Replicate()
                split = distribute_tensor(param, mesh, [placement])
                module.register_parameter(key, nn.Parameter(split))

        return distribute_module(module, device_mesh, partition, _replicated_input, _local_output)


class ReplicateParallel(ParallelStyle):
    """A module whose parameters stay whole on every rank (Replicate DTensors, so optimizers and
    clipping see one kind of parameter), run on replicated local tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _replicated_input, _local_output)


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """Tensor inputs as replicated DTensors; others (MoonViT's patch layout) as they are."""
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) else x
        for x in inputs
    )  # fmt: skip


def _local_output(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


def check_vision_tp(encoder: VisionEncoder, tp: int) -> None:
    """ConfigError unless ``tp`` divides the encoder's heads and hidden widths."""
    cfg = encoder.cfg
    joined = encoder.merger.joined_dim
    check_divides(tp, (("vision.num_heads", cfg.num_heads), ("vision.ffn_dim", cfg.ffn_dim),
                        ("the merger width (vision.dim x spatial_merge_size^2)", joined)))  # fmt: skip


def check_divides(tp: int, widths: tuple[tuple[str, int], ...]) -> None:
    """ConfigError, naming the first, unless ``tp`` divides every (name, width) of ``widths``."""
    for name, value in widths:
        if value % tp:
            raise ConfigError(
                f"--parallel.tp {tp} does not divide {name} ({value}); choose a tp that does."
            )


def vision_tp_plan(encoder: VisionEncoder) -> dict[str, ParallelStyle]:
    """{path in the encoder: style} (see the module docstring)."""
    plan: dict[str, ParallelStyle] = {
        "patch_embed": ReplicateParallel(),
        "pos_embed": ReplicateParallel(),
    }
    for i in range(len(encoder.blocks)):
        prefix = f"blocks.{i}."
        plan[prefix + "norm1"] = ReplicateParallel()
        plan[prefix + "attn.qkv"] = FusedColwiseParallel(3)
        plan[prefix + "attn.proj"] = RowwiseParallel()
        plan[prefix + "norm2"] = ReplicateParallel()
        plan[prefix + "mlp.linear_fc1"] = ColwiseParallel()
        plan[prefix + "mlp.linear_fc2"] = RowwiseParallel()
    mergers = ["merger"] + [f"deepstack_merger_list.{i}" for i in range(len(encoder.deepstack_merger_list))]  # fmt: skip
    for name in mergers:
        plan[name + ".norm"] = ReplicateParallel()
        plan[name + ".linear_fc1"] = ColwiseParallel()
        plan[name + ".linear_fc2"] = RowwiseParallel()
    return plan


def moonvit_tp_plan(encoder: MoonViT, tp: int) -> dict[str, ParallelStyle]:
    """{path in MoonViT: style}: heads and hidden units split, the rest replicated (see the
    module docstring). ConfigError unless ``tp`` divides the widths it splits."""
    cfg = encoder.config
    check_divides(tp, (("vision.num_heads", cfg.num_heads), ("vision.ffn_dim", cfg.ffn_dim),
                        ("the projector width (vision.dim x merge^2)", cfg.dim * cfg.merge**2)))  # fmt: skip
    plan: dict[str, ParallelStyle] = {
        name: ReplicateParallel() for name in ("patch_embed", "pos_embed", "norm", "projector.norm")
    }
    plan.update(separate_qkv_blocks_plan(len(encoder.layers)))
    plan["projector.in_proj"] = ColwiseParallel()
    plan["projector.out_proj"] = RowwiseParallel()
    return plan


def separate_qkv_blocks_plan(num_layers: int) -> dict[str, ParallelStyle]:
    """The blocks ``layers.i`` of a ViT with separate q/k/v projections (MoonViT's, Muse's):
    q/k/v column-wise and o_proj row-wise under ``attention``, ``mlp.fc1`` column- and
    ``mlp.fc2`` row-wise, the two LayerNorms replicated."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(num_layers):
        prefix = f"layers.{i}."
        plan[prefix + "attention_norm"] = ReplicateParallel()
        plan[prefix + "mlp_norm"] = ReplicateParallel()
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[prefix + "attention." + name] = ColwiseParallel()
        plan[prefix + "attention.o_proj"] = RowwiseParallel()
        plan[prefix + "mlp.fc1"] = ColwiseParallel()
        plan[prefix + "mlp.fc2"] = RowwiseParallel()
    return plan


def media_entry_plan(model: MediaEmbedding) -> dict[str, ParallelStyle]:
    """Under sequence parallelism, a media-reading model's embedding whole on every rank (the
    media tokens are scattered into the full sequence) and cut along the sequence where it
    enters the residual stream (``residual_entry``); nothing for a stage without the embedding."""
    if model.embed_tokens is None:
        return {}
    replicated = Replicate()
    return {
        "embed_tokens": RowwiseParallel(input_layouts=replicated, output_layouts=replicated),
        "residual_entry": PrepareModuleInput(
            input_layouts=(replicated,), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
    }


def multimodal_tp_plan(
    model: MultimodalDecoder, tp: int, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """``decoder_tp_plan`` with the vision encoder's plan under ``visual.`` and, under sequence
    parallelism, the image-token scatter on the full sequence (see the module docstring)."""
    plan = decoder_tp_plan(model, tp, loss_parallel, sequence_parallel)
    if model.visual is not None:
        check_vision_tp(model.visual, tp)
        plan.update({"visual." + path: s for path, s in vision_tp_plan(model.visual).items()})
    if sequence_parallel:
        plan.update(media_entry_plan(model))
    return plan
