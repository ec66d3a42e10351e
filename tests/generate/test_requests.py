"""Bad input to the generator: a field of the wrong type raises TypeError at ``submit`` naming
it and queues nothing; a value that cannot be used ends its request alone with the reason;
non-finite logits end a request with an error instead of a token; a step that raises loses no
request (torchloom/generate/requests.py, engine.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.models import TransformerConfig, build_model

CONFIG = TransformerConfig(vocab_size=320, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           ffn_dim=64, max_seq_len=64)  # fmt: skip
PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    model = build_model(CONFIG)
    model.init_weights(0)
    return model.eval()


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 4, **kw})


WRONG_TYPES = {
    "params None": (Request(PROMPT, None), r"Request.params must be a SamplingParams; got None"),
    "params dict": (Request(PROMPT, {"max_new_tokens": 3}), "must be a SamplingParams"),
    "prompt tensor": (Request(torch.tensor(PROMPT)), r"prompt_ids .* not a tensor; .*tolist\(\)"),
    "prompt str": (Request("hello"), "prompt_ids must be a list of token ids; got 'hello'"),
    "prompt None": (Request(None), "prompt_ids must be a list of token ids; got None"),
    "prompt floats": (Request([1.0, 5.5]), r"prompt_ids must hold token ids \(integers\); item 0"),
    "prompt bool": (Request([3, True]), r"prompt_ids must hold .* item 1 is True \(bool\)"),
    "prompt nested": (Request([PROMPT]), r"prompt_ids must hold .* item 0 is \[5, 6, 7, 8\]"),
    "max_new_tokens 2.5": (Request(PROMPT, params(max_new_tokens=2.5)),
                           r"SamplingParams.max_new_tokens must be an integer; got 2.5"),
    "max_new_tokens nan": (Request(PROMPT, params(max_new_tokens=float("nan"))),
                           "max_new_tokens must be an integer; got nan"),
    "max_new_tokens '4'": (Request(PROMPT, params(max_new_tokens="4")),
                           "max_new_tokens must be an integer; got '4' \\(str\\)"),
    "max_new_tokens True": (Request(PROMPT, params(max_new_tokens=True)),
                            "max_new_tokens must be an integer; got True"),
    "temperature '0.5'": (Request(PROMPT, params(temperature="0.5")),
                          "SamplingParams.temperature must be a number; got '0.5'"),
    "temperature None": (Request(PROMPT, params(temperature=None)),
                         "temperature must be a number; got None"),
    "top_p None": (Request(PROMPT, params(top_p=None)), "top_p must be a number; got None"),
    "top_k 2.5": (Request(PROMPT, params(top_k=2.5)), "top_k must be an integer; got 2.5"),
    "top_k nan": (Request(PROMPT, params(top_k=float("nan"))), "top_k must be an integer"),
    "seed 1.5": (Request(PROMPT, params(seed=1.5)), "seed must be None or an integer; got 1.5"),
    "seed 1.0": (Request(PROMPT, params(seed=1.0)), "seed must be None or an integer; got 1.0"),
    "seed 'abc'": (Request(PROMPT, params(seed="abc")), "seed must be None or an integer"),
    "seed Generator": (Request(PROMPT, params(seed=torch.Generator())),
                       "seed must be None or an integer; got .*Generator"),
    "seed True": (Request(PROMPT, params(seed=True)), "seed must be None or an integer; got True"),
    "stop_ids 5": (Request(PROMPT, params(stop_ids=5)), "stop_ids must be a tuple of token ids"),
    "stop_ids None": (Request(PROMPT, params(stop_ids=None)), "stop_ids must be a tuple"),
    "stop_ids 'a'": (Request(PROMPT, params(stop_ids=("a",))),
                     r"stop_ids must hold token ids \(integers\); got 'a'"),
    "continues 'x'": (Request(PROMPT, continues="x"), "continues must be None or a request id"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrong_types_raise_at_submit_and_queue_nothing(case, model) -> None:
    request, message = WRONG_TYPES[case]
    generator = Generator(model, max_batch=2, max_len=32)
    with pytest.raises(TypeError, match=message):
        generator.submit(request)
    assert generator.idle
    assert generator.submit(Request(PROMPT, GREEDY)) == 0  # no id was spent on it
    with pytest.raises(TypeError, match="expected a Request"):
        generator.submit(PROMPT)


def test_generate_checks_every_request_before_queueing_any(model) -> None:
    generator = Generator(model, max_batch=2, max_len=32)
    with pytest.raises(TypeError, match="item 0 is 1.0"):
        generator.generate([Request(PROMPT, GREEDY), Request([1.0, 2.0], GREEDY)])
    assert generator.idle  # the good one was not queued either: nothing runs unreported
    with pytest.raises(TypeError, match=r"generate takes a list of Requests; .*\[request\]"):
        generator.generate(Request(PROMPT, GREEDY))
    # numpy integers are integers; a tuple prompt is a prompt.
    numpy_ids = Request([np.int64(t) for t in PROMPT], params(seed=np.int64(3)))
    as_list, as_numpy, as_tuple = generator.generate(
        [Request(PROMPT, params(seed=3)), numpy_ids, Request(tuple(PROMPT), params(seed=3))]
    )
    assert as_list.tokens == as_numpy.tokens == as_tuple.tokens and len(as_list.tokens) == 4


def test_numpy_numbers_draw_what_python_numbers_draw(model) -> None:
    """numpy scalars are accepted as the Python numbers they equal, and draw the same: an int32
    or uint64 seed the same stream as the int (an int32 tensor of seeds hashed to another), a
    float64 temperature or top_p the same tokens and log-probabilities, bit for bit (float64
    settings had turned the whole step's sampling to fp64), and unsigned prompt ids run (a
    uint16 prompt failed in the step)."""
    generator = Generator(model, max_batch=4, max_len=32)
    want = generator.generate([Request(PROMPT, params(temperature=0.7, top_p=0.9, seed=3))])[0]
    cases = [
        Request(PROMPT, params(temperature=0.7, top_p=0.9, seed=np.int32(3))),
        Request(PROMPT, params(temperature=0.7, top_p=0.9, seed=np.uint64(3))),
        Request(PROMPT, params(temperature=np.float64(0.7), top_p=np.float64(0.9), seed=3)),
        Request([np.uint16(t) for t in PROMPT], params(temperature=0.7, top_p=0.9, seed=3)),
    ]
    for case in cases:  # each alone, as ``want`` ran (this model is not batch-invariant)
        got = generator.generate([case])[0]
        assert got.finish_reason == "length", got.error
        assert (got.tokens, got.logprobs) == (want.tokens, want.logprobs)


BAD_VALUES = {
    "temperature 1e-45": (params(temperature=1e-45, seed=0),
                          r"temperature must be 0 \(greedy\) or a finite number >= 0.0001 "
                          r"\(got 1e-45\).*use 0 for greedy"),
    "temperature 1e-300 top_k": (params(temperature=1e-300, top_k=5, seed=0),
                                 "temperature must be 0 .* >= 0.0001"),
    "temperature inf": (params(temperature=float("inf")), r"finite number .* \(got inf\)"),
    "top_p inf": (params(top_p=float("inf")), r"top_p must be in \(0, 1\] \(got inf\)"),
    "top_p nan": (params(top_p=float("nan")), r"top_p must be in \(0, 1\] \(got nan\)"),
    "seed 2**63": (params(seed=2**63), r"seed must be in \[0, 2\*\*63\)"),
    "seed -1": (params(seed=-1), r"seed must be in \[0, 2\*\*63\).*got -1"),
    "stop id past the vocabulary": (params(stop_ids=(320, 3)),
                                    r"stop_ids \[320\] are outside the vocabulary \[0, 320\)"),
    "negative stop id": (params(stop_ids=[-1]), r"stop_ids \[-1\] are outside the vocabulary"),
}  # fmt: skip


def test_values_that_cannot_be_used_end_their_request_alone(model) -> None:
    generator = Generator(model, max_batch=2, max_len=32)
    good = Request(PROMPT, params(seed=1))
    alone = generator.generate([good])[0]
    done = generator.generate([*(Request(PROMPT, p) for p, _ in BAD_VALUES.values()), good])
    for (case, (_, message)), completion in zip(BAD_VALUES.items(), done):
        assert completion.finish_reason == "error" and completion.tokens == [], case
        assert completion.error is not None and re.search(message, completion.error), case
    assert done[-1].tokens == alone.tokens
    # A top_k past the vocabulary, even past int64, keeps every token, as 0 does.
    huge = generator.generate([Request(PROMPT, params(seed=1, top_k=2**63))])[0]
    assert huge.tokens == alone.tokens and huge.finish_reason == "length"


def test_generator_arguments(model) -> None:
    with pytest.raises(TypeError, match="model must be a torchloom decoder .*; got str"):
        Generator("model")
    with pytest.raises(ValueError, match="max_len 65 exceeds the model's context of 64 tokens"):
        Generator(model, max_len=65)
    assert Generator(model, max_len=64).max_len == Generator(model).max_len == 64


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"top_k": 5, "top_p": 0.5, "seed": 0}])
def test_non_finite_logits_end_the_request_with_an_error(model, sampling) -> None:
    """Row 0's logits turn nan in the third forward: its request ends with the two tokens
    before and an error naming non-finite logits, not a token 0 with a nan logprob; its kept
    slot is given back; the request beside it runs as alone."""
    requests = [Request(PROMPT, params(max_new_tokens=6, **sampling), keep_slot=True),
                Request([9, 10], params(max_new_tokens=6, **sampling))]  # fmt: skip
    alone = Generator(model, max_batch=1, max_len=32).generate(requests[1:])[0]
    calls = []

    def poison(module, inputs, logits):
        calls.append(1)
        if len(calls) == 3:
            logits[0] = float("nan")
        return logits

    hook = model.register_forward_hook(poison)
    try:
        generator = Generator(model, max_batch=2, max_len=32)
        bad, other = generator.generate(requests)
    finally:
        hook.remove()
    assert bad.finish_reason == "error" and len(bad.tokens) == len(bad.logprobs) == 2
    assert "log-probabilities for generated token 2 are not finite (nan)" in bad.error
    assert generator.kept == []
    assert other.tokens == alone.tokens and other.finish_reason == "length"


def test_a_step_that_raises_loses_no_request(model) -> None:
    """A forward raises while prefilling B (A decoding alongside): the step raises, B ends with
    an error naming the exception, A goes on to the tokens it gets alone. Under generate(),
    the completions it had gathered are reported by the next step."""
    A, B = Request(PROMPT, params(seed=1)), Request([9, 10], params(seed=2))
    want = Generator(model, max_batch=2, max_len=32).generate([A])[0]

    def fail_on_b(module, inputs):
        if inputs[0][0, :2].tolist() == B.prompt_ids:
            raise RuntimeError("device lost")

    hook = model.register_forward_pre_hook(fail_on_b)
    try:
        generator = Generator(model, max_batch=2, max_len=32)
        a = generator.submit(A)
        generator.step()
        b = generator.submit(B)
        with pytest.raises(RuntimeError, match="device lost"):
            generator.step()
        done = {}
        while not generator.idle:
            done.update(generator.step())
        assert done[b].finish_reason == "error" and done[b].tokens == []
        assert "the step that prefilled it raised RuntimeError: device lost" in done[b].error
        assert done[a].tokens == want.tokens and done[a].finish_reason == "length"

        generator = Generator(model, max_batch=1, max_len=32)  # B waits for A's slot
        first = Request(PROMPT, params(max_new_tokens=1, seed=1))
        with pytest.raises(RuntimeError, match="device lost"):
            generator.generate([first, B])
        reported = dict(generator.step())
        assert reported[0].tokens == want.tokens[:1] and reported[1].finish_reason == "error"
        assert generator.idle
    finally:
        hook.remove()
