"""The generator on the model's own forward: log-probabilities equal a full forward pass,
continuous batching changes nothing, bad requests fail alone, sampling settings behave; the
submit/step API, the caller's module mode, and layer kinds that bring their own generation state
(weights updated in place: test_weights.py)."""

import json

import pytest
import torch
from torch import nn

from torchloom.checkpoint.model_io import save_model
from torchloom.cli import main
from torchloom.generate.engine import Completion, Generator, Request, SamplingParams, score
from torchloom.generate.graphs import DecodeGraphs, buckets
from torchloom.kernels.attention_mask import AttentionMask
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.components.attention import Attention


def tiny(family: str = "llama3"):
    config = resolve_model_config(ModelConfig(name=family, flavor="debug"))
    model = build_model(config)
    model.init_weights(0)
    return model.eval()


def full_forward_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    device = next(model.parameters()).device
    with torch.no_grad():
        sequence = torch.tensor([prompt + tokens], device=device)
        logprobs = torch.log_softmax(model(sequence).float(), -1)[0]
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9] * 11, [4, 4, 4], [100, 200, 300, 400], [5]]


@pytest.mark.parametrize("decode", ["gathered", "static"])
@pytest.mark.parametrize(
    "family", ["llama3", "qwen3", "deepseek_v3", "kimi_linear", "qwen3_next", "qwen3_5"]
)
def test_logprobs_equal_a_full_forward_under_continuous_batching(family, decode):
    """6 requests of different lengths through 3 cache slots: requests join as others end.
    "static" runs the decode steps the GPU replays from CUDA graphs (leading slots, bucketed
    row counts, free slots on dummy tokens), here eagerly. deepseek_v3 decodes from its latent
    cache (multi-head latent attention, kv_b_proj absorbed); kimi_linear's KDA layers and
    qwen3_next's / qwen3_5's Gated DeltaNet layers from their recurrent state."""
    model = tiny(family)
    requests = [Request(p, SamplingParams(max_new_tokens=4 + 2 * i, seed=i))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    generator = Generator(model, max_batch=3, max_len=64)
    if decode == "static":
        generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
    completions = generator.generate(requests)
    worst = 0.0
    for request, completion in zip(requests, completions):
        assert completion.finish_reason == "length"
        assert len(completion.tokens) == request.params.max_new_tokens
        reference = full_forward_logprobs(model, request.prompt_ids, completion.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    print(f"{family}: max |generator logprob - full forward logprob| = {worst:.1e}")
    assert worst < 1e-5


def sliding_qwen3(chunk: int | None = None):
    """The qwen3 debug model with a sliding layer (window 4) then a full one; with ``chunk``,
    its full layer attends in chunks instead (a mask set on the built layer)."""
    from dataclasses import replace

    base = resolve_model_config(ModelConfig(name="qwen3", flavor="debug"))
    config = replace(base, layer_types=("sliding_attention", "full_attention"), sliding_window=4)
    model = build_model(config)
    model.init_weights(0)
    if chunk is not None:
        model.layers["1"].attention.mask = AttentionMask(chunk=chunk)
    return model.eval()


@pytest.mark.parametrize("chunk", [None, 5], ids=["window", "window+chunk"])
def test_sliding_and_chunked_layers_decode_as_full_forwards(chunk):
    """Prompts longer than the window, prefilled then decoded through the KV cache: every
    logprob equals the full forward's, so the cache hides the keys each layer's mask hides."""
    model = sliding_qwen3(chunk)
    requests = [Request(p, SamplingParams(max_new_tokens=6, seed=i))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    completions = Generator(model, max_batch=3, max_len=64).generate(requests)
    worst = 0.0
    for request, completion in zip(requests, completions):
        reference = full_forward_logprobs(model, request.prompt_ids, completion.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    print(f"sliding qwen3 chunk={chunk}: max |generator - full forward| logprob = {worst:.1e}")
    assert worst < 1e-5
    # The masks matter: the same weights with full attention give other logprobs.
    for layer in model.layers.values():
        layer.attention.mask = AttentionMask()
    request, completion = requests[2], completions[2]  # an 11-token prompt
    full = full_forward_logprobs(model, request.prompt_ids, completion.tokens)
    assert max(abs(a - b) for a, b in zip(full, completion.logprobs)) > 1e-3


def test_greedy_matches_repeated_full_forward_and_batch_does_not_matter():
    model = tiny()
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    alone = [Generator(model, max_batch=1).generate([Request(p, params)])[0] for p in PROMPTS]
    together = Generator(model, max_batch=4).generate([Request(p, params) for p in PROMPTS])
    for prompt, a, b in zip(PROMPTS, alone, together):
        tokens = list(prompt)
        for _ in range(10):
            with torch.no_grad():
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert a.tokens == b.tokens == tokens[len(prompt) :]


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]


def test_greedy_steps_launched_ahead_change_nothing():
    """Greedy rows on the static path launch each step before the last one is read (its inputs
    stay on the device). With requests that join, leave at their length or at a stop token, and
    finish inside a step already launched, every request gets what the plain decode gives."""
    model = tiny()

    def run(static: bool, stop_ids: tuple[int, ...] = ()) -> tuple[list[Completion], int]:
        generator = Generator(model, max_batch=3, max_len=64)
        ahead = 0
        if static:
            graphs = DecodeGraphs(model, generator.cache, score, capture=False)
            launch = graphs.launch

            def counting_launch(*inputs):
                nonlocal ahead
                ahead += not inputs
                return launch(*inputs)

            graphs.launch = counting_launch
            generator.graphs = graphs
        params = [SamplingParams(max_new_tokens=3 + 2 * i, temperature=0.0, stop_ids=stop_ids)
                  for i in range(len(PROMPTS))]  # fmt: skip
        return generator.generate([Request(p, q) for p, q in zip(PROMPTS, params)]), ahead

    plain, _ = run(static=False)
    stop = plain[5].tokens[4]  # a token the longest request meets midway
    for stop_ids in ((), (stop,)):
        want, _ = run(static=False, stop_ids=stop_ids)
        got, ahead = run(static=True, stop_ids=stop_ids)
        assert ahead > 0
        assert [c.tokens for c in got] == [c.tokens for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        for g, w in zip(got, want):
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    assert "stop" in [c.finish_reason for c in got]


@pytest.mark.gpu
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_cuda_graph_decode_replays_the_static_step_bitwise(greedy):
    model = tiny().to("cuda", torch.bfloat16)
    temperature = 0.0 if greedy else 1.0
    requests = [Request(p, SamplingParams(max_new_tokens=6 + i, seed=i, temperature=temperature))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    # the forward at every batch on both sides (the fused step is not bitwise the forward)
    captured = Generator(model, max_batch=4, max_len=64, cuda_graphs=True, step_kernel="torch")
    eager = Generator(model, max_batch=4, max_len=64, cuda_graphs=False)
    eager.graphs = DecodeGraphs(model, eager.cache, score, capture=False)
    a, b = captured.generate(requests), eager.generate(requests)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    worst = max(
        abs(x - y)
        for request, c in zip(requests, a)
        for x, y in zip(full_forward_logprobs(model, request.prompt_ids, c.tokens), c.logprobs)
    )
    print(f"bf16 cuda graphs: max |generator - full forward| logprob = {worst:.2e}")
    assert worst < 0.1


@pytest.mark.slow
def test_compiled_generator_stacks_projections_on_cpu():
    """Generator(compile=True) stacks q/k/v and gate/up before compiling its step, and compiles
    its text prefills too (inductor on the CPU here, fp32): the same tokens as the plain
    generator, log-probabilities within 1e-5, over prefills of 3, 1 and 2 rows of other
    lengths. Each compiled function holds two graphs at most: batch 1 (specialised) and one
    for every other batch (the cache's and the step buffers' sizes are static, so a batch
    equal to them at the first compile is not tied to them)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from torchloom.generate.engine import _text_forward

    torch._dynamo.reset()
    model = tiny("qwen3")
    plain = Generator(model, max_batch=3, max_len=32)
    assert all(m.fused_in is None for m in model.modules() if isinstance(m, Attention))
    compiled = Generator(model, max_batch=3, max_len=32, compile=True)
    assert all(m.fused_in is not None for m in model.modules() if isinstance(m, Attention))
    for prompts in (PROMPTS[:3], [PROMPTS[2]], [[1] * 17, [2] * 3]):
        requests = [Request(p, SamplingParams(max_new_tokens=4, temperature=0.0)) for p in prompts]
        got, want = compiled.generate(requests), plain.generate(requests)
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for a, b in zip(got, want):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    prefill = _debug_get_cache_entry_list(_text_forward(model).__code__)
    assert compiled.graphs is not None
    decode = _debug_get_cache_entry_list(compiled.graphs._model_step(model).__code__)
    print(f"compiled graphs: prefill {len(prefill)}, decode step {len(decode)}")
    assert 1 <= len(prefill) <= 2 and 1 <= len(decode) <= 2


@pytest.mark.gpu
def test_compiled_decode_runs_stacked_projections():
    """Generator(compile=True) stacks q/k/v and gate/up (models/components/fused_linear.py) and
    its compiled, captured decode still gives what a full forward gives (bf16)."""
    model = tiny("qwen3").to("cuda", torch.bfloat16)
    requests = [Request(p, SamplingParams(max_new_tokens=6 + i, temperature=0.0))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    plain = Generator(model, max_batch=4, max_len=64).generate(requests)
    compiled = Generator(model, max_batch=4, max_len=64, compile=True)
    assert all(m.fused_in is not None for m in model.modules() if isinstance(m, Attention))
    got = compiled.generate(requests)
    worst = max(
        abs(x - y)
        for request, c in zip(requests, got)
        for x, y in zip(full_forward_logprobs(model, request.prompt_ids, c.tokens), c.logprobs)
    )
    same = sum(a.tokens == b.tokens for a, b in zip(got, plain))
    print(f"compiled + stacked: max |generator - full forward| logprob = {worst:.2e}, "
          f"{same}/{len(got)} completions as the uncompiled generator's")  # fmt: skip
    assert worst < 0.1


def test_bad_requests_fail_alone():
    model = tiny()
    good = Request([1, 2, 3], SamplingParams(max_new_tokens=6, seed=7))
    bad = {
        "outside the vocabulary": Request([1, 99999], SamplingParams(max_new_tokens=4)),
        "exceed the context": Request([1] * 60, SamplingParams(max_new_tokens=10)),
        "top_p": Request([1], SamplingParams(top_p=0.0)),
        "temperature": Request([1], SamplingParams(temperature=-1.0)),
        "empty": Request([], SamplingParams(max_new_tokens=4)),
    }
    generator = Generator(model, max_batch=2, max_len=64)
    alone = generator.generate([good])[0]
    mixed = generator.generate([*bad.values(), good])
    for (reason, _), completion in zip(bad.items(), mixed):
        print(f"{reason}: {completion.error}")
        assert completion.finish_reason == "error" and reason in completion.error
        assert completion.tokens == []
    assert mixed[-1].tokens == alone.tokens and mixed[-1].finish_reason == "length"


def test_sampling_settings():
    model = tiny()
    generator = Generator(model, max_batch=4)

    def run(**kw) -> Completion:
        return generator.generate([Request([3, 1, 4], SamplingParams(max_new_tokens=12, **kw))])[0]

    greedy = run(temperature=0.0)
    top_1 = run(top_k=1, seed=1)
    assert top_1.tokens == greedy.tokens  # one candidate: the argmax
    # A sampled token's logprob is its sampling distribution's (one candidate: certain); a
    # greedy token's is the model's own.
    assert top_1.logprobs == [0.0] * 12 and all(lp < 0 for lp in greedy.logprobs)
    assert run(seed=5).tokens == run(seed=5).tokens  # per-request seeds reproduce
    assert run(seed=5).tokens != run(seed=6).tokens
    assert run(top_p=1e-6, seed=2).tokens == greedy.tokens  # top-p keeps the most likely one
    stop = greedy.tokens[3]
    stopped = run(temperature=0.0, stop_ids=(stop,))
    first = greedy.tokens.index(stop)
    assert stopped.finish_reason == "stop" and stopped.tokens == greedy.tokens[: first + 1]


def test_generate_command(tmp_path, hf_checkpoint):
    folder, _ = hf_checkpoint("llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt_ids": [1, 2, 3]}) + "\n" + json.dumps({"prompt_ids": [1, 9999]})
        + "\n" + json.dumps({"prompt_ids": [5]}) + "\n"
    )  # fmt: skip
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--from-hf", str(folder), "--prompts-file", str(prompts),
                 "--max-new-tokens", "5", "--seed", "1", "--output", str(output)]) == 0  # fmt: skip
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [len(r["tokens"]) for r in records] == [5, 0, 5]
    assert len(records[0]["logprobs"]) == 5 and "vocabulary" in records[1]["error"]
    assert main(["generate", "--from-hf", str(folder), "--prompts-file", str(prompts),
                 "--top-p", "0"]) == 2  # fmt: skip


def test_generate_command_on_a_saved_deepseek_v3_model(tmp_path):
    """`torchloom generate --checkpoint` on a torchloom model folder of the deepseek_v3 debug
    flavor (latent cache, MoE, MTP depths unused): greedy tokens are the full forward's."""
    model = tiny("deepseek_v3")
    save_model(model, "deepseek_v3", model.config, tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n"
                       + json.dumps({"prompt_ids": [9]}) + "\n")  # fmt: skip
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--checkpoint", str(tmp_path / "model"), "--prompts-file",
                 str(prompts), "--max-new-tokens", "6", "--temperature", "0", "--output",
                 str(output)]) == 0  # fmt: skip
    records = [json.loads(line) for line in output.read_text().splitlines()]
    for record, prompt in zip(records, ([5, 6, 7], [9]), strict=True):
        tokens = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert record["tokens"] == tokens[len(prompt) :]


# -- submit / step ---------------------------------------------------------------------------


def test_submit_and_step_report_requests_as_they_finish():
    """Two slots: A (3 tokens) and B (6) prefill in round 1; C, submitted while they decode,
    waits for A's slot and is prefilled in round 4, where B advances in the same forward (C's
    prompt is short); a bad request is reported by the next step. Every request gets what it
    gets alone."""
    model = tiny()
    greedy = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (3, 6, 2)]
    a, b, c = (Request(p, q) for p, q in zip(PROMPTS, greedy))
    generator = Generator(model, max_batch=2, max_len=64)
    assert generator.idle and generator.step() == []
    assert [generator.submit(a), generator.submit(b)] == [0, 1]
    assert not generator.idle
    rounds = [generator.step()]
    assert generator.submit(c) == 2
    assert generator.submit(Request([], SamplingParams())) == 3
    while not generator.idle:
        rounds.append(generator.step())
    finished = [[(i, len(done.tokens)) for i, done in r] for r in rounds]
    print("finished per round:", finished)
    assert finished == [[], [(3, 0)], [(0, 3)], [], [(2, 2)], [(1, 6)]]
    bad = rounds[1][0][1]
    assert bad.finish_reason == "error" and "empty" in bad.error
    results = {i: done for r in rounds for i, done in r}
    for i, request in enumerate((a, b, c)):
        alone = Generator(model, max_batch=1, max_len=64).generate([request])[0]
        assert results[i].tokens == alone.tokens and results[i].finish_reason == "length"
        assert max(abs(x - y) for x, y in zip(results[i].logprobs, alone.logprobs)) < 1e-5


def test_generate_alongside_submitted_requests():
    """generate() returns its own requests; one submitted before is reported by step()."""
    model = tiny()
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    generator = Generator(model, max_batch=2, max_len=64)
    early = generator.submit(Request(PROMPTS[0], params))
    generator.step()
    short = SamplingParams(max_new_tokens=2, temperature=0.0)
    mine = generator.generate([Request(PROMPTS[1], short), Request(PROMPTS[2], short)])
    assert [len(c.tokens) for c in mine] == [2, 2]
    rest: list[tuple[int, Completion]] = []
    while not generator.idle:
        rest += generator.step()
    assert [(i, len(c.tokens)) for i, c in rest] == [(early, 8)]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_module_mode_is_left_as_it_was(mode):
    model = tiny().train(mode == "train")
    requests = [Request(p, SamplingParams(max_new_tokens=4, seed=i)) for i, p in enumerate(PROMPTS)]
    completions = Generator(model, max_batch=3, max_len=64).generate(requests)
    assert all(m.training == (mode == "train") for m in model.modules())
    other = tiny().train(mode != "train")  # the same weights in the other mode: same numbers
    again = Generator(other, max_batch=3, max_len=64).generate(requests)
    assert [c.logprobs for c in completions] == [c.logprobs for c in again]


# -- layer kinds -----------------------------------------------------------------------------


def test_every_layer_allocates_its_own_state(monkeypatch):
    model = tiny()
    calls = []
    new_state = Attention.new_state

    def counting(self, slots, max_len, device, *args):
        if device.type != "meta":  # the cache's size is counted on the meta device first
            calls.append(self)
        return new_state(self, slots, max_len, device, *args)

    monkeypatch.setattr(Attention, "new_state", counting)
    Generator(model, max_batch=2, max_len=16)
    assert calls == [block.attention for block in model.layers.values()]


class RunningSum(nn.Module):
    """A toy recurrent mixer: out_t = o(sum of u(x_s) for s <= t). Its generation state is one
    vector per slot (no k_proj, no KV), reset where a sequence starts and carried over the
    right-padding of a prefill without taking it in."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.u, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x_BTD, cos_BTd, sin_BTd, documents=None, cache=None):
        u_BTD = self.u(x_BTD)
        if cache is not None:
            return self.o(cache.run(u_BTD))
        return self.o(u_BTD.cumsum(1))

    def new_state(self, slots, max_len, device, dtype):
        return RunningSumState(torch.zeros(slots, self.u.weight.shape[0], device=device))


class RunningSumState:
    def __init__(self, h_SD: torch.Tensor) -> None:
        self.h_SD = h_SD

    def bound(self, binding):
        return BoundRunningSum(self.h_SD, binding)

    def copy_slot(self, src_slot: int, dst_slots_S: torch.Tensor, length: int) -> None:
        self.h_SD[dst_slots_S] = self.h_SD[src_slot].clone()  # not by position: the whole slot


class BoundRunningSum:
    def __init__(self, h_SD, binding) -> None:
        self.h_SD, self.binding = h_SD, binding

    def run(self, u_BTD: torch.Tensor) -> torch.Tensor:
        slots_B, positions_BT = self.binding.slot_ids_B, self.binding.positions_BT
        fresh_B1 = positions_BT[:, :1] == 0  # a new sequence in this slot
        start_BD = torch.where(fresh_B1, 0.0, self.h_SD[slots_B])
        h_BTD = start_BD[:, None] + u_BTD.cumsum(1)
        lengths_B = self.binding.lengths_B
        last_B = lengths_B if lengths_B is not None else torch.full_like(slots_B, u_BTD.shape[1])
        self.h_SD[slots_B] = h_BTD[torch.arange(len(slots_B)), last_B - 1]
        return h_BTD


@pytest.mark.parametrize("decode", ["gathered", "static"])
def test_a_model_with_a_recurrent_layer_kind(decode):
    """Layer 0's mixer is a toy recurrent kind with its own state: the generator (which reads
    no layer's attributes) still matches a full forward under continuous batching."""
    model = tiny()
    mixer = RunningSum(model.config.dim)
    nn.init.normal_(mixer.u.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    nn.init.normal_(mixer.o.weight, std=0.02, generator=torch.Generator().manual_seed(1))
    model.layers["0"].attention = mixer
    requests = [Request(p, SamplingParams(max_new_tokens=4 + 2 * i, seed=i))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    generator = Generator(model, max_batch=3, max_len=64)
    if decode == "static":
        generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
    worst = 0.0
    for request, completion in zip(requests, generator.generate(requests)):
        assert len(completion.tokens) == request.params.max_new_tokens
        reference = full_forward_logprobs(model, request.prompt_ids, completion.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    print(f"recurrent layer kind ({decode}): max |generator - full forward| = {worst:.1e}")
    assert worst < 1e-5


def test_moe_decode_with_expert_loops_is_not_captured():
    """An MoE layer whose experts run as a loop (batch-invariant mode; not bf16 on Hopper)
    reads row counts on the host: its decode step cannot be a CUDA graph. The generator says
    so (GPU: test_moe_decode_capture_on_cuda)."""
    from torchloom.generate.engine import _host_reads

    assert _host_reads(tiny(), torch.float32) is None  # no experts
    why = _host_reads(tiny("qwen3_moe"), torch.bfloat16)
    assert "experts" in why and "on this device" in why
    invariant = ModelConfig(name="qwen3_moe", flavor="debug", batch_invariant=True)
    assert "batch-invariant" in _host_reads(
        build_model(resolve_model_config(invariant)), torch.float32
    )


@pytest.mark.gpu
def test_moe_decode_capture_on_cuda():
    """bf16 experts on Hopper (torch._grouped_mm) are captured; invariant ones run eagerly by
    default and refuse an explicit cuda_graphs=True with the reason."""
    model = tiny("qwen3_moe").to("cuda", torch.bfloat16)
    requests = [Request(p, SamplingParams(max_new_tokens=4, temperature=0.0)) for p in PROMPTS]
    if torch.cuda.get_device_capability() >= (9, 0):
        captured = Generator(model, max_batch=4, max_len=64)
        assert captured.graphs is not None
        eager = Generator(model, max_batch=4, max_len=64, cuda_graphs=False)
        assert [c.tokens for c in captured.generate(requests)] == [
            c.tokens for c in eager.generate(requests)
        ]
    invariant = ModelConfig(name="qwen3_moe", flavor="debug", batch_invariant=True)
    model = build_model(resolve_model_config(invariant))
    model.init_weights(0)
    model = model.eval().to("cuda", torch.bfloat16)
    assert Generator(model, max_batch=4, max_len=64).graphs is None
    assert Generator(model, max_batch=4, max_len=64).generate(requests)[0].tokens
    with pytest.raises(ValueError, match="batch-invariant mode"):
        Generator(model, max_batch=4, max_len=64, cuda_graphs=True)


def test_the_cache_is_counted_before_it_is_allocated() -> None:
    """``ModelCache.nbytes`` on a meta-device cache: what the layers' states allocate, for every
    family (its own state kinds), and for two kinds by their shapes (llama3's keys and values,
    deepseek_v3's latent and shared rotary key per layer)."""
    from torchloom.models.registry import list_models

    meta, cpu = torch.device("meta"), torch.device("cpu")
    for spec in list_models():
        model = build_model(resolve_model_config(ModelConfig(name=spec.name, flavor="debug")))
        counted = model.new_cache(3, 32, meta, torch.float32).nbytes()
        assert counted == model.new_cache(3, 32, cpu, torch.float32).nbytes() > 0, spec.name
    c = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    kv = 2 * c.num_layers * 3 * c.num_kv_heads * 32 * c.resolved_head_dim * 4
    assert tiny("llama3").new_cache(3, 32, meta, torch.float32).nbytes() == kv
    c = resolve_model_config(ModelConfig(name="deepseek_v3", flavor="debug"))
    latent = c.num_layers * 3 * 32 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert tiny("deepseek_v3").new_cache(3, 32, meta, torch.float32).nbytes() == latent


def test_a_cache_larger_than_the_memory_available_is_refused_before_allocation(capsys) -> None:
    """Allocating it would fail, or on the CPU get the process killed without a word."""
    from torchloom.generate.engine import CacheTooLarge

    with pytest.raises(CacheTooLarge, match=r"a generation cache of 100000000 slots x 64 tokens "
                       r"needs [\d.]+ GiB, but the cpu device has [\d.]+ GiB available; lower "
                       "max_batch"):  # fmt: skip
        Generator(tiny(), max_batch=10**8, max_len=64)
    Generator(tiny(), max_batch=4, max_len=64)  # a cache that fits is built as before
