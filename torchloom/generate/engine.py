"""The generator: the trained model's own forward with its generation state (each layer's
own kind, ``model.new_cache``), continuous batching, sampling, stop tokens, and each generated
token's log-probability.

Requests wait in a queue (``submit``); each ``step`` is one scheduling round: when cache slots
are free, waiting requests are prefilled together (right-padded; requests admitted together with
the same prompt, like an RL group, share one prefill; when the rows are short, the active
requests advance one token in the same forward); otherwise every active request advances one
token. A request leaves as soon as it stops, and its slot takes the next waiting request in
the following round. ``generate(requests)`` submits and steps until they are done.

A sampled token's log-probability is that of the distribution it was drawn from (the fp32
log-softmax of the logits, divided by the temperature, restricted to what top-k and top-p keep
and renormalised: ``sampling.sampling_logprobs``); a greedy token's is the model's own. So an
RL trainer scoring the same tokens with the same settings gets the same numbers.

A request may keep its slot when it finishes (``keep_slot``): the slot then holds every
layer's state of its prompt and completion, and a later request that ``continues`` it (its
prompt extends that prompt and completion, as a multi-turn conversation's next turn does)
prefills only the tokens past them. ``release(id)`` gives a kept slot back; when a new request
finds no free slot, the oldest kept one is evicted (its continuation is then prefilled whole).
"""

from __future__ import annotations

import functools
import heapq
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchloom.config.errors import ConfigError
from torchloom.data.mrope import mrope_positions
from torchloom.generate.fused_step import fused_step_problem
from torchloom.generate.graphs import DecodeGraphs, DecodeStep
from torchloom.generate.requests import (
    Completion,
    Request,
    media_problem,
    outside,
    plain,
    too_long,
)
from torchloom.generate.requests import SamplingParams as SamplingParams  # the API, here too
from torchloom.generate.sampling import sample_rows
from torchloom.generate.weights import Weights, copy_weights_
from torchloom.kernels.decode_attention import IMPLS as DECODE_ATTENTION_IMPLS
from torchloom.kernels.log_softmax import IMPLS as SCORE_IMPLS
from torchloom.kernels.log_softmax import log_softmax_argmax, log_softmax_argmax_reference
from torchloom.kernels.triton_support import cuda_index, triton
from torchloom.models.components.cache import ModelCache
from torchloom.models.components.fused_linear import fuse_projections_
from torchloom.models.components.moe import experts_reading_the_host
from torchloom.models.components.multimodal import MEDIA_KEYS, MultimodalDecoder, check_media

STEP_IMPLS = ("auto", "torch", "triton")
"""``Generator(step_kernel=...)``: how one sequence's decode step runs (the class docstring)."""

MIXED_PREFILL_TOKENS = 64
"""A prefill whose rows are at most this many tokens may also advance the active requests,
each as a row padded to that length (one forward instead of two)..."""

MIXED_PREFILL_PADDING = 1024
"""... as long as that padding (active rows x (longest row - 1)) stays within this many
tokens. Past it the active requests take their own decode step (a graph replay on the GPU)
after the prefill: with 512 decoding rows and a 50-token prompt, riding along would compute
25,000 token positions to advance 512 (an H200 countdown RL run spent ~60 ms a step so)."""


@dataclass
class _Active:
    id: int
    request: Request
    completion: Completion
    position: int
    """Position the next fed token takes (prompt length + tokens generated - 1)."""
    seed: int
    """Its random stream (torchloom/generate/sampling.py)."""
    start: int = 0
    """Prompt tokens already in its slot (a continuation's), which its prefill skips."""
    keep: bool = False
    """Keep the slot when it finishes (``Request.keep_slot``)."""


@dataclass
class _Kept:
    """A finished request's slot, kept for a continuation."""

    slot: int
    tokens: list[int]
    """Its prompt and completion; the slot holds the state after all but the last token (a
    sampled token is fed by the next forward, so the continuation's prefill starts with it)."""


