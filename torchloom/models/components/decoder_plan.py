"""Tensor- and sequence-parallel plan of the generic decoder (``Decoder``): the decoder's own
parts (embedding, block norms, final norm, head) here, each block's mixer and feed-forward from
the module itself (``tp_plan(sequence_parallel)``, ``check_tp(tp)``), so a new layer kind
brings its own split.

Megatron-style: in every block q/k/v and gate/up are split column-wise (by heads, by hidden
units) and o/down row-wise, so each block needs one all-gather before attention and before the
MLP and one reduce-scatter after each. Between those, the residual stream stays split along the
sequence (sequence parallel): norms and residual adds run on T / tp tokens per rank.

Inside attention the local q/k/v simply hold fewer heads (the model views them with -1 heads),
so GQA works as long as tp divides both head counts; RoPE cos/sin and doc_ids are computed from
the full, replicated positions and pass through untouched. Qwen3's q/k norms run per head on
the local heads with a replicated weight whose gradient is summed over tp.

Generation uses the same split without sequence parallelism (``sequence_parallel=False``): a
decode step has one token per sequence, which cannot be split over ranks, so the residual
stream stays replicated and o/down all-reduce instead of reduce-scattering.

The model declares this plan; ``torchloom.parallel.tensor_parallel`` applies it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from torchloom.config.errors import ConfigError
from torchloom.models.components.decoder import Decoder


class _SequenceParallelToReplicated(ParallelStyle):
    """A sequence-parallel norm whose output is gathered into a replicated DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        SequenceParallel(use_local_output=False)._apply(module, device_mesh)
        gather = PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False
        )
        return gather._apply(module, device_mesh)


def check_tp_degree(model: Decoder, tp: int) -> None:
    """Raise ConfigError when the architecture cannot be split ``tp`` ways."""
    for block in model.layers.values():
        for module in (block.attention, block.mlp):
            check = getattr(module, "check_tp", None)
            if check is None:
                raise ConfigError(
                    f"{type(module).__name__} layers declare no tensor-parallel split; set "
                    "--parallel.tp 1."
                )
            check(tp)
    vocab = model.config.vocab_size
    if vocab % tp:
        raise ConfigError(
            f"--parallel.tp {tp} does not divide the model's vocab_size ({vocab}): every "
            "tensor-parallel rank must hold a whole share of it. Choose a tp that divides it."
        )


def decoder_tp_plan(
    model: Decoder, tp: int, loss_parallel: bool = True, sequence_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """{module path: style} for ``model`` as built now (a pipeline stage may lack layers, the
    embedding or the head). ``""`` names the model itself. With ``loss_parallel`` the logits
    come out as a DTensor sharded over the vocabulary (compute the loss under
    ``torch.distributed.tensor.parallel.loss_parallel()``); otherwise as a full local tensor.
    ``sequence_parallel=False``: the replicated-stream plan generation uses (full logits).
    """
    check_tp_degree(model, tp)
    if not sequence_parallel:
        return _replicated_stream_plan(model)
    seq_sharded, replicated = Shard(1), Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        # Vocabulary rows split over ranks; the partial lookups are reduce-scattered by sequence.
        plan["embed_tokens"] = RowwiseParallel(input_layouts=replicated, output_layouts=Shard(1))
    for name, block in model.layers.items():
        plan.update(block_tp_plan(block, f"layers.{name}."))
    vocab_sharded = Shard(-1)
    if model.output is not None:
        if model.norm is not None:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=seq_sharded,
            output_layouts=vocab_sharded if loss_parallel else replicated,
            use_local_output=not loss_parallel,
        )
    elif model.config.tie_embeddings and model.embed_tokens is not None:
        # The head is F.linear(h, embed_tokens.weight) in the root's forward, with the weight
        # split by vocabulary rows. Feeding it the full hidden state as a replicated DTensor
        # makes that matmul produce vocabulary-sharded logits with no further communication.
        if model.norm is not None:
            plan["norm"] = _SequenceParallelToReplicated()
        # Without loss_parallel the logits must be whole rows: Decoder.logits gathers them
        # (the objective computes them inside the model's forward, past any output hook).
        model.gather_tied_logits = not loss_parallel
    return plan


def block_tp_plan(block: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """A decoder block's sequence-parallel plan (its norms, its mixer's and feed-forward's
    own plans) under ``prefix``, the block's path in the model with a trailing dot."""
    plan: dict[str, ParallelStyle] = {prefix + "attention_norm": SequenceParallel()}
    plan.update(_prefixed(prefix + "attention", block.attention.tp_plan(True)))
    plan[prefix + "mlp_norm"] = SequenceParallel()
    plan.update(_prefixed(prefix + "mlp", block.mlp.tp_plan(True)))
    return plan


def _prefixed(prefix: str, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A module's own plan ("" = the module) under its path in the model."""
    return {prefix + ("." + path if path else ""): style for path, style in plan.items()}


def _replicated_stream_plan(model: Decoder) -> dict[str, ParallelStyle]:
    """Heads and hidden units split as in training; the residual stream, norms and RoPE are
    replicated local tensors on every rank; the logits come out whole on every rank."""
    replicated = Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=replicated, output_layouts=replicated)
    for name, block in model.layers.items():
        prefix = f"layers.{name}."
        plan.update(_prefixed(prefix + "attention", block.attention.tp_plan(False)))
        plan.update(_prefixed(prefix + "mlp", block.mlp.tp_plan(False)))
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=replicated)
    elif model.config.tie_embeddings and model.embed_tokens is not None:
        # F.linear(h, the vocabulary-split embedding) with h as a replicated DTensor gives
        # vocabulary-sharded logits; the root gathers them.
        if model.norm is not None:
            plan["norm"] = PrepareModuleOutput(
                output_layouts=replicated, desired_output_layouts=replicated,
                use_local_output=False,
            )  # fmt: skip
        plan[""] = PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=replicated)
    return plan
