"""The generator's one-launch decode step for one sequence (``Generator(step_kernel=...)``).

kernels/fused_decode.py runs a whole decode step of a pre-norm grouped-query-attention decoder
in one persistent kernel. This module says whether a model is one (``fused_step_problem``:
why not, or None) and describes it to the kernel (``decode_weights``): the model's own
parameters and the cache's own tensors, by address, nothing copied. So the kernel reads what
the model's forward reads, and a weight update copied into the parameters in place
(``Generator.update_weights``) is what the next fused step uses.

The generator runs it for the batch-size bucket of one row (slot 0), from a CUDA graph; other
buckets replay the model's forward as before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.kernels.attention_mask import CAUSAL
from torchloom.kernels.fused_decode import DecodeWeights, FusedDecodeStep, LayerWeights
from torchloom.models.components.attention import Attention
from torchloom.models.components.cache import KVState, ModelCache
from torchloom.models.components.decoder import Block, Decoder
from torchloom.models.components.mlp import MLP_IMPLS, SwiGLU
from torchloom.models.components.norms import BatchInvariantRMSNorm, RMSNorm
from torchloom.models.components.rope import RotaryEmbedding, inverse_frequencies


def fused_step_problem(model: nn.Module, cache: ModelCache) -> str | None:
    """Why the fused step cannot run ``model``'s decode over ``cache``, or None. It runs
    Llama-3-shaped decoders: token embedding, pre-norm blocks of grouped-query attention (full
    rotate-half RoPE, no q/k norms, gates or windows) and a SwiGLU MLP, RMS norms of one eps, a
    final RMS norm and a head without bias; unsharded, in one dtype, with every width a multiple
    of 16 (the kernel loads 16 elements at a time)."""
    if not isinstance(model, Decoder) or type(model).forward is not Decoder.forward:
        return f"{type(model).__name__} is not a plain decoder"
    config = model.config
    if config.batch_invariant:
        return "batch-invariant mode keeps the trainer's kernels"
    if model.embed_tokens is None or model.embed_norm is not None or model.softcap is not None:
        return "its embedding is normed or its logits soft-capped"
    if type(model.rope) is not RotaryEmbedding:
        return "it has no plain rotary embedding"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "its parameters are sharded"
    norms = [model.norm]
    for name, block in model.layers.items():
        problem = _block_problem(block, model.rope.head_dim)
        if problem is not None:
            return f"layer {name}: {problem}"
        norms += [block.attention_norm, block.mlp_norm]
    if not all(_plain_rms(n) for n in norms):
        return "a norm is not an RMSNorm with a weight"
    if len({n.eps for n in norms}) != 1:
        return "its RMS norms differ in eps"
    head = model.output
    if head is not None and head.bias is not None:
        return "its output head has a bias"
    if any(not isinstance(state, KVState) for state in cache.states.values()):
        return "a layer's generation state is not a key/value cache"
    dtypes = {p.dtype for p in model.parameters()} | {t.dtype for t in cache.tensors()}
    if len(dtypes) != 1:
        return f"its parameters and cache are in several dtypes ({sorted(map(str, dtypes))})"
    try:  # what the kernel itself reads: layout, head shape, widths
        FusedDecodeStep.check(decode_weights(model, cache))
    except ValueError as error:
        return str(error)
    return None


def _plain_rms(norm: nn.Module) -> bool:
    return isinstance(norm, RMSNorm) and not isinstance(norm, BatchInvariantRMSNorm)


def _block_problem(block: nn.Module, head_dim: int) -> str | None:
    if type(block) is not Block or any(
        hasattr(block, f"{slot}_{part}") for slot in ("attention", "mlp")
        for part in ("post_norm", "residual")
    ):  # fmt: skip
        return "not a plain pre-norm block"
    attention, mlp = block.attention, block.mlp
    if type(attention) is not Attention:
        return f"its token mixer is {type(attention).__name__}, not grouped-query attention"
    if (attention.q_norm is not None or attention.output_gate or attention.gate_proj is not None
            or attention.out_norm is not None or attention.q_scale != 1.0):  # fmt: skip
        return "its attention has q/k norms, an output gate or a query scale"
    if not attention.rotary or attention.rotary_dim != attention.head_dim:
        return "its attention rotates part of each head or none"
    if attention.mask != CAUSAL:
        return f"its attention mask is {attention.mask.describe()}"
    if attention.head_dim != head_dim:  # (the kernel's own check asks a power of two)
        return f"head_dim {attention.head_dim} is not the rotary embedding's {head_dim}"
    if type(mlp) is not SwiGLU or mlp.gated not in (MLP_IMPLS["torch"], MLP_IMPLS["triton"]):
        return f"its MLP is {type(mlp).__name__}, not SwiGLU"
    linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
               mlp.gate_proj, mlp.up_proj, mlp.down_proj]  # fmt: skip
    if any(linear.bias is not None for linear in linears):
        return "a linear has a bias"
    return None


def decode_weights(model: Decoder, cache: ModelCache, slot: int = 0) -> DecodeWeights:
    """The fused step's view of ``model`` (which ``fused_step_problem`` accepted) decoding the
    sequence in ``slot`` of ``cache``."""
    layers = []
    for name, block in model.layers.items():
        attention, mlp, state = block.attention, block.mlp, cache.states[int(name)]
        layers.append(LayerWeights(
            block.attention_norm.weight, attention.q_proj.weight, attention.k_proj.weight,
            attention.v_proj.weight, attention.o_proj.weight, block.mlp_norm.weight,
            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
            state.k[slot], state.v[slot],
        ))  # fmt: skip
    first = next(iter(model.layers.values())).attention
    head_dim = first.head_dim
    inv_freq, rope_scale = inverse_frequencies(model.rope.cfg, head_dim, cache.device)
    return DecodeWeights(
        embed=model.embed_tokens.weight,
        layers=layers,
        norm=model.norm.weight,
        head=model.head_weight(),
        heads=first.q_proj.weight.shape[0] // head_dim,
        kv_heads=first.k_proj.weight.shape[0] // head_dim,
        head_dim=head_dim,
        eps=model.norm.eps,
        inv_freq=inv_freq.to(torch.float32),
        rope_scale=rope_scale,
    )
