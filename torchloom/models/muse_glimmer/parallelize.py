"""The Muse families' tensor-parallel plan (Glimmer and Spark): the shared decoder's
(components/decoder_plan.py) plus what Muse adds to a block, and its encoders split as MoonViT's
(components/vision_plan.py).

Decoder, under sequence parallelism. The attention (gated, sliding-window or NoPE, its q/k and
per-head output norms weightless) and the SwiGLU split by their own ``tp_plan``; a latent MoE
routes each rank's own tokens, its weights data-parallel over tp as every MoE layer's
(models/components/moe.py). The post-norms ("sandwich norms") are sequence-parallel norms on the
branch's output, and Spark's residual gates take the stream and the branch, both this rank's part
of the sequence, with their per-channel gate replicated: the gradient of either weight comes out
as each rank's tokens' share and is summed over tp, as the pre-norms' is. A weightless norm (the
embedding's, Spark's post-attention one) works row by row and needs nothing. The soft-cap is
pointwise on the logits, so they stay vocabulary-sharded for the loss-parallel cross-entropy.
The embedding stays whole so that the image and audio tokens are scattered into the full
sequence before ``residual_entry`` cuts it (``media_entry_plan``).

Encoders, on replicated activations. The ViT's q/k/v split column-wise by heads, o row-wise, its
MLPs and the adapter's first two layers column- then row-wise; the adapter's projection, and the
audio encoder's patch and output projections, column-wise with their output gathered, since an
RMSNorm over whole rows follows each; the audio blocks' MLPs column- then row-wise. The patch
embedding, the LayerNorms, RMSNorms and depthwise convolutions stay replicated
(``ReplicateParallel``), and so does the position table, a parameter of the encoder itself
(``ReplicateOwnParameters``).

Generation (``sequence_parallel=False``) keeps the residual stream replicated: the same heads,
hidden units and encoders split, the block's norms and gates plain on every rank.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from torchloom.models.components.audio import MuseAudioEncoder
from torchloom.models.components.decoder_plan import decoder_tp_plan
from torchloom.models.components.muse_vision import MuseVisionEncoder
from torchloom.models.components.vision_plan import (
    ReplicateParallel,
    check_divides,
    media_entry_plan,
    separate_qkv_blocks_plan,
)


class SequenceParallelJoin(SequenceParallel):
    """``SequenceParallel`` for a module joining several sequence-sharded inputs (a residual
    gate's stream and branch): parameters replicated, every tensor input this rank's part of the
    sequence."""

    @staticmethod
    def _prepare_input_fn(
        sequence_sharding: tuple[Shard], mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh
    ) -> tuple:
        return tuple(
            SequenceParallel._prepare_input_fn(sequence_sharding, mod, (x,), device_mesh)
            if isinstance(x, torch.Tensor) else x
            for x in inputs
        )  # fmt: skip


class ReplicateOwnParameters(ParallelStyle):
    """The module's own parameters (not its children's) as replicated DTensors, its forward left
    alone: it reads them as this rank's copy (the Muse ViT's position table)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for key, param in list(module.named_parameters(recurse=False)):
            whole = distribute_tensor(param.data, device_mesh, [Replicate()])
            module.register_parameter(key, nn.Parameter(whole, param.requires_grad))
        return module


def muse_tp_plan(
    model: nn.Module, tp: int, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """{module path: style} for a MuseGlimmer or MuseSpark (see the module docstring);
    ConfigError, in one line, unless ``tp`` divides every width it splits."""
    plan = decoder_tp_plan(model, tp, loss_parallel, sequence_parallel)
    if sequence_parallel:
        for name, block in model.layers.items():
            plan.update(_block_joins(block, f"layers.{name}."))
    encoders = (("vision_tower", muse_vision_tp_plan), ("audio_tower", muse_audio_tp_plan))
    for attribute, encoder_plan in encoders:
        encoder = getattr(model, attribute, None)
        if encoder is not None:
            for path, style in encoder_plan(encoder, tp).items():
                plan[attribute + ("." + path if path else "")] = style
    if sequence_parallel:
        plan.update(media_entry_plan(model))
    return plan


def _block_joins(block: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """The post-norms with a weight and the residual modules of a block (path ``prefix``):
    on the sequence-sharded stream, their outputs local as the stream is."""
    plan: dict[str, ParallelStyle] = {}
    for slot in ("attention", "mlp"):
        post_norm = getattr(block, f"{slot}_post_norm", None)
        if post_norm is not None and list(post_norm.parameters()):
            plan[f"{prefix}{slot}_post_norm"] = SequenceParallel(use_local_output=True)
        if getattr(block, f"{slot}_residual", None) is not None:
            plan[f"{prefix}{slot}_residual"] = SequenceParallelJoin(use_local_output=True)
    return plan


def muse_vision_tp_plan(encoder: MuseVisionEncoder, tp: int) -> dict[str, ParallelStyle]:
    """{path in the ViT ("" = the encoder): style}; ConfigError unless ``tp`` divides the
    widths it splits."""
    cfg = encoder.config
    check_divides(tp, (("vision.num_heads", cfg.num_heads), ("vision.ffn_dim", cfg.ffn_dim),
                        ("vision.adapter_dim", cfg.adapter_dim), ("the model's dim", cfg.text_dim)))  # fmt: skip
    plan: dict[str, ParallelStyle] = {"": ReplicateOwnParameters()}  # the position table
    for name in ("patch_embed", "norm_pre", "norm_post"):
        plan[name] = ReplicateParallel()
    plan.update(separate_qkv_blocks_plan(len(encoder.layers)))
    plan["adapter.fc1"] = ColwiseParallel()
    plan["adapter.fc2"] = RowwiseParallel()
    plan["adapter.projection"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def muse_audio_tp_plan(encoder: MuseAudioEncoder, tp: int) -> dict[str, ParallelStyle]:
    """{path in the audio encoder: style}; ConfigError unless ``tp`` divides the widths it
    splits."""
    cfg = encoder.config
    widths = [("the model's dim", cfg.text_dim)]
    for i, channels in enumerate(cfg.hidden_sizes):
        widths += [(f"audio.hidden_sizes[{i}]", channels),
                   (f"the audio stage {i} MLP width", int(channels * cfg.mlp_ratio))]  # fmt: skip
    check_divides(tp, tuple(widths))
    plan: dict[str, ParallelStyle] = {}
    for i, stage in enumerate(encoder.stages):
        prefix = f"stages.{i}."
        plan[prefix + "patch_proj"] = ColwiseParallel(output_layouts=Replicate())
        plan[prefix + "patch_norm"] = ReplicateParallel()
        for j in range(len(stage.blocks)):
            block = f"{prefix}blocks.{j}."
            plan[block + "conv"] = ReplicateParallel()
            plan[block + "norm"] = ReplicateParallel()
            plan[block + "mlp.fc1"] = ColwiseParallel()
            plan[block + "mlp.fc2"] = RowwiseParallel()
    plan["norm"] = ReplicateParallel()
    plan["proj"] = ColwiseParallel(output_layouts=Replicate())
    plan["proj_norm"] = ReplicateParallel()
    return plan