class Generator:
    """Generates with ``model`` (any torchloom decoder) without changing its module mode (the
    forwards run under ``torch.no_grad()``; the models have no dropout).

    ``max_batch`` requests run at once (cache slots), each up to ``max_len`` tokens (prompt +
    generated; default the model's context). ``cuda_graphs`` (default: on a CUDA device)
    replays decode steps from CUDA graphs captured here, once per batch-size bucket;
    ``compile`` compiles those steps with inductor first (a minute or so, once per process),
    and runs q/k/v and gate/up as one matmul each (their weights become views of one stacked
    tensor: ``fuse_projections_``); so do CUDA graphs in batch-invariant mode, where stacking
    changes no bit (``batch_invariant.stacking_keeps_bits``).
    A tensor-parallel model (DTensor weights, see torchloom/generate/run.py) works too: each
    rank's layers hold their own share of the state and every rank gets the whole logits, so
    all ranks pick the same tokens; CUDA graphs are then off by default (not verified with
    collectives).

    ``decode_attention``: how attention layers attend one-token steps over their KV cache:
    "torch" (default) the masked matmul softmax; "auto" the Triton kernel of
    torchloom/kernels/decode_attention.py on CUDA (each row reads its own keys up to its
    position) and the masked matmul softmax elsewhere; "triton" the kernel (CPU tensors under
    TRITON_INTERPRET=1). "auto" becomes the default once its GPU test and benchmark have run
    on a GPU (docs/generate.md). Batch-invariant layers keep their own fixed-order kernel.
    ``score_kernel``: the same choice for each forward's log-softmax and argmax over the
    vocabulary (torchloom/kernels/log_softmax.py: split over the vocabulary, where PyTorch
    reduces a row in one thread block). In batch-invariant mode "auto" scores as the trainer
    does (PyTorch) and "triton" is refused.
    ``step_kernel``: how a decode step of one sequence (slot 0 alone) runs: "auto" (default)
    the one-launch step of torchloom/kernels/fused_decode.py where it can run on CUDA, the
    model's forward elsewhere (other families, batch-invariant mode, sharded weights, the CPU);
    "torch" the forward always; "triton" the one-launch step (Llama-shaped models only:
    generate/fused_step.py; CPU tensors under TRITON_INTERPRET=1), refused in one line where it
    cannot run. Its numbers are the forward's up to rounding (fp32 activations, not bitwise):
    pass "torch" where a batch-1 step must match the forward bit for bit. On an H100 it decodes
    the 1B model at batch 1 25% faster than the compiled forward (docs/generate.md).

    ``admit_batch`` (default ``max_batch // 8``, at least 1): while requests are decoding,
    waiting ones are admitted only once this many of them (or all, when fewer wait) find a
    slot, so slots freed one by one are refilled by one prefill, not one each. With nothing
    decoding, whatever fits is admitted at once.
    """

    def __init__(
        self,
        model: nn.Module,
        max_batch: int = 8,
        max_len: int | None = None,
        cuda_graphs: bool | None = None,
        compile: bool = False,
        admit_batch: int | None = None,
        decode_attention: str = "torch",
        score_kernel: str = "torch",
        step_kernel: str = "auto",
    ) -> None:
        if not (isinstance(model, nn.Module) and hasattr(model, "config")
                and hasattr(model, "new_cache")):  # fmt: skip
            raise TypeError(
                "model must be a torchloom decoder (an nn.Module with .config and .new_cache, "
                f"from build_model or torchloom.from_hf); got {type(model).__name__}"
            )
        # Without a cache slot no request is ever admitted: generate() would loop forever.
        if not _is_positive_int(max_batch):
            raise ValueError(f"max_batch (cache slots) must be an integer >= 1; got {max_batch!r}")
        if max_len is not None and not _is_positive_int(max_len):
            raise ValueError(f"max_len must be None or an integer >= 1; got {max_len!r}")
        self.model, self.config = model, model.config
        context = self.config.max_seq_len
        if max_len is not None and max_len > context:
            # As `torchloom generate` does: its cache never outgrows the model's context.
            raise ValueError(
                f"max_len {max_len} exceeds the model's context of {context} tokens "
                "(config.max_seq_len), past which it was never trained; pass at most "
                f"{context}, or None for the whole context (torchloom generate caps it there too)"
            )
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.max_len = max_len or context
        check_cache_fits(model, max_batch, self.max_len, self.device, self.dtype)
        if score_kernel not in SCORE_IMPLS:
            raise ValueError(
                f"score_kernel must be one of {SCORE_IMPLS} ('auto': the Triton kernels on "
                f"CUDA); got {score_kernel!r}"
            )
        if self.config.batch_invariant:
            if score_kernel == "triton":
                raise ValueError(
                    "score_kernel 'triton' and batch-invariant mode do not mix: its "
                    "log-probabilities sum in another order than the trainer's log-softmax, so "
                    "they would no longer match it bit for bit. Leave score_kernel 'auto' (which "
                    "scores as the trainer does in this mode) or pass 'torch'."
                )
            score_kernel = "torch"
        self._score = functools.partial(log_softmax_argmax, impl=score_kernel)
        if decode_attention not in DECODE_ATTENTION_IMPLS:
            raise ValueError(
                f"decode_attention must be one of {DECODE_ATTENTION_IMPLS} ('auto': the Triton "
                f"kernel on CUDA); got {decode_attention!r}"
            )
        self.cache = model.new_cache(max_batch, self.max_len, self.device, self.dtype)
        self.cache.decode_attention = decode_attention
        fused_step = _fused_step(step_kernel, model, self.cache)
        host_reads = _host_reads(model, self.dtype)
        if cuda_graphs is None:
            sharded = any(isinstance(p, DTensor) for p in model.parameters())
            cuda_graphs = self.device.type == "cuda" and not sharded and host_reads is None
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs the model on a CUDA device, not {self.device}")
        if cuda_graphs and host_reads is not None:
            raise ValueError(
                f"cuda_graphs cannot capture this model's decode step: {host_reads}. Leave "
                "cuda_graphs unset (it is then off for this model) or pass cuda_graphs=False."
            )
        if compile and self.config.batch_invariant:
            raise ValueError(
                "compile and batch-invariant mode do not mix: inductor fuses the pointwise ops "
                "between the fixed-order kernels and rounds them differently from the trainer's "
                "eager forward, so the log-probabilities would no longer match it bit for bit. "
                "Drop compile (CUDA graphs still replay the decode steps)."
            )
        if compile or (cuda_graphs and self.config.batch_invariant):
            # Decode reads every weight once a token; the small q/k/v ones stream far faster
            # stacked (models/components/fused_linear.py). Forwards with autograd keep the
            # separate matmuls, so a trainer sharing the model still trains every weight. In
            # batch-invariant mode only where stacking changes no bit (on sm_90 GPUs and the CPU
            # references), and only from CUDA graphs: RL's eager decode shares the trainer's
            # modules and leaves them as they are.
            fuse_projections_(model)
        # Prefills of text (images go eagerly) compiled too: an eager prefill of a 1B model is
        # hundreds of small kernels launched from Python, for one forward a request.
        self._compiled_prefill = None
        if compile:
            self._compiled_prefill = torch.compile(_text_forward(model), dynamic=True)
            # The cache's sizes never change: static, they cannot be duck-sized into a batch
            # that happens to equal the slots at the first compile (and recompile on the next).
            for tensor in self.cache.tensors():
                torch._dynamo.mark_static(tensor)
        self.graphs = None
        if cuda_graphs or compile or fused_step:
            self.graphs = DecodeGraphs(
                self.model, self.cache, self._score, capture=cuda_graphs, compile=compile,
                fused_step=fused_step,
            )  # fmt: skip
        if admit_batch is not None and not _is_positive_int(admit_batch):
            raise ValueError(f"admit_batch must be None or an integer >= 1; got {admit_batch!r}")
        self.admit_batch = admit_batch or max(1, max_batch // 8)
        self._waiting: deque[tuple[int, Request]] = deque()
        self._active: dict[int, _Active] = {}  # by slot
        self._free = list(range(max_batch))  # a heap: the lowest free slot goes first
        self._kept: dict[int, _Kept] = {}  # by request id, oldest first
        self._finished: list[tuple[int, Completion]] = []  # what the next step() reports
        self._next_id = 0
        self.prefill_tokens = 0  # prompt tokens run through prefill forwards (shared: once)
        self._ahead: DecodeStep | None = None  # a greedy step launched before the last was read

    # -- the API --------------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        """Queue ``request``; returns its id. A request that cannot run is reported by the next
        ``step()`` with finish_reason 'error' and its reason; one with a field of the wrong
        type raises TypeError here, and nothing is queued (torchloom/generate/requests.py)."""
        _check_types(request)
        return self._queue(request)

    def _queue(self, request: Request) -> int:
        request_id, self._next_id = self._next_id, self._next_id + 1
        problem = self._problem(request)
        if problem is None:
            self._waiting.append((request_id, plain(request)))
        else:
            self._finished.append((request_id, Completion(finish_reason="error", error=problem)))
            if request.continues in self._kept:  # its conversation ends here: nothing held
                self.release(request.continues)
        return request_id

    def step(self) -> list[tuple[int, Completion]]:
        """One scheduling round: admit waiting requests into slots (free, their kept one, or
        an evicted kept one) with one prefill, which also advances the active requests when
        its rows are short, or else advance every active request by one token (one forward;
        a no-op when idle).
        Returns (id, Completion) of the requests that finished in it, and of those refused by
        ``submit`` or ended by ``update_weights`` since the last step.
        Should a forward raise, the requests it admitted end with finish_reason 'error' (the
        next step reports them) and the exception propagates; running requests stay active."""
        with torch.no_grad():
            admitted = {}
            if self._admitting():
                self._settle()  # the step launched ahead comes before the new rows
                admitted = self._admit()
            if admitted:
                try:
                    mixed = self._prefill(admitted)
                except BaseException as error:  # an interrupt too: nothing vanishes
                    self._end_admitted(admitted, error)
                    raise
                try:
                    if not mixed and self._active:
                        self._decode()  # the requests already running, in their own step
                finally:
                    self._active.update(admitted)
            elif self._active:
                self._decode()
            self._release()
        finished, self._finished = self._finished, []
        return finished

    @property
    def idle(self) -> bool:
        """Nothing waiting, running, or finished and not yet reported by ``step()`` (kept
        slots do not count)."""
        return not (self._waiting or self._active or self._finished)

    @property
    def kept(self) -> list[int]:
        """Ids of the finished requests whose slots are kept for a continuation, oldest first."""
        return list(self._kept)

    def release(self, request_id: int) -> bool:
        """Done with request ``request_id``: its kept slot is given back; a request still
        waiting or running is dropped (no Completion is reported for it) and its slot freed.
        Returns whether it held anything (an unknown or already released id: False)."""
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            heapq.heappush(self._free, kept.slot)
            return True
        found = False
        for item in [w for w in self._waiting if w[0] == request_id]:
            self._waiting.remove(item)
            found = True
        for slot in [s for s, a in self._active.items() if a.id == request_id]:
            # A step launched ahead may hold its row: that row wrote only into this slot,
            # and the step is read with the active slots as its rows, so it is ignored.
            del self._active[slot]
            heapq.heappush(self._free, slot)
            found = True
        if not self._active:
            self._ahead = None
        finished = [f for f in self._finished if f[0] == request_id]
        self._finished = [f for f in self._finished if f[0] != request_id]
        return found or bool(finished)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """One Completion per request, in order. A bad request gets finish_reason 'error' and
        its reason; the others run normally (a field of the wrong type: TypeError, and none is
        queued). Requests submitted before keep running alongside; those that finish meanwhile
        are reported by the next ``step()``."""
        if isinstance(requests, Request):
            raise TypeError("generate takes a list of Requests; got one Request: pass [request]")
        for request in requests:  # before any is queued: all or none
            _check_types(request)
        ids = [self._queue(request) for request in requests]
        wanted = set(ids)
        results: dict[int, Completion] = {}
        others: list[tuple[int, Completion]] = []
        try:
            while len(results) < len(ids):
                for request_id, completion in self.step():
                    if request_id in wanted:
                        results[request_id] = completion
                    else:
                        others.append((request_id, completion))
        except BaseException:
            others += results.items()  # nothing is lost: the next step() reports them
            raise
        finally:
            self._finished += others
        return [results[i] for i in ids]

    def update_weights(self, weights: Weights, partial: bool = False) -> None:
        """Copy new weights into the model's parameters in place (same storage, so the cache,
        captured CUDA graphs and a compiled step stay valid), on each parameter's device.
        ``weights``: {name: tensor} or (name, tensor) pairs under the model's parameter names,
        full tensors or DTensors placed like the parameter (torchloom/generate/weights.py).
        Every parameter must be given unless ``partial``; a wrong name or shape raises one
        ValueError and copies nothing.

        Between steps, with requests in flight: they go on with the new weights (their cache
        keeps what the old weights computed for their earlier tokens). A step already launched
        ahead is read first, so every step launched after this call uses the new weights."""
        with torch.no_grad():
            self._settle()
        copy_weights_(self.model, weights, partial)

    # -- scheduling -----------------------------------------------------------------------------

    def _problem(self, request: Request) -> str | None:
        prompt, params = request.prompt_ids, request.params
        problem = params.problem()
        if problem:
            return problem
        if not prompt:
            return "the prompt is empty"
        vocab = self.config.vocab_size
        if bad := outside(prompt, vocab):
            return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
        if bad := outside(list(params.stop_ids), vocab):
            return (f"stop_ids {bad[:5]} are outside the vocabulary [0, {vocab}): the request "
                    "could never stop on them")  # fmt: skip
        if (problem := self._media_problem(request)) is not None:
            return problem
        if len(prompt) + params.max_new_tokens > self.max_len:
            return too_long(len(prompt), params.max_new_tokens, self.max_len)
        return None

    def _media_problem(self, request: Request) -> str | None:
        """Why the request's images (or their absence) do not fit the model or its prompt."""
        media, cfg = request.media, self.config
        encoder = getattr(self.model, "media_encoder", None)
        if encoder is None:
            return None if media is None else "this model reads no images"
        if media is None:
            placeholders = request.prompt_ids.count(cfg.image_token_id)
            return None if not placeholders else (
                f"the prompt holds {placeholders} image placeholder tokens but no images"
            )  # fmt: skip
        if set(media) != set(MEDIA_KEYS):
            got = ", ".join(media) or "nothing"
            return f"media must hold {' and '.join(MEDIA_KEYS)}; got {got}"
        if (problem := media_problem(media)) is not None:
            return problem
        patch_dim = getattr(cfg.vision, "patch_dim", None)
        if patch_dim is not None and media["pixel_values"].shape[-1] != patch_dim:
            return (f"pixel_values hold patches of {media['pixel_values'].shape[-1]} values; "
                    f"the model's vision encoder reads {patch_dim}")  # fmt: skip
        tokens_1T = torch.tensor([request.prompt_ids])
        try:
            check_media(tokens_1T, {k: v[None].cpu() for k, v in media.items()},
                        cfg.image_token_id, encoder)  # fmt: skip
            if isinstance(self.model, MultimodalDecoder):  # M-RoPE: the prompt's positions
                mrope_positions(tokens_1T[0], media["image_grid_thw"], cfg.image_token_id,
                                cfg.vision_start_token_id, encoder.merge_size)  # fmt: skip
        except (ConfigError, ValueError) as err:
            return f"the prompt does not match its images: {err}"
        return None

    def _admitting(self) -> bool:
        """Whether this round admits: something waits and finds a slot (a free one or a kept
        one), and either nothing is decoding or ``admit_batch`` of the waiting (all of them,
        when fewer wait) find one."""
        room = len(self._free) + len(self._kept)
        if not (self._waiting and room):
            return False
        return not self._active or room >= min(len(self._waiting), self.admit_batch)

    def _admit(self) -> dict[int, _Active]:
        """Waiting requests taken into slots, by slot, in order: a continuation into its kept
        slot, any other request into the lowest free slot, or else the slot of the oldest
        kept request that no waiting request continues (evicted). The rest go on waiting."""
        admitted: dict[int, _Active] = {}
        claimed = {r.continues for _, r in self._waiting if r.continues in self._kept}
        waiting, self._waiting = self._waiting, deque()
        for request_id, request in waiting:
            kept = self._kept.pop(request.continues, None)  # type: ignore[arg-type]
            if kept is not None and request.media is not None:  # prefilled whole, images too
                heapq.heappush(self._free, kept.slot)
                kept = None
            if kept is not None and not _extends(request.prompt_ids, kept.tokens):
                heapq.heappush(self._free, kept.slot)
                error = (f"request {request_id} continues request {request.continues}, but its "
                         "prompt does not start with that request's prompt and completion")  # fmt: skip
                self._finished.append((request_id, Completion(finish_reason="error", error=error)))
                continue
            start = 0 if kept is None else len(kept.tokens) - 1
            slot = kept.slot if kept is not None else self._free_slot(claimed)
            if slot is None:
                self._waiting.append((request_id, request))
                continue
            seed = request.params.seed
            if seed is None:
                seed = int(torch.randint(2**62, ()))
            admitted[slot] = _Active(request_id, request, Completion(), len(request.prompt_ids),
                                     seed, start=start, keep=request.keep_slot)  # fmt: skip
        return admitted

    def _free_slot(self, claimed: set[int | None]) -> int | None:
        """The lowest free slot, else the oldest kept slot no waiting request continues."""
        if self._free:
            return heapq.heappop(self._free)
        evictable = next((i for i in self._kept if i not in claimed), None)
        return None if evictable is None else self._kept.pop(evictable).slot

    def _release(self) -> None:
        """Give the slots of requests that have finished back (or keep them); report them."""
        for slot in [s for s, a in self._active.items() if a.completion.finish_reason]:
            state = self._active.pop(slot)
            if state.keep and state.completion.finish_reason != "error":
                tokens = [*state.request.prompt_ids, *state.completion.tokens]
                self._kept[state.id] = _Kept(slot, tokens)
            else:
                heapq.heappush(self._free, slot)
            self._finished.append((state.id, state.completion))
        if not self._active:
            self._ahead = None  # launched for rows that have stopped since: nothing to read

    def _end_admitted(self, admitted: dict[int, _Active], error: BaseException) -> None:
        """End the requests admitted into a step that raised (the next step reports them):
        their slots are free again, and none is dropped without a word."""
        for slot, state in admitted.items():
            heapq.heappush(self._free, slot)
            why = f"the step that prefilled it raised {type(error).__name__}: {error}"
            self._finished.append((state.id, Completion(finish_reason="error", error=why)))

    # -- forwards -------------------------------------------------------------------------------

    def _prefill(self, admitted: dict[int, _Active]) -> bool:
        """One right-padded forward with a row per distinct prompt, each row from its first
        token not yet in its slot (a continuation's start; 0 otherwise). Requests with the
        same new prompt share its row: the state it leaves in the first one's slot is copied to
        the others' slots, and each draws its first token from the row with its own
        generator. When the rows are short (at most ``MIXED_PREFILL_TOKENS``, as a
        conversation's next turn is) and few enough requests are active that their padding
        stays within ``MIXED_PREFILL_PADDING``, the active requests advance one token in the
        same forward, each as one more row. Returns whether they did."""
        groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # each distinct row's slots
        for slot, state in admitted.items():
            # A continuation's row is its own: its slot already holds the rest of its context.
            owner = slot if state.start else -1
            media = id(state.request.media) if state.request.media is not None else None
            groups.setdefault((owner, tuple(state.request.prompt_ids), media), []).append(slot)
        rows = [(slots[0], admitted[slots[0]].start, list(prompt[admitted[slots[0]].start :]))
                for (_, prompt, _), slots in zip(groups, groups.values(), strict=True)]  # fmt: skip
        self.prefill_tokens += sum(len(new) for _, _, new in rows)
        longest = max(len(new) for _, _, new in rows)
        mixed = (longest <= MIXED_PREFILL_TOKENS
                 and len(self._active) * (longest - 1) <= MIXED_PREFILL_PADDING)  # fmt: skip
        decoding = self._active if mixed else {}
        rows += [(slot, a.position, a.completion.tokens[-1:]) for slot, a in decoding.items()]
        tokens_BT = torch.tensor([new + [0] * (longest - len(new)) for _, _, new in rows],
                                 device=self.device)  # fmt: skip
        # Padding past a row's tokens stops at the last index, where no real token ever sits
        # (a prompt + max_new_tokens fits max_len, and the last token is never fed).
        starts_B1 = torch.tensor([[start] for _, start, _ in rows], device=self.device)
        positions_BT = (starts_B1 + torch.arange(longest, device=self.device)).clamp(
            max=self.max_len - 1
        )
        slot_ids_B = torch.tensor([slot for slot, _, _ in rows], device=self.device)
        lengths_B = torch.tensor([len(new) for _, _, new in rows], device=self.device)
        cache = self.cache.bind(slot_ids_B, positions_BT, lengths_B)
        # Images go with the rows that prefill a prompt (a decoding row's are in its slot).
        media = _media_rows([admitted[slot].request.media if slot in admitted else None
                             for slot, _, _ in rows])  # fmt: skip
        if media:
            logits_BTV = self.model(tokens_BT, positions_BT, cache=cache,
                                    media=_to(media, self.device))  # fmt: skip
        elif self._compiled_prefill is not None:
            logits_BTV = self._compiled_prefill(tokens_BT, positions_BT, cache)
        else:
            logits_BTV = self.model(tokens_BT, positions_BT, cache=cache)
        logits_BV = logits_BTV[torch.arange(len(rows), device=self.device), lengths_B - 1]
        for (_, prompt, _), (first, *others) in zip(groups, groups.values()):
            if others:
                self.cache.copy_slot(first, others, len(prompt))
        row_of = {slot: row for row, slots in enumerate(groups.values()) for slot in slots}
        row_of.update((slot, len(groups) + i) for i, slot in enumerate(decoding))
        logprobs_BV, best_2B = self._score(logits_BV)
        states = {**admitted, **decoding}
        self._emit(states, logprobs_BV, best_2B.tolist(), [row_of[s] for s in states])
        return mixed

    def _decode(self) -> None:
        if self.graphs is not None:
            self._decode_static()
            return
        active = self._active
        slots = list(active)
        tokens_B1 = torch.tensor(
            [[active[s].completion.tokens[-1]] for s in slots], device=self.device
        )
        positions_B1 = torch.tensor([[active[s].position] for s in slots], device=self.device)
        slot_ids_B = torch.tensor(slots, device=self.device)
        logits_B1V = self.model(
            tokens_B1, positions_B1, cache=self.cache.bind(slot_ids_B, positions_B1)
        )
        logprobs_BV, best_2B = self._score(logits_B1V[:, 0])
        self._emit(active, logprobs_BV, best_2B.tolist(), list(range(len(slots))))

    def _decode_static(self) -> None:
        """A step over slots 0..max(active) (free ones run on a dummy token; row = slot). When
        every row is greedy and one goes on after this step, the next step is launched before
        this one is read: its inputs (the argmax tokens) are already on the device."""
        assert self.graphs is not None
        active = self._active
        step, self._ahead = self._ahead, None
        if step is None:
            rows = max(active) + 1
            tokens = [active[s].completion.tokens[-1] if s in active else 0 for s in range(rows)]
            positions = [active[s].position if s in active else None for s in range(rows)]
            step = self.graphs.launch(tokens, positions)
        states = active.values()
        # A kept slot must hold the state of its tokens exactly: no step launched past its end.
        greedy = all(a.request.params.temperature == 0 and not a.keep for a in states)
        going_on = any(
            len(a.completion.tokens) + 1 < a.request.params.max_new_tokens for a in states
        )
        if greedy and going_on and self.graphs.bucket_for(max(active) + 1) == self.graphs.bucket:
            self._ahead = self.graphs.launch()
        self._read(step)

    def _settle(self) -> None:
        """Read the step launched ahead, if any (its rows are exactly the active ones, all
        greedy), and release the requests it ended."""
        step, self._ahead = self._ahead, None
        if step is not None:
            self._read(step)
            self._release()

    def _read(self, step: DecodeStep) -> None:
        self._emit(self._active, step.logprobs_BV, step.best(), list(self._active))  # row = slot

    def _emit(
        self,
        rows: dict[int, _Active],
        logprobs_BV: torch.Tensor,
        best: list[list[float]],
        index: list[int],
    ) -> None:
        """Record each row's next token with its log-probability and end rows that stop.
        ``logprobs_BV`` and ``best`` (argmax tokens and their log-probabilities, on the host)
        come from ``score(logits)``; row ``index[i]`` belongs to the i-th state. Greedy rows
        take the argmax, sampling rows draw together from their own streams (one host transfer
        each)."""
        best_tokens, best_logprobs = best
        states = list(rows.values())
        drawn = _draw(states, logprobs_BV, index)
        for i, (row, state) in enumerate(zip(index, states)):
            completion, params = state.completion, state.request.params
            if params.temperature == 0:
                token, logprob = int(best_tokens[row]), best_logprobs[row]
            else:
                token, logprob = drawn[i]
            if not math.isfinite(logprob):  # nan or inf logits: the token means nothing
                completion.finish_reason = "error"
                completion.error = (
                    f"the model's log-probabilities for generated token {len(completion.tokens)} "
                    f"are not finite ({logprob}): its logits hold nan or inf (check the "
                    "weights, the dtype and the inputs)"
                )
                continue
            completion.tokens.append(token)
            completion.logprobs.append(logprob)
            state.position = len(state.request.prompt_ids) + len(completion.tokens) - 1
            if token in params.stop_ids:
                completion.finish_reason = "stop"
            elif len(completion.tokens) >= params.max_new_tokens:
                completion.finish_reason = "length"


