"""A request that keeps its slot (``keep_slot``) and a later request that ``continues`` it, as a
conversation's turns do: the continuation prefills only its new tokens, from the state every
layer kind kept (keys and values, MLA latents, Gated DeltaNet / KDA recurrent and convolution
state), and gets what the whole context run from scratch gets (bitwise in batch-invariant
mode). Kept slots are released, evicted for room, or given back when a continuation is refused,
so none leaks."""

import pytest
import torch

from torchloom.generate import engine
from torchloom.generate.engine import Completion, Generator, Request, SamplingParams, score
from torchloom.generate.graphs import DecodeGraphs
from torchloom.models import ModelConfig, build_model, resolve_model_config

MAX_LEN = 96
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [11, 12]}
MESSAGES = {("a", 1): [40, 41, 42], ("b", 1): [], ("a", 2): [60, 61, 62, 63, 64, 65, 66]}
FILLER = [1, 2, 3, 4]


def model_for(family: str, batch_invariant: bool):
    config = ModelConfig(name=family, flavor="debug", batch_invariant=batch_invariant)
    model = build_model(resolve_model_config(config))
    model.init_weights(0)
    return model.eval()


def params(name: str, turn: int) -> SamplingParams:
    """Conversation a is greedy, b and the filler sample, each turn with its own seed."""
    temperature = 0.0 if name == "a" else 1.0
    return SamplingParams(max_new_tokens=5 + turn, temperature=temperature, seed=10 * turn + 1)


def run_until_idle(generator: Generator, done: dict[int, Completion]) -> None:
    while not generator.idle:
        done.update(generator.step())


def conversations(generator: Generator) -> dict[tuple[str, int], tuple[list[int], Completion]]:
    """Two conversations over three slots: a for three turns, b for two (its second turn adds
    no message: the continuation prefills just the last reply token). Between turns a filler
    request decodes while a's and b's slots are kept, and the continuations are admitted while
    it still decodes (rows of one forward). Returns each turn's context and completion."""
    done: dict[int, Completion] = {}
    ids = {(n, 0): generator.submit(Request(PROMPTS[n], params(n, 0), keep_slot=True))
           for n in ("a", "b")}  # fmt: skip
    run_until_idle(generator, done)
    contexts = {key: PROMPTS[key[0]] for key in ids}
    filler = generator.submit(Request(FILLER, params("filler", 0)))
    generator.step()
    generator.step()
    for name, turn in (("a", 1), ("b", 1), ("a", 2)):
        before = (name, turn - 1)
        context = contexts[before] + done[ids[before]].tokens + MESSAGES[name, turn]
        request = Request(context, params(name, turn), keep_slot=turn == 1 and name == "a",
                          continues=ids[before])  # fmt: skip
        contexts[name, turn], ids[name, turn] = context, generator.submit(request)
        run_until_idle(generator, done)
    assert done[filler].finish_reason == "length"
    return {key: (contexts[key], done[i]) for key, i in ids.items()}


# (family, batch-invariant, decode): KV (llama3), Gated DeltaNet + gated attention (qwen3_5),
# MLA latents + MoE (deepseek_v3), window ring + compressed groups (deepseek_v4). "static" decodes as the GPU's CUDA graphs do (leading slots;
# the kept slots among them run dummy rows that must change nothing), here eagerly.
CASES = [("llama3", False, "gathered"), ("llama3", False, "static"), ("llama3", True, "gathered"),
         ("qwen3_5", False, "gathered"), ("qwen3_5", False, "static"), ("qwen3_5", True, "static"),
         ("deepseek_v3", False, "gathered"), ("deepseek_v4", False, "gathered"),
         ("deepseek_v4", False, "static")]  # fmt: skip


