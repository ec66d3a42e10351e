"""A whole decode step of one sequence in one kernel launch (a persistent "megakernel").

At batch 1 a decoder's step reads every weight once and does almost no arithmetic, so its
floor is the weights' bytes over the memory bandwidth (Llama-3.2-1B in bf16: 2.47 GB, ~0.6 ms
on an H200). Run as separate kernels (a matmul, a norm, RoPE, attention, SwiGLU, a residual add
for each layer) the step also pays each kernel's launch, ramp and tail, over 200 times: on the
H200 cuBLAS's one-row matmuls alone took 0.80 ms and the whole step 1.17 ms
(benchmarks/RESULTS.md, s27). Here one launch of persistent programs runs all of it.

The step is a list of tasks in dependency order, each belonging to a stage:

- embed: the token's embedding row into the residual stream (one task);
- per layer: q, k and v tiles (RMS norm in the prologue); attention tasks per query head
  and split (RoPE on its query and its kv head's new key, the new key and value written to
  the cache by the group's first head, online softmax over a split of the cached positions; the head's
  last split merges the splits); o tiles (+ the residual); gated tiles holding the same rows
  of gate and up (norm in the prologue) that write silu(gate) * up; down tiles (+ the
  residual);
- the head's tiles (final norm in the prologue), each also writing its rows' max, sum of
  exponentials and argmax; the last head tile to finish combines them (log-sum-exp, argmax,
  the next step's token and position);
- log-probability tiles (logits minus the log-sum-exp).

Every matrix tile is ROWS rows by one CHUNK-wide slice of the input (CHUNK = the model's width
rounded up to a power of two, so a normed input is one slice and the norm is taken in the
tile); a wider input (the down projection's) is split into slices whose partial sums the
last slice to finish adds in slice order (or, ``reader_sums``, the default since s43, which
the stream's readers add as they load it), so each tile re-reads only its slice of the input,
never the whole 8,192-wide one. A matrix task is one tile or, with ``waves``, a strip of
consecutive row blocks over one slice: the task's fixed costs are paid once a strip, and its
blocks stream through a loop Triton pipelines (asynchronous copies into shared memory, several
tiles in flight a program). On an H100 one tile a task cost 5-8 us of serial round trips a
task, so the step's time followed its count of tasks (benchmarks/RESULTS.md, s36); strips of
about two tasks a program a stage took 0.45 of that time (s38). Offsets
and widths are multiples of 16 elements and the kernel says so (``tl.multiple_of``): read
from its tables, they would otherwise be loaded one element an instruction.

Programs are dealt tasks round-robin where they can all be resident (``schedule="static"``,
the default on a GPU since s43: no atomic and no barrier a task), or take them from a global
counter in order (``"dynamic"``, under the interpreter). A matrix task asks for its first weight
tiles (PIPELINE - 1 of them: its strip loop's prologue), then waits (spinning on an acquire
load of a counter until it reaches the wait's count) for the input it reads, in the loop's
first iteration, so a stage's weight reads overlap the previous stage's tail (on an H100
3.5-4% faster than loading one tile alone before the wait; benchmarks/RESULTS.md, s40); a
finished task stores its outputs and publishes them with a release increment of its stage's
count. Most waits are for a whole stage (a normed input needs every row of the stream), but
two readers need only part of one: a query head waits for its kv group's q, k and v rows
(their tasks are sorted by group and count in one counter a group) and a chunk of the down
projection for that chunk of the gated rows (one counter a chunk; the down tasks go chunk by
chunk), so each starts while the rest of the stage before is still being written. On an H100
these took 0-5% off the step, whose waits cost 0.18 ms of 1.38 (timed by freeing them). A task
only ever waits for tasks taken before its own, by running programs, so no schedule deadlocks
(and under Triton's interpreter, where programs run one after another, every wait is already
met).

Activations stay in fp32 in one scratch buffer (each stage writes fresh rows: nothing is
overwritten while a reader may still need it); the cache gets the model's dtype. The numbers
therefore differ from the model's forward by its intermediate roundings (which round every
op's output to bf16): close, not bitwise. Batch-invariant mode never uses it.

What it runs: ``DecodeWeights``, a plain description of a pre-norm decoder with grouped-query
attention, full rotate-half RoPE, SwiGLU and RMS norms (Llama 3; built from a model by
torchloom/generate/fused_step.py). ``fused_decode_reference`` is the same step in PyTorch ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.nn.functional as F

from torchloom.kernels.triton_support import jit, num_persistent_programs, tl, triton

_LOG2E = 1.4426950408889634
# Task kinds and matrix input classes, as the kernel spells them (literals there: a jit function
# reads no plain globals).
EMBED, MATVEC, ATTEND, LOGPROB = 0, 1, 2, 3
# Per matrix: weight, N, K, input, output, residual, norm weight, wait, stage, is head,
# up weight (gated), chunks, partial sums, first strip's count of finished chunks, row
# blocks a task (its strip), row blocks, wait stride (a chunk's wait: wait + chunk * stride),
# signal (the first counter its rows count in, or -1), rows a signal counter, whether its
# tasks count in the stage's counter too (a signalled stage's count has no reader), the parts
# its input and its residual are summed from (1: a plain vector; ``reader_sums``: the down
# projection's chunk partials and the residual after them).
MATRIX_FIELDS = 22
# Per layer: q/k/v, key cache, value cache, partials, output, first wait (one a kv group),
# stage, head counters.
LAYER_FIELDS = 8
TASK_FIELDS = 3  # kind, index (matrix or layer), tile (or query head)


class Stamp(IntEnum):
    """The columns of a traced task's row of ``FusedDecodeStep.stamps`` (the kernel writes
    them by these numbers): global times in ns, the rest the multiprocessor's cycle counts."""

    START_NS = 0  # the task's start (global timer)
    START = 1  # its start
    WAITED = 2  # its wait's end
    INPUT = 3  # its input's arrival
    STRIP = 4  # its strip's end
    END = 5  # its end
    SM = 6  # its multiprocessor
    END_NS = 7  # its end (global timer)
    WAIT = 8  # its wait's start


TRACE_FIELDS = 10  # a row's width (one column spare)
# The default tiling: 8,192 weights a tile (16 KB of bf16), 4 warps, two programs a
# multiprocessor (the fastest of 27 on an H100, s38; 237 registers a thread on sm_90, no
# spills), and each stage one strip a program (waves 1). Two waves were the fastest while tasks
# came from the counter (s38-s43); dealt round-robin with the readers summing the down
# projection's partials, one wave took the 1B step from 1.293 to 1.153 ms on an H100 (s46):
# 18,838 tasks instead of 33,421, each stage's fixed costs paid once a program. One tile a task
# (waves None) took 2.2 times as long: a task's serial round trips, 77,599 times a 1B step.
DEFAULT_TILE, DEFAULT_WARPS, DEFAULT_PER_SM, DEFAULT_WAVES = 8192, 4, 2, 1
# A strip's row blocks stream through a loop Triton pipelines this deep: this many less one
# tiles in flight a program, in shared memory (32 KB at the default tiling). Not the stages of
# the step (the groups of tasks one another waits for).
DEFAULT_PIPELINE = 3
# Whether a strip's first block goes through the pipelined loop too, the wait for its input in
# the loop's first iteration (so PIPELINE - 1 blocks are asked for before the wait), rather than
# loaded alone before the wait with the loop starting at the second block.
DEFAULT_WAIT_IN_LOOP = True
# Whether the stream's readers add the down projection's chunk partials (rather than its last
# chunk, after counting its strip's finished chunks), and whether tasks are dealt round-robin
# where every program can be resident (rather than taken from the counter): on an H100 (s43)
# both together took the step from 1.332 to 1.296 ms, each alone 1.323 (sums) and 1.314 (dealt).
DEFAULT_READER_SUMS = True
# Whether each head task combines its strip's blocks' (max, sum of exponentials, argmax) before
# the last task combines them all (one a strip, not one a block): written in s46 after its trace
# showed the last task reading 32,064 triples (64 us); on an H100 (s47) the step went from 1.144
# to 1.092 ms, the head stage from 236 to 178 us.
DEFAULT_STRIP_TOPS = True
MAX_SPLITS = 16  # each query head's cached positions in at most 16 tasks (flash-decoding)
# Row blocks of its next task (round-robin: the program's next, known when the plan is made)
# a task asks L2 for as it starts, so that the weights keep streaming from memory while the
# program waits for its own task's input; 0: none (see ``FusedDecodeStep``'s ``prefetch``).
DEFAULT_PREFETCH = 0
PREFETCH_FIELDS = 5  # per task: its next task's first weight, its up weight's, rows, stride, width


@dataclass
class LayerWeights:
    """One block's tensors ([out, in] linears) and its slot's key/value cache
    [kv_heads, max_len, head_dim]."""

    attention_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass
