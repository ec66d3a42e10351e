"""What a request to the generator holds (``Request``, its ``SamplingParams``), what it gets back
(``Completion``), and what makes one usable.

Two kinds of bad input, two answers. A field of the wrong type (a float token id, a string
temperature, params that are not a ``SamplingParams``) is a bug in the calling code:
``Generator.submit`` raises TypeError naming the field and queues nothing. A value of the right
type that cannot be used (a temperature of -1, a token id outside the vocabulary) is that
request's own problem: it ends with finish_reason 'error' and the reason, and the others run.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

MIN_TEMPERATURE = 1e-4
"""The lowest positive temperature. A sampling step divides the fp32 log-probabilities by the
temperature; far below this (1e-45 is 0 in fp32) the quotients overflow and the draw is nan.
At 1e-4 the draw is already the argmax unless two log-probabilities lie within about 1e-3:
use 0 for greedy."""

SEED_LIMIT = 2**63
"""Seeds are int64 keys on the device (torchloom/generate/sampling.py): 0 <= seed < 2**63."""


_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def is_int(value: object) -> bool:
    """An integer, Python's or numpy's; not a bool (True is no count and no token id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _first_non_int(values: Sequence[object]) -> int | None:
    """The index of the first item of ``values`` that is not an integer (``is_int``), or None.
    Token lists are long: the common case (all Python ints) is checked at C speed."""
    if set(map(type, values)) <= {int}:
        return None
    return next((i for i, value in enumerate(values) if not is_int(value)), None)


def outside(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids of ``ids`` outside [0, vocab_size), in order."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return []
    return [i for i in ids if not 0 <= i < vocab_size]


def _shown(value: object) -> str:
    """``value`` and its type, cut short for an error line."""
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    """Most tokens to generate (the stop token, when one ends the request, is included)."""
    temperature: float = 1.0
    """Softmax temperature: 0 means greedy (argmax), else at least ``MIN_TEMPERATURE``."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0, or k at least the vocabulary: all)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities add up to p (1: all)."""
    seed: int | None = None
    """This request's own random stream, in [0, 2**63) (None: drawn from torch's global
    generator)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the request (included in its output); a tuple, list or set."""

    def check_types(self) -> None:
        """TypeError naming the first field of the wrong type."""
        for name in ("max_new_tokens", "top_k"):
            if not is_int(value := getattr(self, name)):
                raise TypeError(f"SamplingParams.{name} must be an integer; got {_shown(value)}")
        for name in ("temperature", "top_p"):
            if not _is_real(value := getattr(self, name)):
                raise TypeError(f"SamplingParams.{name} must be a number; got {_shown(value)}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"SamplingParams.seed must be None or an integer; got "
                            f"{_shown(self.seed)}")  # fmt: skip
        stop_ids = self.stop_ids
        if not isinstance(stop_ids, tuple | list | set | frozenset):
            raise TypeError(f"SamplingParams.stop_ids must be a tuple of token ids (() for "
                            f"none); got {_shown(stop_ids)}")  # fmt: skip
        if (i := _first_non_int(list(stop_ids))) is not None:
            raise TypeError(f"SamplingParams.stop_ids must hold token ids (integers); got "
                            f"{_shown(list(stop_ids)[i])}")  # fmt: skip

    def problem(self) -> str | None:
        """Why these values cannot be used, or None (a field of the wrong type: TypeError).
        The token ids' range is the generator's to check: it knows the vocabulary."""
        self.check_types()
        if self.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1 (got {self.max_new_tokens})"
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            return (
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} "
                f"(got {self.temperature}): the log-probabilities are divided by it, and a "
                "smaller one overflows; use 0 for greedy"
            )
        if self.top_k < 0:
            return f"top_k must be >= 0 (0 keeps every token; got {self.top_k})"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1] (got {self.top_p})"
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            return f"seed must be in [0, 2**63), the range of an int64 (got {self.seed})"
        return None