@pytest.mark.parametrize(
    "family,invariant,decode", CASES,
    ids=[f"{f}-{'invariant' if i else 'default'}-{d}" for f, i, d in CASES],
)  # fmt: skip
def test_a_continuation_equals_the_whole_context_from_scratch(family, invariant, decode):
    """Each turn's completion equals one request with its whole context on a fresh generator:
    the same tokens, log-probabilities bitwise in batch-invariant mode and within fp32 rounding
    otherwise."""
    model = model_for(family, invariant)
    generator = Generator(model, max_batch=3, max_len=MAX_LEN)
    if decode == "static":
        generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
    turns = conversations(generator)
    worst = 0.0
    for (name, turn), (context, got) in turns.items():
        alone = Generator(model, max_batch=1, max_len=MAX_LEN)
        want = alone.generate([Request(context, params(name, turn))])[0]
        assert got.tokens == want.tokens, f"{name} turn {turn}: {got.tokens} vs {want.tokens}"
        worst = max(worst, *(abs(g - w) for g, w in zip(got.logprobs, want.logprobs)))
    print(f"{family} {decode}: max |continued logprob - from scratch| = {worst:.1e}")
    assert worst == 0.0 if invariant else worst < 1e-5
    # Prefilled: the first prompts and the filler whole; each continuation only its message and
    # the previous reply's last token (sampled, never fed).
    continued = sum(len(MESSAGES[key]) + 1 for key in MESSAGES)
    assert (
        generator.prefill_tokens == len(PROMPTS["a"]) + len(PROMPTS["b"]) + len(FILLER) + continued
    )
    assert generator.kept == [] and sorted(generator._free) == [0, 1, 2]


def test_kept_slots_are_released_evicted_or_given_back():
    """No slot leaks: ``release`` frees a kept slot (and drops a waiting or running request,
    never reported); a new request with no free slot evicts the oldest kept one, whose
    continuation is then prefilled whole with the same result; a continuation whose prompt
    does not extend its request, or that is refused, gives the kept slot back."""
    model = model_for("llama3", False)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    generator = Generator(model, max_batch=2, max_len=MAX_LEN)
    first, second = (generator.generate([Request(p, greedy, keep_slot=True)])[0] for p in
                     ([3, 1, 4], [2, 7, 1, 8]))  # fmt: skip
    assert generator.kept == [0, 1] and generator._free == []
    # A third conversation evicts the oldest kept slot (request 0's).
    third = generator.submit(Request([9, 9], greedy, keep_slot=True))
    while not generator.step():
        pass
    assert generator.kept == [1, third]
    before = generator.prefill_tokens
    context = [3, 1, 4, *first.tokens, 50]
    evicted = generator.generate([Request(context, greedy, continues=0)])[0]
    assert generator.prefill_tokens - before == len(context)  # prefilled whole (evicting 1)
    assert (
        evicted.tokens
        == Generator(model, 1, MAX_LEN).generate([Request(context, greedy)])[0].tokens
    )
    assert generator.kept == [third]
    # A continuation that does not extend its request: an error, and the slot comes back.
    wrong = generator.generate([Request([9, 8, 7], greedy, continues=third)])[0]
    assert wrong.finish_reason == "error" and "does not start with" in wrong.error
    assert generator.kept == [] and sorted(generator._free) == [0, 1]
    # A refused continuation (too long for the context) gives its kept slot back too.
    kept = generator.submit(Request([4, 4], greedy, keep_slot=True))
    while not generator.step():
        pass
    refused = Request([4, 4] * 40, SamplingParams(max_new_tokens=40), continues=kept)
    assert generator.generate([refused])[0].finish_reason == "error"
    assert generator.kept == [] and sorted(generator._free) == [0, 1]
    # release: a kept slot once; a running and a waiting request are dropped unreported.
    kept = generator.submit(Request([4, 4], greedy, keep_slot=True))
    while not generator.step():
        pass
    assert generator.release(kept) and not generator.release(kept)
    running = [generator.submit(Request([5] * n, greedy)) for n in (2, 3, 4)]
    generator.step()  # two are admitted, the third waits
    assert all(generator.release(i) for i in running)
    assert generator.idle and generator.step() == [] and sorted(generator._free) == [0, 1]
    assert (first.finish_reason, second.finish_reason) == ("length", "length")


def joining_while_others_decode(
    model, requests: list[Request], **generator_args
) -> tuple[list[list[float]], list[int], int]:
    """Each request submitted after the step that follows the one before it (so it joins
    while those decode): every request's log-probabilities, the step() each finished in, and
    the model forwards run."""
    generator = Generator(model, max_len=MAX_LEN, **generator_args)
    forwards = 0

    def count(*_) -> None:
        nonlocal forwards
        forwards += 1

    hook = model.register_forward_hook(count)
    done: dict[int, Completion] = {}
    ended: dict[int, int] = {}
    ids = [generator.submit(requests[0])]
    steps = 0
    while not generator.idle:
        steps += 1
        for i, completion in generator.step():
            done[i], ended[i] = completion, steps
        if len(ids) < len(requests):
            ids.append(generator.submit(requests[len(ids)]))
    hook.remove()
    return [done[i].logprobs for i in ids], [ended[i] for i in ids], forwards


