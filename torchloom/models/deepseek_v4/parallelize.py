"""DeepSeek-V4's tensor-parallel plan: the shared decoder's (components/decoder_plan.py), whose
attention layers split by heads (``CompressedSparseAttention.tp_plan``), plus the residual
streams' hyper-connections and the MoE's token ids.

Attention: q_b_proj column-wise, the sinks by head, o_a_proj by head group and o_b_proj
row-wise, so tp must divide num_heads and o_groups. The one key = value head (multi-query
attention), its compressor and the low-rank query latent are replicated: each rank computes
them whole and attends with its own heads. CSA's indexer is replicated too (weights and
inputs), so its top-k picks are the same on every rank without any communication; the
target of its optional loss (the attention summed over heads) adds up the ranks' heads.

Sequence parallel (training): the [B, T, N, D] streams are split along T like any residual
stream. A hyper-connection mixes each token's N streams on its own, so it runs on each rank's
tokens with replicated weights (their gradients summed over tp, as a norm's); the attention
gathers its input and scatters o_b_proj's output back; the MoE routes each rank's tokens (its
hash layers read the same share of the token ids) and is data-parallel over tp as in the other
families (components/moe.py); hc_head and the final norm run on each rank's tokens.
Generation (``sequence_parallel=False``) keeps the streams replicated: heads split as in
training, everything else computed whole on every rank.

An MTP depth runs on the sequence-parallel streams as a layer does: its enorm, hnorm, e_proj
and h_proj keep replicated weights applied to each rank's tokens (gradients summed over tp),
its block takes a layer's plan, its hc_head and norm feed the (vocabulary-split) head as the
model's do. Generation never runs the MTP depths, so the replicated-stream plan leaves them
alone.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    SequenceParallel,
)

from torchloom.models.components.decoder_plan import block_tp_plan, decoder_tp_plan
from torchloom.models.deepseek_v4.model import DeepSeekV4


class _SequenceParallelMixing(ParallelStyle):
    """A hyper-connection on each rank's share of the sequence: replicated weights (gradients
    summed over tp), the streams in and its three outputs out as local tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        SequenceParallel(use_local_output=False)._apply(module, device_mesh)
        sharded = (Shard(1),) * 3  # post_BTN, comb_BTNN, x_BTD
        local = PrepareModuleOutput(
            output_layouts=sharded, desired_output_layouts=sharded, use_local_output=True
        )
        return local._apply(module, device_mesh)


def tp_plan(
    model: DeepSeekV4, tp: int, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """``decoder_tp_plan`` (attention by heads), with the hyper-connections, hc_head and the
    MoE's token ids split along the sequence when training (sequence parallel), and the MTP
    depths' modules."""
    plan = decoder_tp_plan(model, tp, loss_parallel, sequence_parallel)
    if not sequence_parallel:
        return plan  # the streams and hyper-connections stay replicated
    for name in model.layers:
        plan.update(_streams_plan(f"layers.{name}."))
    plan["hc_head"] = SequenceParallel(use_local_output=True)
    depths = {} if model.mtp is None else model.mtp.layers
    for name, depth in depths.items():
        prefix = f"mtp.layers.{name}."
        for part in ("enorm", "hnorm", "e_proj", "h_proj"):  # the streams stay local tensors
            plan[prefix + part] = SequenceParallel(use_local_output=True)
        block = depth.block
        for module in (block.attention, block.mlp):
            module.check_tp(tp)
        plan.update(block_tp_plan(block, prefix + "block."))
        plan.update(_streams_plan(prefix + "block."))
        plan[prefix + "hc_head"] = SequenceParallel(use_local_output=True)
        plan[prefix + "norm"] = SequenceParallel()  # into the head, as the final norm
    return plan


def _streams_plan(prefix: str) -> dict[str, ParallelStyle]:
    """A block's hyper-connections on each rank's tokens, and its MoE's token ids split as
    its input (x_BTD, tokens_BT), under ``prefix`` (the block's path, with a trailing dot)."""
    tokens = PrepareModuleInput(
        input_layouts=(Shard(1), Replicate()),
        desired_input_layouts=(Shard(1), Shard(1)),
        use_local_output=True,
    )
    return {
        prefix + "attention_hc": _SequenceParallelMixing(),
        prefix + "mlp_hc": _SequenceParallelMixing(),
        prefix + "mlp": tokens,
    }