def _text_forward(model: nn.Module) -> Callable[..., torch.Tensor]:
    """``model``'s forward over tokens and a bound cache, as a function to compile (a closure
    over the model alone: no reference back to the generator)."""

    def forward(
        tokens_BT: torch.Tensor, positions_BT: torch.Tensor, cache: ModelCache
    ) -> torch.Tensor:
        return model(tokens_BT, positions_BT, cache=cache)

    return forward


def _media_rows(media: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
    """The rows' media as one batch, ``pixel_values [B, N, L, P]`` and ``image_grid_thw [B, N,
    3]`` (N and L the largest of the rows'; zeros pad), or None when no row has images."""
    given = [m for m in media if m is not None]
    if not given:
        return None
    N = max(m["image_grid_thw"].shape[0] for m in given)
    L, P = max(m["pixel_values"].shape[1] for m in given), given[0]["pixel_values"].shape[2]
    pixels_BNLP = torch.zeros(len(media), N, L, P, dtype=given[0]["pixel_values"].dtype)
    grids_BN3 = torch.zeros(len(media), N, 3, dtype=torch.int64)
    for row, m in enumerate(media):
        if m is not None:
            n, length = m["pixel_values"].shape[:2]
            pixels_BNLP[row, :n, :length] = m["pixel_values"]
            grids_BN3[row, :n] = m["image_grid_thw"]
    return {"pixel_values": pixels_BNLP, "image_grid_thw": grids_BN3}


def _to(media: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in media.items()}


def _extends(prompt: list[int], tokens: list[int]) -> bool:
    """Whether ``prompt`` (a list or a tuple) starts with ``tokens``."""
    return len(prompt) >= len(tokens) and list(prompt[: len(tokens)]) == tokens


def _check_types(request: object) -> None:
    """TypeError unless ``request`` is a Request whose fields have the right types."""
    if not isinstance(request, Request):
        raise TypeError(f"expected a Request(prompt_ids, SamplingParams(...)); got "
                        f"{type(request).__name__}")  # fmt: skip
    request.check_types()


class CacheTooLarge(ValueError):
    """The generation cache asked for needs more memory than the device has available."""

    def __init__(self, slots: int, max_len: int, needed: int, free: int, device: torch.device):
        self.slots, self.max_len = slots, max_len
        self.sizes = (
            f"needs {_size(needed)}, but the {device.type} device has {_size(free)} available"
        )
        """What the cache needs and what there is, for a message that names its own options."""
        super().__init__(
            f"a generation cache of {slots} slots x {max_len} tokens {self.sizes}; lower "
            "max_batch (cache slots) or max_len"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_cache_fits(
    model: nn.Module, slots: int, max_len: int, device: torch.device, dtype: torch.dtype
) -> None:
    """CacheTooLarge, before anything is allocated, when ``model``'s generation state for
    ``slots`` x ``max_len`` tokens (counted on the meta device) exceeds the memory ``device``
    has available: allocating it would fail, or on the CPU get the process killed unnamed."""
    free = available_memory(device)
    if free is None:
        return
    needed = model.new_cache(slots, max_len, torch.device("meta"), dtype).nbytes()
    if needed > free:
        raise CacheTooLarge(slots, max_len, needed, free, device)


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can still take (for a GPU, what the driver has free
    plus what the caching allocator holds unused, within a cap set on the allocator
    (``--training.memory_limit_gib``); for the CPU, the kernel's MemAvailable); None where
    unknown."""
    if device.type == "cuda":
        index = cuda_index(device)
        free, total = torch.cuda.mem_get_info(index)
        allocated = torch.cuda.memory_allocated(device)
        cap = int(total * torch.cuda.get_per_process_memory_fraction(index))
        return min(free + torch.cuda.memory_reserved(device), cap) - allocated
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def _fused_step(step_kernel: str, model: nn.Module, cache: ModelCache) -> bool:
    """Whether ``Generator(step_kernel=...)`` runs one sequence's decode steps by the fused
    kernel (generate/fused_step.py); "triton" where it cannot is refused, "auto" there runs
    the forward."""
    if step_kernel not in STEP_IMPLS:
        raise ValueError(
            f"step_kernel must be one of {STEP_IMPLS} ('triton': the fused one-launch step; "
            f"'auto': it where it runs on CUDA, else the forward); got {step_kernel!r}"
        )
    if step_kernel == "torch":
        return False
    if step_kernel == "auto":  # CUDA only: the interpreter is for tests, which ask for "triton"
        on_cuda = cache.device.type == "cuda" and triton is not None
        return on_cuda and fused_step_problem(model, cache) is None
    problem = fused_step_problem(model, cache)
    if problem is None and triton is None:
        problem = "Triton is not installed"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if problem is None and cache.device.type != "cuda" and not interpreted:
        problem = f"it runs on CUDA (or under TRITON_INTERPRET=1), not on {cache.device.type}"
    if problem is not None:
        raise ValueError(
            f"step_kernel 'triton' cannot run this model's decode step: {problem}. Pass "
            "step_kernel 'torch' (the model's forward)."
        )
    return True


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def score(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 log-probabilities [B, V], [2, B] float64 of each row's argmax token and its
    log-probability): the model's own distribution, before any sampling setting. Token ids and
    fp32 values are exact in float64, so one host transfer carries both. PyTorch's form;
    ``Generator(score_kernel="auto")`` runs kernels/log_softmax.py's Triton kernels instead."""
    return log_softmax_argmax_reference(logits_BV)


def _draw(
    states: list[_Active], logprobs_BV: torch.Tensor, index: list[int]
) -> dict[int, tuple[int, float]]:
    """(token, log-probability) for each sampling state i (row ``index[i]``), drawn together."""
    sampling = [i for i, s in enumerate(states) if s.request.params.temperature > 0]
    if not sampling:
        return {}
    device = logprobs_BV.device

    def column(values: list) -> torch.Tensor:
        return torch.tensor(values, device=device)

    params = [states[i].request.params for i in sampling]
    logprobs_SV = logprobs_BV[column([index[i] for i in sampling])]
    V = logprobs_SV.shape[-1]  # a top_k past the vocabulary keeps it all (and fits in int64)
    tokens_S, picked_S = sample_rows(
        logprobs_SV, column([p.temperature for p in params]),
        column([min(p.top_k, V) for p in params]),
        column([p.top_p for p in params]), column([states[i].seed for i in sampling]),
        column([len(states[i].completion.tokens) for i in sampling]),
        filtered=any(p.top_k > 0 or p.top_p < 1 for p in params),
    )  # fmt: skip
    pairs = torch.stack((tokens_S.double(), picked_S.double()), dim=1).tolist()
    return {i: (int(token), logprob) for i, (token, logprob) in zip(sampling, pairs, strict=True)}


def _host_reads(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a decode step of ``model`` in ``dtype`` would read device values on the host (which
    no CUDA graph can capture), or None. Mixture-of-experts layers do where their grouped
    matmul is a loop over experts: batch-invariant mode, or no ``torch._grouped_mm`` for these
    operands (before Hopper, or not bf16; kernels/grouped_mm.py)."""
    if (found := experts_reading_the_host(model, dtype)) is None:
        return None
    name, experts = found
    why = "batch-invariant mode" if experts.invariant else f"{dtype} on this device"
    return (
        f"its experts ({name}) multiply expert by expert ({why}), reading each expert's row "
        "count on the host"
    )