def test_short_prefills_advance_the_active_requests_in_the_same_forward(monkeypatch):
    """Rows up to MIXED_PREFILL_TOKENS long take the decoding requests along (one forward, not
    two); longer ones are followed by the decoding requests' own step in the same round. Both
    finish every request in the same rounds, and give it what it gets alone, bit for bit
    (batch-invariant mode)."""
    model = model_for("llama3", True)
    requests = [Request([7] * n, SamplingParams(max_new_tokens=6, seed=n)) for n in (3, 30, 4)]
    monkeypatch.setattr(engine, "MIXED_PREFILL_TOKENS", 64)
    mixed, mixed_ends, mixed_forwards = joining_while_others_decode(model, requests, max_batch=3)
    monkeypatch.setattr(engine, "MIXED_PREFILL_TOKENS", 0)
    apart, apart_ends, apart_forwards = joining_while_others_decode(model, requests, max_batch=3)
    print(f"finished in rounds: mixed {mixed_ends}, apart {apart_ends}; forwards: "
          f"{mixed_forwards} and {apart_forwards}")  # fmt: skip
    assert mixed == apart
    assert mixed_ends == apart_ends == [6, 7, 8]
    assert (mixed_forwards, apart_forwards) == (8, 10)


def test_many_active_rows_decode_apart_from_a_prefill(monkeypatch):
    """Past MIXED_PREFILL_PADDING (active rows x (longest row - 1) padding positions) the
    active requests do not ride along the prefill; each still advances in that round, and
    every request gets the same numbers, bit for bit."""
    model = model_for("llama3", True)
    requests = [Request([7] * n, SamplingParams(max_new_tokens=6, seed=n)) for n in (3, 30, 4)]
    got = {}
    for padding in (1024, 28):  # the 30-token prompt joins while one request decodes: 29
        monkeypatch.setattr(engine, "MIXED_PREFILL_PADDING", padding)
        got[padding] = joining_while_others_decode(model, requests, max_batch=3)
    assert got[1024][:2] == got[28][:2]
    assert (got[1024][2], got[28][2]) == (8, 9)


def test_waiting_requests_are_admitted_in_batches_while_others_decode():
    """With admit_batch 2, a request that arrives while others decode waits until two slots
    are free (or it is the last one waiting), so slots freed one by one are refilled by one
    prefill; the numbers do not change (batch-invariant mode)."""
    model = model_for("llama3", True)
    requests = [Request([7] * (n + 2), SamplingParams(max_new_tokens=3 + n, seed=n))
                for n in range(6)]  # fmt: skip
    at_once = Generator(model, max_batch=3, max_len=MAX_LEN, admit_batch=1)
    batched = Generator(model, max_batch=3, max_len=MAX_LEN, admit_batch=2)
    assert batched.admit_batch == 2 and Generator(model, max_batch=64).admit_batch == 8
    forwards = {}
    results = {}
    for name, generator in (("at_once", at_once), ("batched", batched)):
        prefills = 0
        original = generator._prefill

        def counted(admitted, original=original):
            nonlocal prefills
            prefills += 1
            return original(admitted)

        generator._prefill = counted
        results[name] = generator.generate(requests)
        forwards[name] = prefills
    assert [c.logprobs for c in results["at_once"]] == [c.logprobs for c in results["batched"]]
    assert forwards["batched"] < forwards["at_once"], forwards
    with pytest.raises(ValueError, match="admit_batch"):
        Generator(model, max_batch=3, admit_batch=0)


@pytest.mark.gpu
def test_kept_slots_survive_cuda_graph_decode():
    """On the GPU with captured decode graphs (qwen3_5 in bf16, recurrent layers), the kept
    slots inside a replayed bucket keep their state: the conversations give what the same
    static steps give without graphs, bit for bit."""
    model = model_for("qwen3_5", False).to("cuda", torch.bfloat16)
    captured = conversations(Generator(model, max_batch=3, max_len=MAX_LEN, cuda_graphs=True))
    eager = Generator(model, max_batch=3, max_len=MAX_LEN, cuda_graphs=False)
    eager.graphs = DecodeGraphs(model, eager.cache, score, capture=False)
    want = conversations(eager)
    for key, (_, got) in captured.items():
        assert got.tokens == want[key][1].tokens and got.logprobs == want[key][1].logprobs