@dataclass
class Request:
    prompt_ids: list[int]
    """The prompt's token ids, a list (or tuple) of integers; a 1-D tensor's ``.tolist()``."""
    params: SamplingParams = field(default_factory=SamplingParams)
    keep_slot: bool = False
    """Keep the cache slot (every layer's state of this sequence) when the request finishes,
    for a request that ``continues`` it; ``Generator.release(id)`` gives it back."""
    continues: int | None = None
    """The id of a finished request that kept its slot: ``prompt_ids`` extend its prompt and
    completion, and only the tokens past them are prefilled, from its slot. Where that slot is
    no longer kept (released, evicted for room, or never kept) the whole prompt is prefilled,
    which gives the same result."""
    media: dict[str, torch.Tensor] | None = None
    """The prompt's images for a vision-language model: ``pixel_values [N, L, P]`` and
    ``image_grid_thw [N, 3]`` (integers: each image's t, h, w in patches), torch tensors, one
    slot per image, in the order of their placeholders (the layout of a data batch's row,
    data/multimodal.py). A request with media is prefilled whole (not from a kept slot) and
    shares its prefill only with requests given the same media object."""

    def check_types(self) -> None:
        """TypeError naming the first field of the wrong type (its params' too)."""
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"Request.params must be a SamplingParams; got {_shown(self.params)}")
        self.params.check_types()
        prompt = self.prompt_ids
        if isinstance(prompt, torch.Tensor):
            raise TypeError("Request.prompt_ids must be a list of token ids, not a tensor; pass "
                            "a 1-D tensor's .tolist()")  # fmt: skip
        if not isinstance(prompt, list | tuple):
            raise TypeError(f"Request.prompt_ids must be a list of token ids; got "
                            f"{_shown(prompt)}")  # fmt: skip
        if (i := _first_non_int(prompt)) is not None:
            raise TypeError(f"Request.prompt_ids must hold token ids (integers); item {i} is "
                            f"{_shown(prompt[i])}")  # fmt: skip
        if self.continues is not None and not is_int(self.continues):
            raise TypeError(f"Request.continues must be None or a request id (an integer); "
                            f"got {_shown(self.continues)}")  # fmt: skip
        if self.media is not None:
            _check_media_types(self.media)


def _check_media_types(media: object) -> None:
    if not isinstance(media, dict):
        raise TypeError(f"Request.media must be a dict of tensors (pixel_values, "
                        f"image_grid_thw); got {_shown(media)}")  # fmt: skip
    for key, value in media.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Request.media[{key!r}] must be a torch tensor (numpy: "
                            f"torch.from_numpy); got {_shown(value)}")  # fmt: skip
    grid = media.get("image_grid_thw")
    if grid is not None and grid.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"Request.media['image_grid_thw'] must be an integer tensor (each "
                        f"image's t, h, w in patches); got {grid.dtype}")  # fmt: skip


def media_problem(media: dict[str, torch.Tensor]) -> str | None:
    """Why ``media`` (both keys present, their types checked) cannot be images of any model,
    or None: shapes, grids of at least one patch, finite pixels. Reads them on the host."""
    pixels_NLP, grid_N3 = media["pixel_values"], media["image_grid_thw"]
    if pixels_NLP.ndim != 3:
        return (f"pixel_values must be [images, patches, patch values] (3 dims); got shape "
                f"{list(pixels_NLP.shape)}")  # fmt: skip
    if tuple(grid_N3.shape) != (len(pixels_NLP), 3):
        return (f"image_grid_thw must be [images, 3], a row per image of pixel_values "
                f"({len(pixels_NLP)}); got shape {list(grid_N3.shape)}")  # fmt: skip
    if bool((grid_N3 < 1).any()):
        return (f"image_grid_thw must hold each image's t, h, w in patches, all >= 1; got "
                f"{grid_N3.tolist()}")  # fmt: skip
    if not bool(torch.isfinite(pixels_NLP).all()):
        return "pixel_values hold nan or inf"
    return None


def too_long(prompt: int, new: int, context: int) -> str:
    """Why a prompt of ``prompt`` tokens with ``new`` to generate cannot run in ``context``."""
    return (f"the prompt's {prompt} tokens + max_new_tokens {new} exceed the context of "
            f"{context} tokens; shorten the prompt or lower max_new_tokens")  # fmt: skip


def plain(request: Request) -> Request:
    """``request`` (checked) with its token ids and settings as Python ints and floats. numpy's,
    which the checks accept, would set the dtype of the tensors built from them: an int32 seed
    drew another stream than the same int, a float64 temperature turned the whole step's
    sampling (its neighbours' too) to fp64, and unsigned ids failed in the step."""
    p = request.params
    params = replace(p, max_new_tokens=int(p.max_new_tokens), temperature=float(p.temperature),
                     top_k=int(p.top_k), top_p=float(p.top_p),
                     seed=None if p.seed is None else int(p.seed),
                     stop_ids=tuple(int(t) for t in p.stop_ids))  # fmt: skip
    ids = request.prompt_ids
    if not set(map(type, ids)) <= {int}:
        ids = [int(t) for t in ids]
    return replace(request, prompt_ids=ids, params=params)


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    """Generated token ids (not the prompt)."""
    logprobs: list[float] = field(default_factory=list)
    """One per generated token: a sampled token's log-probability under the distribution it was
    drawn from (temperature, top-k and top-p applied: ``sampling.sampling_logprobs``), a greedy
    token's under the model's own."""
    finish_reason: str = ""
    """'stop' (a stop id), 'length' (max_new_tokens or the context), or 'error'."""
    error: str | None = None
    """What was wrong with the request, when finish_reason is 'error' (its tokens are those
    generated before the problem, if any)."""
