"""DeepSeek-V3's tensor-parallel plan: the shared decoder's (components/decoder_plan.py), whose
MLA layers split by heads (models/components/mla.py), plus the multi-token-prediction depths.

An MTP depth runs on the sequence-parallel residual stream as a layer does: its enorm, hnorm
and final norm are sequence-parallel norms, ``eh_proj`` keeps a replicated weight applied to
each rank's share of the sequence (its gradient summed over tp, as a norm's is), and its
decoder block takes the block plan of the layer kinds it was built with. The depth's logits go
through the model's (vocabulary-split) head, so its loss is a loss-parallel cross-entropy.
Generation never runs the MTP depths, so the replicated-stream plan leaves them alone.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from torchloom.models.components.decoder_plan import block_tp_plan, decoder_tp_plan
from torchloom.models.deepseek_v3.model import DeepSeekV3


def tp_plan(
    model: DeepSeekV3, tp: int, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """``decoder_tp_plan``, with the MTP depths' modules when training (sequence parallel)."""
    plan = decoder_tp_plan(model, tp, loss_parallel, sequence_parallel)
    mtp = getattr(model, "mtp", None)
    if mtp is None or not sequence_parallel:
        return plan
    for name, depth in mtp.layers.items():
        prefix = f"mtp.layers.{name}."
        for part in ("enorm", "hnorm", "eh_proj"):  # the residual stream stays local tensors
            plan[prefix + part] = SequenceParallel(use_local_output=True)
        plan[prefix + "norm"] = SequenceParallel()  # into the head, as the final norm
        block = depth.block
        for module in (block.attention, block.mlp):
            module.check_tp(tp)
        plan.update(block_tp_plan(block, prefix + "block."))
    return plan
