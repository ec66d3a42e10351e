"""Log-probabilities of logits rows with each row's argmax, split over the vocabulary.

    logprobs[b] = logits[b] - logsumexp(logits[b])       (fp32)
    best[:, b]  = (argmax(logits[b]), logprobs[b, argmax])   ([2, B] float64)

what the generator's ``score`` returns for every forward (generate/engine.py). In PyTorch it is
a log-softmax, an argmax and a gather; each reduction over a row is one thread block, so at
batch 1 over a 128K vocabulary the step's scoring ran ~29 us of single-block kernels on an
H200 (a decode step is ~1.2 ms; benchmarks/RESULTS.md, s27). Here each row is cut into blocks
of BLOCK_V logits: a first kernel writes every block's max, sum of exponentials and argmax, a
second reads a row's partials, combines them (the log-sum-exp rescaled to the row's max, the
first block holding the max) and writes its block's log-probabilities, and the row's first
block the argmax and its log-probability. Ties go to the lowest index, as torch's argmax does.
A row with a nan or an infinite logit gets a nan log-probability for its argmax, never a
finite made-up one (the generator reports such a row; which token it names is unspecified).

The values differ from torch.log_softmax's in the last bits (another order of summation), so
batch-invariant generation, whose log-probabilities must equal the trainer's bit for bit, keeps
PyTorch's ``score``.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from torchloom.kernels.triton_support import jit, tl, triton, triton_op, use_triton

_BLOCK_V = 4096


def log_softmax_argmax_reference(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's form (the generator's ``score``): fp32 log-probabilities, [2, B] float64 of
    each row's argmax token and its log-probability."""
    logprobs_BV = torch.log_softmax(logits_BV.float(), dim=-1)
    tokens_B = logprobs_BV.argmax(dim=-1)
    picked_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0]
    return logprobs_BV, torch.stack((tokens_B.double(), picked_B.double()))


@jit
def _partials_kernel(
    x_ptr, max_ptr, sum_ptr, arg_ptr, V, stride_xb, blocks, BLOCK_V: tl.constexpr
):  # fmt: skip
    """Program (row, block): the block's max, sum of exp(x - max) and argmax."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    index = block * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + row * stride_xb + index, mask=index < V, other=float("-inf"))
    x = x.to(tl.float32)
    top = tl.max(x, axis=0)
    arg = tl.argmax(x, axis=0, tie_break_left=True) + block * BLOCK_V
    shifted = tl.where(top > float("-inf"), top, 0.0)  # a block of -inf only: sum 0
    total = tl.sum(tl.exp(x - shifted), axis=0)
    tl.store(max_ptr + row * blocks + block, top)
    tl.store(sum_ptr + row * blocks + block, total)
    tl.store(arg_ptr + row * blocks + block, arg)


@jit
def _finish_kernel(
    x_ptr, max_ptr, sum_ptr, arg_ptr, out_ptr, best_ptr, V, B, stride_xb, blocks,
    BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Program (row, block): the row's log-sum-exp from the partials; the block's
    log-probabilities; block 0 also the row's argmax and its log-probability."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    parts = tl.arange(0, BLOCK_P)
    p_ok = parts < blocks
    maxes = tl.load(max_ptr + row * blocks + parts, mask=p_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + row * blocks + parts, mask=p_ok, other=0.0)
    top = tl.max(maxes, axis=0)
    shifted = tl.where(top > float("-inf"), top, 0.0)
    scale = tl.where(maxes > float("-inf"), tl.exp(maxes - shifted), 0.0)
    lse = shifted + tl.log(tl.sum(sums * scale, axis=0))
    index = block * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + row * stride_xb + index, mask=index < V, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * V + index, x - lse, mask=index < V)
    if block == 0:
        first = tl.min(tl.where(maxes == top, parts, BLOCK_P), axis=0)  # lowest block at the max
        first = tl.minimum(first, blocks - 1)  # nan maxes match nothing: any block will do
        token = tl.load(arg_ptr + row * blocks + first)
        tl.store(best_ptr + row, token.to(tl.float64))
        tl.store(best_ptr + B + row, (top - lse).to(tl.float64))


@triton_op("torchloom::log_softmax_argmax")
def log_softmax_argmax_triton(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels (any device Triton runs on)."""
    B, V = logits_BV.shape
    logits_BV = logits_BV if logits_BV.stride(-1) == 1 else logits_BV.contiguous()
    blocks = triton.cdiv(V, _BLOCK_V)
    max_BP = logits_BV.new_empty((B, blocks), dtype=torch.float32)
    sum_BP = torch.empty_like(max_BP)
    arg_BP = logits_BV.new_empty((B, blocks), dtype=torch.int64)
    logprobs_BV = logits_BV.new_empty((B, V), dtype=torch.float32)
    best_2B = logits_BV.new_empty((2, B), dtype=torch.float64)
    grid = (B, blocks)
    wrap_triton(_partials_kernel)[grid](
        logits_BV, max_BP, sum_BP, arg_BP, V, logits_BV.stride(0), blocks, BLOCK_V=_BLOCK_V
    )
    wrap_triton(_finish_kernel)[grid](
        logits_BV, max_BP, sum_BP, arg_BP, logprobs_BV, best_2B, V, B, logits_BV.stride(0),
        blocks, BLOCK_V=_BLOCK_V, BLOCK_P=triton.next_power_of_2(blocks),
    )  # fmt: skip
    return logprobs_BV, best_2B


IMPLS = ("auto", "torch", "triton")


def log_softmax_argmax(
    logits_BV: torch.Tensor, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-probabilities [B, V], [2, B] float64 argmax tokens and their
    log-probabilities): ``impl`` "triton" the kernels, "torch" the reference, "auto" the
    kernels on CUDA when Triton is installed."""
    if impl not in IMPLS:
        raise ValueError(f"log_softmax_argmax impl must be one of {IMPLS}; got {impl!r}")
    if impl == "torch" or (impl == "auto" and not use_triton(logits_BV)):
        return log_softmax_argmax_reference(logits_BV)
    return torch.ops.torchloom.log_softmax_argmax(logits_BV)
