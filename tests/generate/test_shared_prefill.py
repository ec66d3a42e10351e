"""Requests admitted together with the same prompt (an RL group) share one prefill: the prompt
runs once, its slot's state is copied to the others', and each request continues exactly as if
it had been prefilled alone (bitwise in batch-invariant mode)."""

import pytest
import torch

from torchloom.generate.engine import Completion, Generator, Request, SamplingParams, score
from torchloom.generate.graphs import DecodeGraphs
from torchloom.models.components.cache import KVState, LatentState

from .test_batch_invariant import invariant_model
from .test_engine import RunningSum, tiny

GROUP, OTHER = [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7]

# (model, bitwise): batch-invariant KV models must match alone bit for bit; the others within
# rounding (deepseek_v3 keeps MLA's latent state, deepseek_v4 its window ring and compressed
# groups; neither has a batch-invariant mode).
MODELS = {
    "llama3-invariant": (lambda: invariant_model("llama3"), True),
    "qwen3-invariant": (lambda: invariant_model("qwen3"), True),
    "llama3": (lambda: tiny("llama3"), False),
    "deepseek_v3": (lambda: tiny("deepseek_v3"), False),
    "deepseek_v4": (lambda: tiny("deepseek_v4"), False),
}


def group_requests(temperature: float, new_tokens: list[int]) -> list[Request]:
    """Four requests on GROUP with their own seeds, and OTHER third among them."""
    prompts = [GROUP, GROUP, OTHER, GROUP, GROUP]
    return [Request(p, SamplingParams(max_new_tokens=n, temperature=temperature, seed=i))
            for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))]  # fmt: skip


def assert_as_if_alone(model, requests: list[Request], got: list[Completion], bitwise: bool):
    worst = 0.0
    for request, completion in zip(requests, got, strict=True):
        alone = Generator(model, max_batch=1, max_len=64).generate([request])[0]
        assert completion.tokens == alone.tokens, f"{completion.tokens} vs alone {alone.tokens}"
        diffs = [abs(a - b) for a, b in zip(completion.logprobs, alone.logprobs, strict=True)]
        worst = max(worst, *diffs)
    print(f"max |shared-prefill logprob - alone| = {worst:.1e}")
    assert worst == 0.0 if bitwise else worst < 1e-5


@pytest.mark.parametrize("decode", ["gathered", "static"])
@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
@pytest.mark.parametrize("name", MODELS)
def test_a_group_prefills_once_and_continues_as_if_alone(name, temperature, decode):
    make, bitwise = MODELS[name]
    model = make()
    requests = group_requests(temperature, [6, 5, 6, 4, 6])
    generator = Generator(model, max_batch=5, max_len=64)
    if decode == "static":  # the decode steps a GPU replays from CUDA graphs, run eagerly
        generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
    got = generator.generate(requests)
    assert generator.prefill_tokens == len(GROUP) + len(OTHER)  # one row per distinct prompt
    assert_as_if_alone(model, requests, got, bitwise)
    if temperature:  # each request drew from the shared row with its own seed
        assert len({tuple(c.tokens) for i, c in enumerate(got) if i != 2}) > 1


@pytest.mark.parametrize("name", ["llama3-invariant", "deepseek_v3", "deepseek_v4"])
def test_identical_prompts_in_different_rounds(name):
    """Three slots: round 1 admits the first two GROUP requests (sharing) and OTHER; when the
    two end, the last two GROUP requests are admitted together while OTHER still decodes."""
    make, bitwise = MODELS[name]
    model = make()
    requests = group_requests(1.0, [4, 4, 9, 5, 6])
    generator = Generator(model, max_batch=3, max_len=64)
    got = generator.generate(requests)
    assert generator.prefill_tokens == 2 * len(GROUP) + len(OTHER)
    assert_as_if_alone(model, requests, got, bitwise)


def test_copy_slot_copies_the_first_length_positions_of_each_kind():
    """Up to ``length`` (a whole slot too); the rest of the target slots is left alone."""
    cpu = torch.device("cpu")
    kv, latent = (
        KVState(4, 2, 8, 3, cpu, torch.float32),
        LatentState(4, 8, 5, 2, cpu, torch.float32),
    )
    for state, tensors, position_dim in ((kv, [kv.k, kv.v], 1), (latent, [latent.entries], 0)):
        for length in (5, 8):
            for t in tensors:
                t.normal_()
            before = [t.clone() for t in tensors]
            state.copy_slot(2, torch.tensor([0, 3]), length)
            for t, old in zip(tensors, before, strict=True):
                copied, kept = t.split([length, 8 - length], dim=position_dim + 1)
                want_copied, want_kept = old.split([length, 8 - length], dim=position_dim + 1)
                assert torch.equal(copied[[0, 2, 3]], want_copied[[2, 2, 2]])
                assert torch.equal(copied[1], want_copied[1]) and torch.equal(kept, want_kept)


def test_a_recurrent_layer_kind_shares_its_state():
    """A state not indexed by position (test_engine's toy recurrent mixer as layer 0) copies
    its whole slot; the group still continues as if alone."""
    model = tiny()
    mixer = RunningSum(model.config.dim)
    for seed, linear in enumerate((mixer.u, mixer.o)):
        torch.nn.init.normal_(
            linear.weight, std=0.02, generator=torch.Generator().manual_seed(seed)
        )
    model.layers["0"].attention = mixer
    requests = group_requests(1.0, [6, 5, 6, 4, 6])
    generator = Generator(model, max_batch=5, max_len=64)
    got = generator.generate(requests)
    assert generator.prefill_tokens == len(GROUP) + len(OTHER)
    assert_as_if_alone(model, requests, got, bitwise=False)