class DecodeWeights:
    """A pre-norm GQA decoder as the fused step reads it: every tensor in one dtype on one
    device. RoPE: angle = position * inv_freq[i] for channels i and i + head_dim / 2, cos and
    sin times ``rope_scale``."""

    embed: torch.Tensor  # [vocab, dim]
    layers: list[LayerWeights]
    norm: torch.Tensor
    head: torch.Tensor  # [vocab, dim] (the embedding itself when tied)
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    inv_freq: torch.Tensor  # [head_dim / 2] fp32
    rope_scale: float = 1.0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean() + eps) * weight.float()


def _rotate(x_Hd: torch.Tensor, cos_d: torch.Tensor, sin_d: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_Hd.chunk(2, -1)
    return x_Hd * cos_d + torch.cat((-x2, x1), -1) * sin_d


def fused_decode_reference(
    w: DecodeWeights, token: int, position: int
) -> tuple[torch.Tensor, int, float]:
    """The fused step in PyTorch ops, with its roundings (fp32 activations; q, k, v and the
    cache in the weights' dtype): writes the key and value at ``position`` of every layer's
    cache, returns (fp32 log-probabilities [vocab], argmax token, its log-probability)."""
    dtype, hd = w.embed.dtype, w.head_dim
    rounded = lambda x: x.to(dtype).float()  # noqa: E731
    angle = position * w.inv_freq.float()
    cos_d = rounded(torch.cat((angle, angle)).cos() * w.rope_scale)
    sin_d = rounded(torch.cat((angle, angle)).sin() * w.rope_scale)
    h = w.embed[token].float()
    for layer in w.layers:
        x = _rms_norm(h, layer.attention_norm, w.eps)
        q = rounded(layer.q.float() @ x).view(w.heads, hd)
        k = rounded(layer.k.float() @ x).view(w.kv_heads, hd)
        v = rounded(layer.v.float() @ x).view(w.kv_heads, hd)
        q, k = rounded(_rotate(q, cos_d, sin_d)), rounded(_rotate(k, cos_d, sin_d))
        layer.k_cache[:, position] = k.to(dtype)
        layer.v_cache[:, position] = v.to(dtype)
        keys = layer.k_cache[:, : position + 1].float().repeat_interleave(w.heads // w.kv_heads, 0)
        values = layer.v_cache[:, : position + 1].float()
        values = values.repeat_interleave(w.heads // w.kv_heads, 0)
        probs = ((keys @ q[:, :, None])[..., 0] * hd**-0.5).softmax(-1)
        attended = (probs[:, None, :] @ values)[:, 0].reshape(-1)
        h = h + layer.o.float() @ attended
        x = _rms_norm(h, layer.mlp_norm, w.eps)
        h = h + layer.down.float() @ (F.silu(layer.gate.float() @ x) * (layer.up.float() @ x))
    logits = w.head.float() @ _rms_norm(h, w.norm, w.eps)
    logprobs = logits - torch.logsumexp(logits, 0)
    best = int(logits.argmax())
    return logprobs, best, float(logprobs[best])


# -- the kernel ------------------------------------------------------------------------------


@jit
def _wait(counters_ptr, waits_ptr, wait):
    """Spin until the counter of wait ``wait`` (none: -1) reaches the wait's count: every task
    that writes what the waiting task reads has published it. Returns the count seen (0
    without a wait): a value that exists only once the wait is over (for ``_stamp``)."""
    done = 0
    if wait >= 0:
        counter = counters_ptr + tl.load(waits_ptr + 2 * wait)
        need = tl.load(waits_ptr + 2 * wait + 1)
        done = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        while done < need:
            done = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    return done


@jit
def _stamp(trace_row, field, after, TRACE: tl.constexpr):
    """With ``TRACE``: the multiprocessor's cycle count into ``trace_row[field]``, read once
    ``after`` (an int32 value) exists, so the stamp cannot be taken before what computes it."""
    if TRACE:
        clock = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [after],
                                          dtype=tl.int64, is_pure=False, pack=1)  # fmt: skip
        tl.store(trace_row + field, clock)


@jit
def _publish(counters_ptr, stage):
    """Every thread's stores first, then one release increment of the stage's count."""
    tl.debug_barrier()
    tl.atomic_add(counters_ptr + 1 + stage, 1, sem="release", scope="gpu")


@jit
def _publish_rows(counters_ptr, stage, signal, signal_rows, lo, hi, count_stage):
    """With a ``signal`` counter (else -1): one release increment of each counter ``signal +
    r // signal_rows`` of the rows [lo, hi) the task wrote, where a reader of some rows waits
    for their counters only; then, if ``count_stage``, one of the stage's count. A signalled
    stage's count has no reader (the plan checks it: q, k and v are read per kv group, the
    gated rows per chunk), so the plan keeps it only when asked (``count_signalled_stages``),
    which spares every such task a release round trip."""
    tl.debug_barrier()
    first = lo // signal_rows
    last = tl.where(signal >= 0, (hi - 1) // signal_rows + 1, first)
    for slot in range(first, last):
        tl.atomic_add(counters_ptr + signal + slot, 1, sem="release", scope="gpu")
    if count_stage != 0:
        tl.atomic_add(counters_ptr + 1 + stage, 1, sem="release", scope="gpu")


@jit
def _top(act_ptr, at, n, BLOCK: tl.constexpr):
    """The largest of ``n`` (max, sum of exponentials, argmax) triples at ``at`` in scratch,
    their sums of exponentials taken relative to it and added, and the first argmax holding it
    (triples in row order, so the first is the lowest row)."""
    offs = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    for t0 in range(0, n, BLOCK):
        ok = t0 + offs < n
        top = tl.maximum(top, tl.load(act_ptr + at + (t0 + offs) * 3, mask=ok,
                                      other=float("-inf"), cache_modifier=".cg"))  # fmt: skip
    best = tl.max(top, axis=0)
    total = tl.zeros((BLOCK,), tl.float32)
    first = tl.full((BLOCK,), 2**30, tl.int32)
    for t0 in range(0, n, BLOCK):
        idx = t0 + offs
        ok = idx < n
        m = tl.load(act_ptr + at + idx * 3, mask=ok, other=float("-inf"), cache_modifier=".cg")
        s = tl.load(act_ptr + at + idx * 3 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        total += tl.where(ok, s * tl.exp(m - best), 0.0)
        first = tl.minimum(first, tl.where(ok & (m == best), idx, 2**30))
    token = tl.load(act_ptr + at + tl.min(first, axis=0) * 3 + 2, cache_modifier=".cg")
    return best, tl.sum(total, axis=0), token


@jit
def _combine(act_ptr, counters_ptr, best_ptr, token_ptr, pos_ptr, max_len, tops_off, tops,
             lse_off, combine_stage, BLOCK: tl.constexpr):  # fmt: skip
    """The head's ``tops`` (max, sum of exponentials, argmax) triples (one a block, or one a
    strip) into the log-sum-exp and the first argmax; the next step's token and position
    (clamped inside the cache)."""
    best, total, token = _top(act_ptr, tops_off, tops, BLOCK)
    lse = best + tl.log(total)
    tl.store(act_ptr + lse_off, lse)
    tl.store(best_ptr, token.to(tl.float64))
    tl.store(best_ptr + 1, (best - lse).to(tl.float64))
    tl.store(token_ptr, token.to(tl.int64))
    position = tl.load(pos_ptr)
    tl.store(pos_ptr, tl.minimum(position + 1, max_len - 1))
    _publish(counters_ptr, combine_stage)


@jit
def _stream(act_ptr, at, offs, ok, parts, PARTS: tl.constexpr, DIM: tl.constexpr):
    """The scratch values at ``at + offs``, or with ``parts`` > 1 the residual stream as the
    layer before left it (``reader_sums``): its down projection's chunk partials, DIM apart,
    summed in chunk order, then the residual after them. Every part's load is issued before
    the first add (an unrolled loop: one round trip, not ``parts``)."""
    total = tl.load(act_ptr + at + offs, mask=ok, other=0.0, cache_modifier=".cg")
    for p in tl.static_range(1, PARTS):
        total += tl.load(act_ptr + at + p * DIM + offs, mask=ok & (offs * 0 + p < parts),
                         other=0.0, cache_modifier=".cg")  # fmt: skip
    return total


@jit
def _plus_residual(y, act_ptr, resid_at, resid_off, rows, row_ok, resid_parts,
                   PARTS: tl.constexpr, DIM: tl.constexpr):  # fmt: skip
    """``y`` plus the residual stream's ``rows`` (none where ``resid_off`` is -1)."""
    ok = row_ok & (rows * 0 + resid_off >= 0)
    return y + _stream(act_ptr, resid_at, rows, ok, resid_parts, PARTS, DIM)


@jit
def _finish_block(y, block, rows, row_ok, act_ptr, N, chunk, chunks, parts_off, y_off, resid_at,
                  resid_off, resid_parts, is_head, partials_off, ROWS: tl.constexpr,
                  PARTS: tl.constexpr, DIM: tl.constexpr):  # fmt: skip
    """A row block's sums ``y``: with several chunks its partial sums (added up once every chunk
    of the strip is in), else the output plus the residual; a head block also writes its rows'
    max, sum of exponentials and argmax."""
    if chunks > 1:
        tl.store(act_ptr + parts_off + chunk * N + rows, y, mask=row_ok)
    else:
        y = _plus_residual(y, act_ptr, resid_at, resid_off, rows, row_ok, resid_parts, PARTS, DIM)
        tl.store(act_ptr + y_off + rows, y, mask=row_ok)
    if is_head != 0:  # one chunk: every head block finishes its rows
        masked = tl.where(row_ok, y, float("-inf"))
        top = tl.max(masked, axis=0)
        tl.store(act_ptr + partials_off + block * 3, top)
        tl.store(act_ptr + partials_off + block * 3 + 1, tl.sum(tl.exp(masked - top), axis=0))
        tl.store(act_ptr + partials_off + block * 3 + 2,
                 (block * ROWS + tl.argmax(masked, axis=0)).to(tl.float32))  # fmt: skip


@jit
def _block_weights(base_ptr, w_off, up_off, block, N, K, cols, col_ok, ROWS: tl.constexpr,
                   GATED: tl.constexpr):  # fmt: skip
    """Row block ``block``'s rows, which of them exist, and its weights over ``cols`` (gated:
    the gate's and the up projection's; otherwise the weights twice)."""
    rows = block * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    at = rows.to(tl.int64)[:, None] * K + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    w = tl.load(base_ptr + w_off + at, mask=ok, other=0.0, eviction_policy="evict_first")
    w_up = w
    if GATED:
        w_up = tl.load(base_ptr + up_off + at, mask=ok, other=0.0, eviction_policy="evict_first")
    return rows, row_ok, w, w_up


@jit
def _block_sums(w, w_up, x, GATED: tl.constexpr):
    """One row block's dot products with the input (gated: silu(gate) * up)."""
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if GATED:
        up = tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
        y = y * tl.sigmoid(y) * up
    return y


@jit
def _input(act_ptr, counters_ptr, waits_ptr, wait, chunk, wait_stride, x_off, x_parts, cols,
           col_ok, norm_off, gain, K, trace_row, EPS: tl.constexpr, TRACE: tl.constexpr,
           PARTS: tl.constexpr, DIM: tl.constexpr):  # fmt: skip
    """Once its writers have published it, a task's slice of its input, RMS-normed where the
    matrix has a norm weight (traced: the wait's end, then the input's arrival)."""
    _stamp(trace_row, 8, wait, TRACE)  # Stamp.WAIT
    done = _wait(counters_ptr, waits_ptr, tl.where(wait >= 0, wait + chunk * wait_stride, -1))
    _stamp(trace_row, 2, done, TRACE)  # Stamp.WAITED
    x = _stream(act_ptr, x_off, cols, col_ok, x_parts, PARTS, DIM)
    squares = tl.sum(x * x, axis=0)
    _stamp(trace_row, 3, squares.to(tl.int32, bitcast=True), TRACE)  # Stamp.INPUT
    scale = tl.where(norm_off >= 0, tl.rsqrt(squares / K + EPS), 1.0)
    return x * scale * gain.to(tl.float32)


@jit
def _matvec(base_ptr, act_ptr, stages_ptr, waits_ptr, counters_ptr, meta, tile, best_ptr,
            token_ptr, pos_ptr, max_len, partials_off, lse_off, combine_stage, CHUNK: tl.constexpr,
            ROWS: tl.constexpr, GATED: tl.constexpr, EPS: tl.constexpr,
            trace_row, BLOCK_V: tl.constexpr, PIPELINE: tl.constexpr,
            WAIT_IN_LOOP: tl.constexpr, TRACE: tl.constexpr, PARTS: tl.constexpr,
            DIM: tl.constexpr, STRIP_TOPS: tl.constexpr):  # fmt: skip
    """One strip of a matrix: up to ``strip`` consecutive blocks of ``ROWS`` outputs over one
    CHUNK-wide slice of its input (tile = strip index * chunks + chunk). The strip's blocks
    stream through a loop Triton pipelines ``PIPELINE`` deep (their weights, with ``GATED`` the
    gate's and the up projection's rows, copied into shared memory ahead of use). The task
    waits for its input and loads its slice (RMS-normed where the matrix has a norm weight:
    such a matrix has one chunk) in the loop's first iteration with ``WAIT_IN_LOOP`` (the first
    PIPELINE - 1 blocks are then asked for before the wait), else after loading the first
    block alone, the loop starting at the second. Gated, the output is silu(gate) * up. With
    several chunks each writes its partial sums and the strip's last chunk to finish adds them
    in chunk order (one count a strip, not a block); the residual rows are added to the
    finished sums. A head block also writes its rows' max, sum of exponentials and argmax; the
    head's last task to finish combines them (``STRIP_TOPS``: each head task first combines its
    strip's into one, and the last task combines those)."""
    # Offsets and widths are multiples of 16 elements (the plan checks it), which lets the
    # compiler load 16 bytes a thread at a time (without the hints it loads one element) and
    # pipeline the loads.
    w_off, N, K = tl.multiple_of(tl.load(meta), 16), tl.load(meta + 1), tl.multiple_of(tl.load(meta + 2), 16)  # fmt: skip
    x_off, y_off = tl.multiple_of(tl.load(meta + 3), 16), tl.multiple_of(tl.load(meta + 4), 16)
    resid_off, norm_off = tl.load(meta + 5), tl.load(meta + 6)  # -1: none (loads masked off)
    resid_at = tl.multiple_of(tl.maximum(resid_off, 0), 16)
    norm_at = tl.multiple_of(tl.maximum(norm_off, 0), 16)
    wait, stage, is_head = tl.load(meta + 7), tl.load(meta + 8), tl.load(meta + 9)
    up_off, chunks = tl.multiple_of(tl.load(meta + 10), 16), tl.load(meta + 11)
    parts_off, row_counters = tl.multiple_of(tl.load(meta + 12), 16), tl.load(meta + 13)
    strip, blocks = tl.load(meta + 14), tl.load(meta + 15)
    wait_stride, signal, signal_rows = tl.load(meta + 16), tl.load(meta + 17), tl.load(meta + 18)
    x_parts, resid_parts = tl.load(meta + 20), tl.load(meta + 21)
    first, chunk = (tile // chunks) * strip, tile % chunks
    count = tl.minimum(strip, blocks - first)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    col_ok = cols < K
    gain = tl.load(base_ptr + norm_at + cols, mask=col_ok & (cols * 0 + norm_off >= 0), other=1.0)
    x = tl.zeros((CHUNK,), tl.float32)
    start = 0
    if not WAIT_IN_LOOP:  # the first block loaded, then the wait and the input, then the rest
        rows, row_ok, w, w_up = _block_weights(base_ptr, w_off, up_off, first, N, K, cols,
                                               col_ok, ROWS, GATED)  # fmt: skip
        x = _input(act_ptr, counters_ptr, waits_ptr, wait, chunk, wait_stride, x_off, x_parts,
                   cols, col_ok, norm_off, gain, K, trace_row, EPS, TRACE, PARTS, DIM)  # fmt: skip
        _finish_block(_block_sums(w, w_up, x, GATED), first, rows, row_ok, act_ptr, N, chunk,
                      chunks, parts_off, y_off, resid_at, resid_off, resid_parts, is_head,
                      partials_off, ROWS, PARTS, DIM)  # fmt: skip
        start = 1
    # WAIT_IN_LOOP: every block goes through the pipelined loop and the wait sits in its first
    # iteration, so the loop's prologue has asked for the first PIPELINE - 1 blocks' weights
    # before the task waits for its input (the input's own load is not pipelined: it stays
    # after the wait).
    for i in tl.range(start, count, num_stages=PIPELINE):
        block = first + i
        rows, row_ok, w, w_up = _block_weights(base_ptr, w_off, up_off, block, N, K, cols,
                                               col_ok, ROWS, GATED)  # fmt: skip
        if WAIT_IN_LOOP:  # noqa: SIM102 (a constexpr test: compiled out when off)
            if i == 0:
                x = _input(act_ptr, counters_ptr, waits_ptr, wait, chunk, wait_stride, x_off,
                           x_parts, cols, col_ok, norm_off, gain, K, trace_row, EPS, TRACE,
                           PARTS, DIM)  # fmt: skip
        _finish_block(_block_sums(w, w_up, x, GATED), block, rows, row_ok, act_ptr, N, chunk,
                      chunks, parts_off, y_off, resid_at, resid_off, resid_parts, is_head,
                      partials_off, ROWS, PARTS, DIM)  # fmt: skip
    _stamp(trace_row, 4, count, TRACE)  # Stamp.STRIP
    # The strip's last chunk to finish sums its rows' partials in chunk order (unless the
    # stream's readers sum them: no count of finished chunks, -1).
    if (chunks > 1) & (row_counters >= 0):
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + row_counters + tile // chunks, 1, sem="acq_rel",
                             scope="gpu")  # fmt: skip
        if done == chunks - 1:
            for i in range(0, count):
                rows = (first + i) * ROWS + tl.arange(0, ROWS)
                row_ok = rows < N
                y = tl.zeros((ROWS,), tl.float32)
                for c in range(0, chunks):
                    y += tl.load(act_ptr + parts_off + c * N + rows, mask=row_ok, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
                y = _plus_residual(y, act_ptr, resid_at, resid_off, rows, row_ok, resid_parts,
                                   PARTS, DIM)  # fmt: skip
                tl.store(act_ptr + y_off + rows, y, mask=row_ok)
    if is_head != 0:
        tl.debug_barrier()
        tops_off, tops = partials_off, blocks.to(tl.int32)  # the last task reads every block's
        if STRIP_TOPS:
            # The strip's blocks' triples into one, so that the last task combines one a strip,
            # not one a block: on an H100 (s46) one program reading the 1B head's 32,064 block
            # triples took 64 us, 6% of the step.
            tops_off, tops = partials_off + blocks * 3, ((blocks + strip - 1) // strip).to(tl.int32)
            top, total, token = _top(act_ptr, partials_off + first * 3, count.to(tl.int32),
                                     BLOCK_V)  # fmt: skip
            mine = act_ptr + tops_off + (tile // chunks) * 3  # this strip's triple
            tl.store(mine, top)
            tl.store(mine + 1, total)
            tl.store(mine + 2, token)
            tl.debug_barrier()
        before = tl.atomic_add(counters_ptr + 1 + stage, 1, sem="acq_rel", scope="gpu")
        if before == tl.load(stages_ptr + stage) - 1:  # the last head task: all triples visible
            _combine(act_ptr, counters_ptr, best_ptr, token_ptr, pos_ptr, max_len, tops_off, tops,
                     lse_off, combine_stage, BLOCK_V)  # fmt: skip
    else:
        _publish_rows(counters_ptr, stage, signal, signal_rows, first * ROWS,
                      tl.minimum(N, (first + count) * ROWS), tl.load(meta + 19))  # fmt: skip


@jit
def _ask_l2(ptrs):
    """One ``prefetch.global.L2`` a pointer: the line holding it is fetched into L2, nothing is
    waited for or returned (a hint: no result depends on it)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@jit
def _prefetch(base_ptr, at, up_at, rows, stride, width, ROWS: tl.constexpr, CHUNK: tl.constexpr,
              LINE: tl.constexpr):  # fmt: skip
    """Asks L2 for ``rows`` rows of ``width`` weights, ``stride`` apart from ``at`` (and as many
    of the up projection's from ``up_at``; -1: none), one request a line of ``LINE`` weights
    (128 bytes); lines past a row's width or rows past ``rows`` ask again for the first."""
    r = tl.arange(0, ROWS)
    lines = tl.arange(0, CHUNK // LINE) * LINE
    for r0 in range(0, rows, ROWS):
        ok = ((r0 + r) < rows)[:, None] & (lines < width)[None, :]
        offs = tl.where(ok, (r0 + r).to(tl.int64)[:, None] * stride + lines[None, :], 0)
        _ask_l2(base_ptr + at + offs)
        if up_at >= 0:
            _ask_l2(base_ptr + up_at + offs)


@jit
def _prefetch_row(prefetch_ptr, task, more):
    """Task ``task``'s row of the prefetch table (none past the last task: rows 0)."""
    row = prefetch_ptr + 5 * task
    return (tl.load(row, mask=more, other=0), tl.load(row + 1, mask=more, other=-1),
            tl.load(row + 2, mask=more, other=0), tl.load(row + 3, mask=more, other=0),
            tl.load(row + 4, mask=more, other=0))  # fmt: skip


@jit
def _online_softmax(kb1, kb2, vb1, vb2, ok, rq1, rq2, running_max, total, acc1, acc2,
                    SCALE_LOG2: tl.constexpr):  # fmt: skip
    """A block of keys and values (each [BLOCK_L, HEAD_DIM / 2] halves; rows not ``ok``
    masked) into the online softmax's running max, sum and unnormalised output halves (log2
    units)."""
    scores = (tl.sum(kb1 * rq1[None, :], axis=1) + tl.sum(kb2 * rq2[None, :], axis=1)) * SCALE_LOG2
    scores = tl.where(ok, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=0))
    alpha = tl.exp2(running_max - new_max)
    p = tl.exp2(scores - new_max)
    total = total * alpha + tl.sum(p, axis=0)
    acc1 = acc1 * alpha + tl.sum(p[:, None] * vb1, axis=0)
    acc2 = acc2 * alpha + tl.sum(p[:, None] * vb2, axis=0)
    return new_max, total, acc1, acc2


@jit
def _load_block(keys, values, at, ok, HALF: tl.constexpr):
    """Key and value halves of one block of cached positions, in fp32."""
    kb1 = tl.load(keys + at, mask=ok[:, None], other=0.0).to(tl.float32)
    kb2 = tl.load(keys + at + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    vb1 = tl.load(values + at, mask=ok[:, None], other=0.0).to(tl.float32)
    vb2 = tl.load(values + at + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    return kb1, kb2, vb1, vb2


@jit
def _attend(base_ptr, act_ptr, waits_ptr, counters_ptr, meta, task, pos_ptr, max_len,
            inv_freq_off, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, SPLITS: tl.constexpr,
            trace_row, SCALE_LOG2: tl.constexpr, ROPE_SCALE: tl.constexpr,
            TRACE: tl.constexpr):  # fmt: skip
    """One query head over one split of the cached positions (flash-decoding): split s of S
    covers positions [s * span, (s + 1) * span) before the step's own, span a whole number
    of BLOCK_L blocks. The split's first block is loaded before the wait for q/k/v (the cache
    before this step's position depends on nothing). Split 0 also takes the step's own key:
    RoPE on the query and the kv head's new key (rounded to the cache's dtype, as the cache
    holds them), which the group's first head writes to the cache with the new value. Writes
    the split's running max, sum and unnormalised output; the o projection combines them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    GROUP: tl.constexpr = HEADS // KV_HEADS
    dtype = base_ptr.dtype.element_ty
    head, split = task // SPLITS, task % SPLITS
    qkv_off = tl.multiple_of(tl.load(meta), 16)  # (multiples of 16: the plan checks it)
    k_cache, v_cache = tl.multiple_of(tl.load(meta + 1), 16), tl.multiple_of(tl.load(meta + 2), 16)
    parts_off, out_off = (
        tl.multiple_of(tl.load(meta + 3), 16),
        tl.multiple_of(tl.load(meta + 4), 16),
    )
    wait = tl.load(meta + 5)
    stage, head_counters = tl.load(meta + 6), tl.load(meta + 7)
    kv = head // GROUP
    d = tl.arange(0, HALF)
    position = tl.load(pos_ptr)
    span = tl.cdiv(position, SPLITS * BLOCK_L) * BLOCK_L
    start = split * span
    end = tl.minimum(start + span, position)
    keys = base_ptr + k_cache + kv * max_len * HEAD_DIM
    values = base_ptr + v_cache + kv * max_len * HEAD_DIM
    idx = start + tl.arange(0, BLOCK_L)
    ok = idx < end
    at = idx.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    kb1, kb2, vb1, vb2 = _load_block(keys, values, at, ok, HALF)  # the first block, early
    angle = position.to(tl.float32) * tl.load(act_ptr + inv_freq_off + d)
    cos = (tl.cos(angle) * ROPE_SCALE).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * ROPE_SCALE).to(dtype).to(tl.float32)
    _stamp(trace_row, 8, wait, TRACE)  # Stamp.WAIT
    done = _wait(counters_ptr, waits_ptr, wait + kv)  # the kv group's q, k and v rows
    _stamp(trace_row, 2, done, TRACE)  # Stamp.WAITED
    q_ptr = act_ptr + qkv_off + head * HEAD_DIM
    k_ptr = act_ptr + qkv_off + (HEADS + kv) * HEAD_DIM
    v_ptr = act_ptr + qkv_off + (HEADS + KV_HEADS + kv) * HEAD_DIM
    q1 = tl.load(q_ptr + d, cache_modifier=".cg").to(dtype).to(tl.float32)
    q2 = tl.load(q_ptr + HALF + d, cache_modifier=".cg").to(dtype).to(tl.float32)
    rq1 = (q1 * cos - q2 * sin).to(dtype).to(tl.float32)
    rq2 = (q2 * cos + q1 * sin).to(dtype).to(tl.float32)
    acc1 = rq1 * 0.0
    acc2 = rq1 * 0.0
    total = tl.sum(acc1, axis=0)
    running_max = total - float("inf")
    if split == 0:  # the step's own key and value
        k1 = tl.load(k_ptr + d, cache_modifier=".cg").to(dtype).to(tl.float32)
        k2 = tl.load(k_ptr + HALF + d, cache_modifier=".cg").to(dtype).to(tl.float32)
        v1 = tl.load(v_ptr + d, cache_modifier=".cg").to(dtype).to(tl.float32)
        v2 = tl.load(v_ptr + HALF + d, cache_modifier=".cg").to(dtype).to(tl.float32)
        rk1 = (k1 * cos - k2 * sin).to(dtype).to(tl.float32)
        rk2 = (k2 * cos + k1 * sin).to(dtype).to(tl.float32)
        if head % GROUP == 0:
            tl.store(keys + position * HEAD_DIM + d, rk1.to(dtype))
            tl.store(keys + position * HEAD_DIM + HALF + d, rk2.to(dtype))
            tl.store(values + position * HEAD_DIM + d, v1.to(dtype))
            tl.store(values + position * HEAD_DIM + HALF + d, v2.to(dtype))
        running_max = (tl.sum(rq1 * rk1, axis=0) + tl.sum(rq2 * rk2, axis=0)) * SCALE_LOG2
        total = running_max * 0.0 + 1.0
        acc1, acc2 = v1, v2
    if start < end:  # the prefetched block (a split past the position holds none)
        running_max, total, acc1, acc2 = _online_softmax(
            kb1, kb2, vb1, vb2, ok, rq1, rq2, running_max, total, acc1, acc2, SCALE_LOG2
        )
    for j in range(start + BLOCK_L, end, BLOCK_L):
        idx = j + tl.arange(0, BLOCK_L)
        at = idx.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
        kb1, kb2, vb1, vb2 = _load_block(keys, values, at, idx < end, HALF)
        running_max, total, acc1, acc2 = _online_softmax(
            kb1, kb2, vb1, vb2, idx < end, rq1, rq2, running_max, total, acc1, acc2, SCALE_LOG2
        )
    # Partials: [SPLITS, HEADS * HEAD_DIM] outputs, then [SPLITS, HEADS] maxima and sums.
    parts = act_ptr + parts_off
    tl.store(parts + split * HEADS * HEAD_DIM + head * HEAD_DIM + d, acc1)
    tl.store(parts + split * HEADS * HEAD_DIM + head * HEAD_DIM + HALF + d, acc2)
    stats = parts + SPLITS * HEADS * HEAD_DIM + split * HEADS + head
    tl.store(stats, running_max)
    tl.store(stats + SPLITS * HEADS, total)
    tl.debug_barrier()
    finished = tl.atomic_add(counters_ptr + head_counters + head, 1, sem="acq_rel", scope="gpu")
    if finished == SPLITS - 1:  # the head's last split: combine them (all visible now)
        every = tl.arange(0, SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        maxima = tl.load(parts + SPLITS * HEADS * HEAD_DIM + every * HEADS + head,
                         cache_modifier=".cg")  # fmt: skip
        sums = tl.load(parts + SPLITS * HEADS * (HEAD_DIM + 1) + every * HEADS + head,
                       cache_modifier=".cg")  # fmt: skip
        outs = tl.load(parts + every[:, None] * HEADS * HEAD_DIM + head * HEAD_DIM + dims[None, :],
                       cache_modifier=".cg")  # fmt: skip
        weight = tl.exp2(maxima - tl.max(maxima, axis=0))
        merged = tl.sum(weight[:, None] * outs, axis=0) / tl.sum(weight * sums, axis=0)
        tl.store(act_ptr + out_off + head * HEAD_DIM + dims, merged)
    _publish(counters_ptr, stage)


@jit
def _fused_decode_kernel(
    base_ptr, act_ptr, tasks_ptr, matrices_ptr, layers_ptr, stages_ptr, waits_ptr,
    counters_ptr, token_ptr, pos_ptr, best_ptr, logprobs_ptr, trace_ptr, prefetch_ptr, num_tasks,
    max_len, embed_off, inv_freq_off, partials_off, lse_off, logits_off, vocab, combine_stage,
    DIM: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, GATED_ROWS: tl.constexpr,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_V: tl.constexpr, SPLITS: tl.constexpr,
    EPS: tl.constexpr, SCALE_LOG2: tl.constexpr, ROPE_SCALE: tl.constexpr, PIPELINE: tl.constexpr,
    WAIT_IN_LOOP: tl.constexpr, TRACE: tl.constexpr, STATIC: tl.constexpr, PARTS: tl.constexpr,
    STRIP_TOPS: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    """Each program takes tasks (kind, index, tile) from the counter until none is left (a
    relaxed increment: the order of tasks needs no memory ordering, the waits carry it). A
    program takes its next task, and loads its table row, as it starts one, so neither round
    trip is paid between tasks. Holding two tasks cannot deadlock: the earliest unfinished task
    is always some program's current one (its program's earlier task is done), and it waits
    only for earlier tasks. ``STATIC``: program p is dealt tasks p, p + P, ... (no counter, so
    no atomic and no barrier a task); the same argument holds while every program runs (the
    earliest unfinished task's program has finished its earlier ones)."""
    if STATIC:
        task = tl.program_id(0)
    else:
        task = tl.atomic_add(counters_ptr, 1, sem="relaxed")
    more = task < num_tasks
    kind = tl.load(tasks_ptr + 3 * task, mask=more, other=-1)
    index = tl.load(tasks_ptr + 3 * task + 1, mask=more, other=0)
    tile = tl.load(tasks_ptr + 3 * task + 2, mask=more, other=0)
    # PREFETCH: the weights the program's next task reads first (its table row, as each task's
    # own, loaded a task ahead; rows 0: none).
    if PREFETCH:
        pf_at, pf_up, pf_rows, pf_stride, pf_width = _prefetch_row(prefetch_ptr, task, more)
    while task < num_tasks:
        # Traced: each task's row of stamps (TRACE_FIELDS wide, the columns numbered as in
        # ``Stamp``); untraced, they compile to nothing.
        trace_row = trace_ptr + 10 * task
        if TRACE:
            tl.store(trace_row, tl.inline_asm_elementwise(  # Stamp.START_NS
                "mov.u64 $0, %globaltimer;", "=l,r", [task], dtype=tl.int64, is_pure=False,
                pack=1))  # fmt: skip
            tl.store(trace_row + 6, tl.inline_asm_elementwise(  # Stamp.SM
                "mov.u32 $0, %smid;", "=r,r", [task], dtype=tl.int32, is_pure=False,
                pack=1).to(tl.int64))  # fmt: skip
        _stamp(trace_row, 1, task, TRACE)  # Stamp.START
        if STATIC:  # every program's P-th task: no round trip, no barrier
            following = task + tl.num_programs(0)
        else:  # one thread's atomic, its result broadcast through shared memory
            following = tl.atomic_add(counters_ptr, 1, sem="relaxed")
        more = following < num_tasks
        next_kind = tl.load(tasks_ptr + 3 * following, mask=more, other=-1)
        next_index = tl.load(tasks_ptr + 3 * following + 1, mask=more, other=0)
        next_tile = tl.load(tasks_ptr + 3 * following + 2, mask=more, other=0)
        if PREFETCH:  # asked for first: the program's next task's weights stream during this one
            _prefetch(base_ptr, pf_at, pf_up, pf_rows, pf_stride, pf_width, ROWS, CHUNK, LINE)
            pf_at, pf_up, pf_rows, pf_stride, pf_width = _prefetch_row(prefetch_ptr, following,
                                                                        more)  # fmt: skip
        if kind == 1:  # MATVEC: a plain tile, or a gated one (gate and up rows: half as many)
            meta = matrices_ptr + index * 22
            if tl.load(meta + 10) >= 0:
                _matvec(base_ptr, act_ptr, stages_ptr, waits_ptr, counters_ptr, meta, tile,
                        best_ptr, token_ptr, pos_ptr, max_len, partials_off, lse_off,
                        combine_stage, CHUNK, GATED_ROWS, True, EPS, trace_row, BLOCK_V,
                        PIPELINE, WAIT_IN_LOOP, TRACE, PARTS, DIM, STRIP_TOPS)  # fmt: skip
            else:
                _matvec(base_ptr, act_ptr, stages_ptr, waits_ptr, counters_ptr, meta, tile,
                        best_ptr, token_ptr, pos_ptr, max_len, partials_off, lse_off,
                        combine_stage, CHUNK, ROWS, False, EPS, trace_row, BLOCK_V,
                        PIPELINE, WAIT_IN_LOOP, TRACE, PARTS, DIM, STRIP_TOPS)  # fmt: skip
        elif kind == 2:  # ATTEND: tile = query head * SPLITS + split
            _attend(base_ptr, act_ptr, waits_ptr, counters_ptr, layers_ptr + index * 8, tile,
                    pos_ptr, max_len, inv_freq_off, HEADS, KV_HEADS, HEAD_DIM, BLOCK_L, SPLITS,
                    trace_row, SCALE_LOG2, ROPE_SCALE, TRACE)  # fmt: skip
        elif kind == 0:  # EMBED: the token's row into the stream (stage 0, index: its offset)
            cols = tl.arange(0, CHUNK)
            token = tl.load(token_ptr)
            row = tl.load(base_ptr + embed_off + token * DIM + cols, mask=cols < DIM, other=0.0)
            tl.store(act_ptr + index + cols, row.to(tl.float32), mask=cols < DIM)
            _publish(counters_ptr, 0)
        else:  # LOGPROB: logits minus the log-sum-exp, once the combine has run (index: its wait)
            _stamp(trace_row, 2, _wait(counters_ptr, waits_ptr, index), TRACE)  # Stamp.WAITED
            rows = tile * BLOCK_V + tl.arange(0, BLOCK_V)
            lse = tl.load(act_ptr + lse_off, cache_modifier=".cg")
            logits = tl.load(act_ptr + logits_off + rows, mask=rows < vocab, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
            tl.store(logprobs_ptr + rows, logits - lse, mask=rows < vocab)
        _stamp(trace_row, 5, following, TRACE)  # Stamp.END
        if TRACE:
            tl.store(trace_row + 7, tl.inline_asm_elementwise(  # Stamp.END_NS
                "mov.u64 $0, %globaltimer;", "=l,r", [following], dtype=tl.int64,
                is_pure=False, pack=1))  # fmt: skip
        task, kind, index, tile = following, next_kind, next_index, next_tile


# -- the plan --------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class FusedDecodeStep:
    """The fused step of ``weights`` for the token in ``token_1`` at the position in
    ``position_1`` (int64 device tensors of one element, read when the step runs): a call
    writes the key and value at that position of every layer's cache, returns (fp32
    log-probabilities [1, vocab], [2, 1] float64 of the argmax token and its log-probability)
    in buffers it reuses, and leaves the next step's inputs in ``token_1`` (the argmax) and
    ``position_1`` (one further, at most the cache's last index). No host synchronisation: a
    call can be captured in a CUDA graph.

    Tiles hold about ``tile_elements`` weights (rows of the model's width, a power of two);
    each query head attends in ``splits`` tasks (default: enough that each covers at most two
    ``block_l`` blocks of the whole cache, at most 16); ``programs`` defaults to
    ``programs_per_sm`` per streaming multiprocessor. A matrix task is a strip of consecutive
    row blocks, so that each stage is about ``waves`` tasks a program (``waves`` None: one
    tile a task): a strip pays the task's round trips (the counter, its table rows, the wait, the
    input) once and streams its blocks through a loop pipelined ``pipeline`` deep (``pipeline``
    - 1 tiles in flight a program, in shared memory). ``trace``: every task also stamps its
    multiprocessor's cycle counter at its start, its wait's start and end, its input's arrival,
    its strip's end and its end (and the global timer at its start and end) into ``stamps``
    ([tasks, TRACE_FIELDS] int64), each stamp taking a value computed by what it follows, so
    it cannot be issued early; benchmarks/fused_trace.py reads them. A CUDA device only (the
    clocks are read in inline PTX); untraced, no stamp is compiled in. ``schedule``: tasks
    taken from a global counter ("dynamic": one thread's atomic a task, its result broadcast
    to the program's threads through shared memory between two barriers) or dealt round-robin
    ("static": program p runs tasks p, p + P, ...; no round trip, but every program must be
    running at once, since one waits for tasks dealt to others; None: "static" where every
    program can be resident, "dynamic" under the interpreter, which runs programs one after
    another). ``reader_sums``: the down projection's chunks only write their partial sums,
    and every reader of the stream they make (the next layer's q/k/v input and o's residual,
    the head's input) loads the partials and the residual after them and adds them, in the
    order the last chunk would have; so no down task pays the round trip of counting its
    strip's finished chunks, and no strip waits for its last chunk to add them up.
    ``small_waves``: the tasks a program in the attention's matrix stages (q/k/v, o), which are
    smaller than the MLP's: at one, each program streams one longer strip there instead of some
    programs taking two tasks while the rest wait (None: ``waves`` there too; it matters only
    with ``waves`` above one, the default being one everywhere). ``strip_tops``: each head task
    combines its strip's row blocks' (max, sum of exponentials, argmax) into one triple, so the
    head's last task combines one a strip instead of one a block. ``prefetch``: each task, as it
    starts, asks L2 (``prefetch.global.L2``, one hint a 128-byte line) for the first
    ``prefetch`` row blocks of its program's next task (round-robin, so the plan knows it: a
    table row a task), so that memory keeps streaming while a program waits for its input; a
    hint, which changes no result. CUDA and the static schedule only; 0 (the default): none.
    Not yet timed in this form (s53 had no GPU): s41's form, under the counter's schedule at two
    waves, was 3-14% slower (benchmarks/RESULTS.md)."""

    def __init__(
        self,
        weights: DecodeWeights,
        token_1: torch.Tensor,
        position_1: torch.Tensor,
        tile_elements: int = DEFAULT_TILE,
        block_l: int = 64,
        splits: int | None = None,
        num_warps: int = DEFAULT_WARPS,
        programs_per_sm: int = DEFAULT_PER_SM,
        programs: int | None = None,
        waves: int | None = DEFAULT_WAVES,
        pipeline: int = DEFAULT_PIPELINE,
        wait_in_loop: bool = DEFAULT_WAIT_IN_LOOP,
        count_signalled_stages: bool = False,
        trace: bool = False,
        schedule: str | None = None,
        reader_sums: bool = DEFAULT_READER_SUMS,
        small_waves: int | None = None,
        strip_tops: bool = DEFAULT_STRIP_TOPS,
        prefetch: int = DEFAULT_PREFETCH,
    ) -> None:
        if triton is None:
            raise RuntimeError("the fused decode step is a Triton kernel: pip install triton")
        w = self.weights = weights
        self.check(w)
        first = w.layers[0]
        dim, ffn = w.embed.shape[1], first.gate.shape[0]
        max_len = weights.layers[0].k_cache.shape[1]
        if splits is None:  # enough that a split holds at most two key blocks of the cache
            splits = min(MAX_SPLITS, _pow2(-(-max_len // (2 * block_l))))
        for name, value in (("tile_elements", tile_elements), ("splits", splits),
                            ("block_l", block_l)):  # fmt: skip
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two; got {value}")
        if pipeline < 1:
            raise ValueError(f"pipeline must be at least 1; got {pipeline}")
        self.pipeline, self.wait_in_loop, self.strip_tops = pipeline, wait_in_loop, strip_tops
        if trace and w.embed.device.type == "cpu":
            raise ValueError("trace=True reads the GPU's clocks in inline PTX, which Triton's "
                             "interpreter (CPU tensors) does not run: trace on a CUDA device")  # fmt: skip
        self.trace = trace
        if schedule not in (None, "dynamic", "static"):
            raise ValueError(f"schedule must be 'dynamic' or 'static'; got {schedule!r}")
        if waves is not None and waves < 1:
            raise ValueError(f"waves must be at least 1 (or None: one tile a task); got {waves}")
        if small_waves is not None and (waves is None or small_waves < 1):
            raise ValueError("small_waves sizes the strips of the attention's matrices (q/k/v "
                             "and o) apart from waves, so it needs waves and must be at least "
                             f"1; got small_waves={small_waves}, waves={waves}")  # fmt: skip
        device = w.embed.device
        sms = num_persistent_programs(device) if device.type == "cuda" else 1
        self.programs = programs or programs_per_sm * sms
        not_resident = None  # why round-robin would hang here, if it would
        if device.type == "cpu" and self.programs > 1:
            not_resident = ("a static schedule needs its programs running at once (a program "
                            "waits for tasks dealt to the others); Triton's interpreter (CPU "
                            "tensors) runs them one after another: use schedule='dynamic' or "
                            "programs=1 there")  # fmt: skip
        elif device.type == "cuda":
            # Round-robin programs wait for one another, so all must be resident at once, or
            # the step never ends. Sufficient (registers are at most 255 a thread): 8 warps an
            # SM (65,536 registers), and the strips' copies in flight within shared memory.
            per_sm = -(-self.programs // sms)
            copies = (pipeline - 1) * 2 * tile_elements * w.embed.element_size() + 1024
            if per_sm * num_warps > 8 or per_sm * copies > 227 * 1024:
                not_resident = (
                    f"schedule='static' needs every program resident at once; {per_sm} programs "
                    f"an SM of {num_warps} warps and ~{copies // 1024} KB of copies in flight "
                    "may not be (at most 8 warps and 227 KB an SM): use fewer programs or "
                    "schedule='dynamic'"
                )
        if schedule is None:
            schedule = "dynamic" if device.type == "cpu" or not_resident else "static"
        self.static = schedule == "static"
        if self.static and not_resident:
            raise ValueError(not_resident)
        if prefetch < 0:
            raise ValueError(f"prefetch must be at least 0 (row blocks); got {prefetch}")
        if prefetch and (device.type == "cpu" or not self.static):
            raise ValueError(
                "prefetch asks L2 for the program's next task's weights in inline PTX, so it "
                "needs a CUDA device (Triton's interpreter does not run PTX) and the static "
                "schedule (whose next task is known when the plan is made); got "
                f"{device.type} and schedule={'static' if self.static else 'dynamic'}: use "
                "prefetch=0 there"
            )
        self.prefetch = prefetch
        self.waves = waves
        # Every tile reads one CHUNK-wide slice of its input (the model's width: a normed
        # input is whole in one chunk); wider inputs (the down projection's) take several.
        self.dim, self.chunk = dim, _pow2(dim)
        self.rows = max(1, tile_elements // self.chunk)
        self.gated_rows = max(1, self.rows // 2)
        self.block_v = 1024
        self.token_1, self.position_1 = token_1, position_1
        self.max_len = max_len
        self.num_warps = num_warps
        # Offsets from the lowest-addressed tensor: all >= 0, so -1 can mean "none".
        base = self.base = min(self._tensors(w), key=torch.Tensor.data_ptr)

        def offset(t: torch.Tensor | None) -> int:
            if t is None:
                return -1
            gap = t.data_ptr() - base.data_ptr()
            if gap % (16 * base.element_size()):
                raise ValueError("the fused decode step reads tensors at addresses 16 elements "
                                 f"apart; one is {gap} bytes from the first")  # fmt: skip
            return gap // base.element_size()

        # Scratch: inv_freq, the stream after the embedding, then every stage's outputs.
        cursor = 0

        def take(n: int) -> int:  # n fp32 values at an offset that is a multiple of 16
            nonlocal cursor
            start, cursor = cursor, cursor + -(-n // 16) * 16
            return start

        # Counters after the task counter and the stages' counts (placed once all are known):
        # each (layer, head)'s finished splits, each chunked strip's finished chunks.
        extra = 0

        def counters(n: int) -> int:
            nonlocal extra
            extra += n
            return extra - n

        inv_freq_off = take(w.head_dim // 2)
        h = take(dim)
        stages = [1]  # stage 0: the embedding
        tasks: list[tuple[int, int, int]] = [(EMBED, h, 0)]
        matrices: list[list[int]] = []
        layers: list[list[int]] = []
        # Waits: (counter, the count it must reach, whether the counter is an extra one).
        waits: list[list[int]] = []

        def stage_of(count: int) -> int:
            stages.append(count)
            return len(stages) - 1

        def wait_for(stage: int) -> int:  # a wait for every task of a stage
            waits.append([1 + stage, stages[stage], 0])
            return len(waits) - 1

        def waits_for(first: int, needs: list[int]) -> int:  # one wait an extra counter
            waits.extend([first + i, need, 1] for i, need in enumerate(needs))
            return len(waits) - len(needs)

        Entry = tuple[torch.Tensor, torch.Tensor | None, int, int, int, int]
        Signal = tuple[int, int, list[int]]  # first counter, its slots, rows a slot per entry

        def matrix_stage(entries: list[Entry], wait: int, head: bool = False,
                         wait_stride: int = 0, signal: Signal | None = None,
                         order=None, x_parts: int = 1, resid_parts: int = 1,
                         parts_at: int | None = None,
                         waves: int | None = None) -> tuple[int, list[int]]:  # fmt: skip
            """One stage of matrices: (weight, up weight of a gated one, input offset, output
            offset, residual offset, norm weight offset). A task waits for wait ``wait`` (plus
            ``wait_stride`` times its chunk); with ``signal`` each also counts itself in the
            counters of the slots its rows fall in (row r of entry e: slot r // rows[e]), so
            a reader of some rows can wait for those alone. ``order(entry, strip, chunk,
            first slot)``: the key the stage's tasks are sorted by (default: as built). Returns
            the stage and how many tasks count in each slot. ``x_parts`` and ``resid_parts``:
            how many parts the input and the residual are summed from; ``parts_at``: where a
            chunked matrix writes its partials, which its readers sum (no last chunk does).
            ``waves``: the stage's tasks a program, if not the step's ``waves``."""
            first_task = len(tasks)
            shapes = [(-(-m.shape[1] // self.chunk),  # chunks, row blocks
                       -(-m.shape[0] // (self.rows if up is None else self.gated_rows)))
                      for m, up, *_ in entries]  # fmt: skip
            strip = self._strip(sum(chunks * blocks for chunks, blocks in shapes), waves)
            needs = [0] * (signal[1] if signal else 0)
            keyed = []
            for e, ((weight, up, x_off, y_off, resid, norm), (chunks, blocks)) in enumerate(
                zip(entries, shapes)
            ):
                n, k = weight.shape
                strips = -(-blocks // strip)
                if chunks == 1:  # whole rows: no partials
                    parts, finished = -1, 0
                elif parts_at is not None:  # partials its readers sum: no count of chunks
                    parts, finished = parts_at, -1
                else:  # partials the strip's last chunk sums, once its count says so
                    parts, finished = take(chunks * n), counters(strips)
                span = strip * (self.rows if up is None else self.gated_rows)
                per_slot = signal[2][e] if signal else 1
                assert not (signal and chunks > 1), "a chunked matrix's rows are whole once summed"
                matrices.append([offset(weight), n, k, x_off, y_off, resid, norm, wait,
                                 len(stages), int(head), offset(up), chunks, parts, finished,
                                 strip, blocks, wait_stride, signal[0] if signal else -1,
                                 per_slot, int(signal is None or count_signalled_stages),
                                 x_parts, resid_parts])  # fmt: skip
                for j in range(strips * chunks):
                    lo = (j // chunks) * span
                    slots = range(lo // per_slot, (min(n, lo + span) - 1) // per_slot + 1)
                    for slot in slots if signal else ():
                        needs[slot] += 1
                    key = order(e, j // chunks, j % chunks, slots[0]) if order else 0
                    keyed.append((key, (MATVEC, len(matrices) - 1, j)))
            keyed.sort(key=lambda pair: pair[0])  # stable: ties keep the built order
            tasks.extend(task for _, task in keyed)
            return stage_of(len(tasks) - first_task), needs

        wait = wait_for(0)
        hd, group = w.head_dim, w.heads // w.kv_heads
        # reader_sums: the down projection's chunks leave partials that no task adds up; the
        # stream after a layer is those partials and the residual (o's output) after them,
        # DIM apart, and its readers (the next layer's q/k/v and o, the head) sum them.
        down_chunks = -(-ffn // self.chunk)
        self.parts = down_chunks + 1 if reader_sums and down_chunks > 1 else 1
        h_parts = 1  # the embedding's stream: one vector
        for layer in w.layers:
            qkv = take((w.heads + 2 * w.kv_heads) * hd)
            k_off, v_off = qkv + w.heads * hd, qkv + (w.heads + w.kv_heads) * hd
            norm = offset(layer.attention_norm)
            # q, k and v count their rows in one counter a kv group, their tasks sorted by
            # group: a query head attends once its group's rows are in, not the whole stage.
            groups = counters(w.kv_heads)
            stage, needs = matrix_stage(
                [(layer.q, None, h, qkv, -1, norm), (layer.k, None, h, k_off, -1, norm),
                 (layer.v, None, h, v_off, -1, norm)], wait,
                signal=(groups, w.kv_heads, [group * hd, hd, hd]),
                order=lambda e, strip, chunk, slot: slot, x_parts=h_parts, waves=small_waves,
            )  # fmt: skip
            parts = take(splits * (w.heads * hd + 2 * w.heads))  # the splits' partials
            out = take(w.heads * hd)
            stage = stage_of(w.heads * splits)
            layers.append([qkv, offset(layer.k_cache), offset(layer.v_cache), parts, out,
                           waits_for(groups, needs), stage, counters(w.heads)])  # fmt: skip
            tasks.extend((ATTEND, len(layers) - 1, j) for j in range(w.heads * splits))
            stream = take(self.parts * dim)  # (reader_sums: the partials, then o's output)
            h_mid = stream + (self.parts - 1) * dim
            stage, _ = matrix_stage([(layer.o, None, out, h_mid, h, -1)], wait_for(stage),
                                    resid_parts=h_parts, waves=small_waves)  # fmt: skip
            # The gated rows count in one counter a chunk of the down projection's input, whose
            # tasks go chunk by chunk: chunk 0's start while the last gated rows are written.
            gated = take(ffn)  # silu(gate) * up
            slots = -(-ffn // self.chunk)
            chunks = counters(slots)
            stage, needs = matrix_stage(
                [(layer.gate, layer.up, h_mid, gated, -1, offset(layer.mlp_norm))],
                wait_for(stage), signal=(chunks, slots, [self.chunk]),
            )  # fmt: skip
            if self.parts > 1:  # the partials at the stream, no residual added
                h, h_parts, parts_at = stream, self.parts, stream
                entry = (layer.down, None, gated, stream, -1, -1)
            else:
                h, parts_at = take(dim), None
                entry = (layer.down, None, gated, h, h_mid, -1)
            stage, _ = matrix_stage([entry], waits_for(chunks, needs), wait_stride=1,
                                    order=lambda e, strip, chunk, slot: chunk,
                                    parts_at=parts_at)  # fmt: skip
            wait = wait_for(stage)
        vocab = w.head.shape[0]
        logits = take(vocab)
        matrix_stage([(w.head, None, h, logits, -1, offset(w.norm))], wait, head=True,
                     x_parts=h_parts)  # fmt: skip
        # Each head block's max, sum of exponentials and argmax, then each head strip's.
        head_blocks, head_strip = matrices[-1][15], matrices[-1][14]
        self.partials_off = take(3 * (head_blocks + -(-head_blocks // head_strip)))
        self.lse_off = take(1)
        combine = stage_of(1)
        combined = wait_for(combine)
        tasks.extend((LOGPROB, combined, j) for j in range(-(-vocab // self.block_v)))
        for row in layers:
            row[7] += 1 + len(stages)
        for row in matrices:
            row[13] += (1 + len(stages)) if row[13] >= 0 else 0
            row[17] += (1 + len(stages)) if row[17] >= 0 else 0
        for row in waits:
            row[0] += (1 + len(stages)) if row.pop() else 0
        # A stage whose tasks do not count in its counter (_publish_rows): nothing may wait
        # for its count.
        uncounted = {1 + row[8] for row in matrices if not row[19]}
        assert not uncounted & {counter for counter, _ in waits}, "a wait on an uncounted stage"
        self.act = torch.zeros(cursor, device=device, dtype=torch.float32)
        self.act[inv_freq_off : inv_freq_off + hd // 2] = w.inv_freq.float()
        self.logprobs_1V = torch.empty(1, vocab, device=device, dtype=torch.float32)
        self.best_21 = torch.empty(2, 1, device=device, dtype=torch.float64)
        i32, i64 = torch.int32, torch.int64
        # The kernel spells these widths as literals (a jit function reads no plain globals).
        assert len(matrices[0]) == MATRIX_FIELDS and len(layers[0]) == LAYER_FIELDS
        assert TRACE_FIELDS == 10
        assert all(len(task) == TASK_FIELDS for task in tasks[:1])
        self.tasks = torch.tensor(tasks, dtype=i32, device=device)
        self.matrices = torch.tensor(matrices, dtype=i64, device=device)
        self.layers = torch.tensor(layers, dtype=i64, device=device)
        self.stages = torch.tensor(stages, dtype=i32, device=device)
        self.waits = torch.tensor(waits, dtype=i32, device=device)
        self.counters = torch.zeros(1 + len(stages) + extra, dtype=i32, device=device)
        self.prefetches = torch.tensor(self._prefetch_table(tasks, matrices) if prefetch else [0],
                                       dtype=i64, device=device)  # fmt: skip
        # Traced: a row of TRACE_FIELDS stamps a task (benchmarks/fused_trace.py reads them),
        # else one element the kernel never writes.
        self.stamps = torch.zeros(len(tasks) * TRACE_FIELDS if trace else 1, dtype=i64,
                                  device=device)  # fmt: skip
        self.scalars = (len(tasks), self.max_len, offset(w.embed), inv_freq_off,
                        self.partials_off, self.lse_off, logits, vocab, combine)  # fmt: skip
        self.block_l, self.splits = block_l, splits

    def _prefetch_table(self, tasks: list[tuple[int, int, int]],
                        matrices: list[list[int]]) -> list[int]:  # fmt: skip
        """Each task's row of PREFETCH_FIELDS: what the program's next task (round-robin: this
        one plus the count of programs) reads first, when it is a matrix task: its first
        ``self.prefetch`` row blocks' weights (and its up weights', else -1) over its slice of
        the input, as (first weight, first up weight, rows, row stride, width); else rows 0."""
        table = []
        for t in range(len(tasks)):
            following = t + self.programs
            kind, index, tile = tasks[following] if following < len(tasks) else (EMBED, 0, 0)
            if kind != MATVEC:
                table += [0, -1, 0, 0, 0]
                continue
            m = matrices[index]
            w_off, n, k, up, chunks, strip = m[0], m[1], m[2], m[10], m[11], m[14]
            rows = self.rows if up < 0 else self.gated_rows
            first, chunk = (tile // chunks) * strip, tile % chunks
            lo, hi = first * rows, min(n, (first + min(strip, self.prefetch)) * rows)
            at = lo * k + chunk * self.chunk
            table += [w_off + at, up + at if up >= 0 else -1, hi - lo, k,
                      min(self.chunk, k - chunk * self.chunk)]  # fmt: skip
        assert len(table) == PREFETCH_FIELDS * len(tasks)
        return table

    def _strip(self, tiles: int, waves: int | None = None) -> int:
        """Row blocks a task streams in a stage of ``tiles`` tiles: one (a task a tile) without
        ``self.waves``, else enough that the stage is about ``waves`` (default ``self.waves``)
        tasks a program."""
        if self.waves is None:
            return 1
        return max(1, -(-tiles // (self.programs * (waves or self.waves))))

    @staticmethod
    def _tensors(w: DecodeWeights) -> list[torch.Tensor]:
        return [w.embed, w.norm, w.head] + [t for layer in w.layers for t in vars(layer).values()]

    @classmethod
    def check(cls, w: DecodeWeights) -> None:
        """ValueError naming what in ``w`` the kernel cannot read (dtypes, devices, layout,
        head shape, widths), else None."""
        tensors = cls._tensors(w)
        if any(t.dtype != w.embed.dtype or t.device != w.embed.device for t in tensors):
            raise ValueError("the fused decode step reads every tensor in one dtype on one device")
        if any(not t.is_contiguous() for t in tensors):
            raise ValueError("the fused decode step reads contiguous tensors only")
        hd = w.head_dim
        if hd < 2 or hd & (hd - 1) or w.heads % w.kv_heads:
            raise ValueError(
                f"the fused decode step needs a power-of-two head_dim and query heads a multiple "
                f"of the kv heads; got head_dim {hd}, {w.heads} heads, {w.kv_heads} kv heads"
            )
        widths = {"model width": w.embed.shape[1], "head_dim": hd,
                  "query width": w.heads * hd, "MLP width": w.layers[0].gate.shape[0]}  # fmt: skip
        if any(v % 16 for v in widths.values()):
            raise ValueError("the fused decode step reads rows 16 elements at a time (every "
                             "width a multiple of 16); got "
                             + ", ".join(f"{k} {v}" for k, v in widths.items()))  # fmt: skip

    def constants(self) -> dict[str, object]:
        """The kernel's constexpr arguments for these weights."""
        w = self.weights
        return {
            "DIM": self.dim, "CHUNK": self.chunk, "ROWS": self.rows,
            "GATED_ROWS": self.gated_rows, "HEADS": w.heads, "KV_HEADS": w.kv_heads,
            "HEAD_DIM": w.head_dim, "BLOCK_L": self.block_l, "BLOCK_V": self.block_v,
            "SPLITS": self.splits, "EPS": w.eps, "SCALE_LOG2": w.head_dim**-0.5 * _LOG2E,
            "ROPE_SCALE": w.rope_scale, "PIPELINE": self.pipeline,
            "WAIT_IN_LOOP": self.wait_in_loop, "TRACE": self.trace, "STATIC": self.static,
            "PARTS": self.parts, "STRIP_TOPS": self.strip_tops, "PREFETCH": self.prefetch > 0,
            "LINE": min(self.chunk, 128 // self.base.element_size()),
        }  # fmt: skip

    def sm90_arguments(self) -> tuple:
        """(kernel, argument types, constants, warps) of this step's launch, for
        kernels/triton_support.compile_for_hopper / compile_sm90 (no GPU needed)."""
        pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
        types = {"base_ptr": pointer[self.base.dtype], "act_ptr": "*fp32", "tasks_ptr": "*i32",
                 "matrices_ptr": "*i64", "layers_ptr": "*i64", "stages_ptr": "*i32",
                 "waits_ptr": "*i32", "counters_ptr": "*i32", "token_ptr": "*i64",
                 "pos_ptr": "*i64", "best_ptr": "*fp64", "logprobs_ptr": "*fp32",
                 "trace_ptr": "*i64", "prefetch_ptr": "*i64", "num_tasks": "i32",
                 "max_len": "i32", "embed_off": "i64", "inv_freq_off": "i32",
                 "partials_off": "i32", "lse_off": "i32", "logits_off": "i32", "vocab": "i32",
                 "combine_stage": "i32"}  # fmt: skip
        return _fused_decode_kernel, types, self.constants(), self.num_warps

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.counters.zero_()
        _fused_decode_kernel[(self.programs,)](
            self.base, self.act, self.tasks, self.matrices, self.layers, self.stages,
            self.waits, self.counters, self.token_1, self.position_1, self.best_21,
            self.logprobs_1V, self.stamps, self.prefetches, *self.scalars, **self.constants(), num_warps=self.num_warps,
        )  # fmt: skip
        return self.logprobs_1V, self.best_21
