"""Generator.update_weights (torchloom/generate/weights.py): new weights copied in place give
what a new generator on them gives, bitwise, with every parameter in its own storage; requests
in flight go on; bad weights are refused whole."""

import pytest
import torch

from torchloom.generate.engine import Completion, Generator, Request, SamplingParams, score
from torchloom.generate.graphs import DecodeGraphs
from torchloom.models import ModelConfig, build_model, resolve_model_config

from .test_engine import PROMPTS, tiny


def other_weights(family: str = "llama3"):
    config = resolve_model_config(ModelConfig(name=family, flavor="debug"))
    model = build_model(config)
    model.init_weights(1)
    return model


@pytest.mark.parametrize("decode", ["gathered", "static"])
def test_update_weights_in_place_equals_a_fresh_generator(decode):
    """After update_weights(B's state dict), the generator gives what a new one on B gives,
    bitwise, with every parameter still in its own storage."""
    model, other = tiny(), other_weights()
    requests = [Request(p, SamplingParams(max_new_tokens=5 + i, seed=i, temperature=i % 2))
                for i, p in enumerate(PROMPTS)]  # fmt: skip

    def make(m) -> Generator:
        generator = Generator(m, max_batch=3, max_len=64)
        if decode == "static":
            generator.graphs = DecodeGraphs(m, generator.cache, score, capture=False)
        return generator

    generator = make(model)
    before = generator.generate(requests)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    generator.update_weights(other.state_dict())
    after = generator.generate(requests)
    want = make(other).generate(requests)
    assert [c.tokens for c in after] == [c.tokens for c in want] != [c.tokens for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in want]
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    for name, param in model.named_parameters():
        assert torch.equal(param, other.get_parameter(name)), name


def test_update_weights_between_steps_with_requests_in_flight():
    """Requests in flight go on after an update: with the same weights given back nothing
    changes (plain decode, and greedy steps launched ahead, where the update first reads the
    step in flight); with other weights the tokens held when the update returns stay and the
    rest come from the new weights."""
    requests = [Request(p, SamplingParams(max_new_tokens=8, temperature=0.0)) for p in PROMPTS]

    def run(static: bool, weights: dict | None) -> tuple[list[Completion], dict[int, int]]:
        model = tiny()
        generator = Generator(model, max_batch=3, max_len=64)
        if static:
            generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
        ids = [generator.submit(r) for r in requests]
        done = dict(generator.step() + generator.step() + generator.step())
        assert (generator._ahead is not None) == static  # a step launched ahead is in flight
        if weights is not None:
            generator.update_weights(weights)
            assert generator._ahead is None
        held = {s.id: len(s.completion.tokens) for s in generator._active.values()}
        while not generator.idle:
            done.update(generator.step())
        return [done[i] for i in ids], held

    original = tiny().state_dict()
    for static in (False, True):
        plain, _ = run(static, None)
        same, _ = run(static, original)
        assert [c.tokens for c in same] == [c.tokens for c in plain]
        assert [c.logprobs for c in same] == [c.logprobs for c in plain]
        changed, held = run(static, other_weights().state_dict())
        print(f"static={static}: tokens held when the update returned {held}")
        assert held and all(len(c.tokens) == 8 for c in changed)
        for i, count in held.items():
            assert changed[i].tokens[:count] == plain[i].tokens[:count]
            assert changed[i].logprobs[:count] == plain[i].logprobs[:count]
        assert [c.tokens for c in changed] != [c.tokens for c in plain]


def test_update_weights_refusals_copy_nothing():
    model = tiny()
    generator = Generator(model, max_batch=1, max_len=16)
    weights = other_weights().state_dict()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrong_name = {**weights, "layers.0.attention.k_prj.weight": weights["norm.weight"]}
    with pytest.raises(ValueError, match="not parameters of the model.*k_prj.*Did you mean"):
        generator.update_weights(wrong_name)
    with pytest.raises(ValueError, match=r"not given: 'norm.weight' \(pass partial=True"):
        generator.update_weights({k: v for k, v in weights.items() if k != "norm.weight"})
    bad_shape = {**weights, "norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \[3\], the parameter \[64\]"):
        generator.update_weights(bad_shape)
    # Values that are not tensors, last in order (so a copy that checked only shapes would have
    # overwritten every parameter before them), and a meta tensor, which holds no values.
    last = list(weights)[-1]
    for value, named in ((weights[last].numpy(), "ndarray"), (weights[last].tolist(), "list")):
        with pytest.raises(ValueError, match=f"'{last}' is a {named}, not a torch.Tensor"):
            generator.update_weights({**weights, last: value})
    with pytest.raises(ValueError, match=f"'{last}' is on the meta device"):
        generator.update_weights({**weights, last: weights[last].to("meta")})
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by a refused update"
    generator.update_weights([("norm.weight", weights["norm.weight"])], partial=True)
    assert torch.equal(model.norm.weight, weights["norm.weight"])
    assert torch.equal(model.output.weight, before["output.weight"])


@pytest.mark.gpu
def test_update_weights_with_cuda_graphs_captured():
    """The captured graphs read the parameters where they are, so after an in-place update they
    replay with the new weights: the same as a new generator on them, bitwise; an update with a
    greedy step launched ahead first reads that step."""
    model, other = tiny().to("cuda", torch.bfloat16), other_weights().to("cuda", torch.bfloat16)
    requests = [Request(p, SamplingParams(max_new_tokens=6 + i, seed=i, temperature=i % 2))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    generator = Generator(model, max_batch=4, max_len=64, cuda_graphs=True)
    before = generator.generate(requests)
    pointers = [p.data_ptr() for p in model.parameters()]
    generator.update_weights(other.state_dict())
    after = generator.generate(requests)
    want = Generator(other, max_batch=4, max_len=64, cuda_graphs=True).generate(requests)
    assert [c.tokens for c in after] == [c.tokens for c in want] != [c.tokens for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in want]
    assert [p.data_ptr() for p in model.parameters()] == pointers
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    ids = [generator.submit(Request(p, greedy)) for p in PROMPTS[:3]]
    done = dict(generator.step() + generator.step())
    assert generator._ahead is not None
    generator.update_weights(tiny().state_dict())
    assert generator._ahead is None
    while not generator.idle:
        done.update(generator.step())
    assert [len(done[i].tokens) for i in ids] == [8, 8, 8]
