"""DeepSeek-V3.2's sparse attention and its indexer training: the two stages (warm-up trains the
indexers alone and its KL falls; sparse training detaches the indexer's input), packed
documents (picks stay in their document), prefill then decode with the indexer's key cache,
and the refusals (other attention backends, warm-up with a moving routing bias)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.models.deepseek_v32 import DEEPSEEK_V32_FLAVORS, DeepSeekV32, DeepSeekV32Config

# 64 tokens, 16 picks per query: the sparse path selects.
TINY = replace(DEEPSEEK_V32_FLAVORS["debug"], vocab_size=256, index_topk=16, mtp_layers=0)


def _model(cfg: DeepSeekV32Config = TINY, randomize=None) -> DeepSeekV32:
    """The model of ``cfg`` in training mode: initialized from seed 0, or (``randomize``) with
    larger random weights, so its attention is far from uniform and the indexers far from it."""
    model = build_model(cfg)
    model.init_weights(0)
    if randomize is not None:
        randomize(model)
    return model.train()


def _batch(T: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(seed))


def _losses(model: DeepSeekV32, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean next-token cross-entropy, the indexers' KL summed over layers) of a training
    forward."""
    logits = model(tokens[:, :-1])
    lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return lm, model.auxiliary_losses()["indexer_kl"]


def _indexer(name: str) -> bool:
    return ".indexer." in name


def test_warmup_trains_the_indexers_alone_and_their_kl_falls(randomize) -> None:
    cfg = resolve_model_config(
        ModelConfig(name="deepseek_v32", flavor="debug", transforms=["dsa_warmup"])
    )
    assert cfg.indexer_train == "warmup" and cfg.moe.bias_update_rate == 0
    model = _model(replace(cfg, vocab_size=256, index_topk=16, mtp_layers=0), randomize)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(map(_indexer, trainable))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens, kls = _batch(), []
    for _ in range(8):
        lm, kl = _losses(model, tokens)
        (lm + kl).backward()
        for name, param in model.named_parameters():
            assert (param.grad is not None) == _indexer(name), name
        optimizer.step()
        optimizer.zero_grad()
        kls.append(kl.item())
    print(f"warm-up KL (3 layers): {' '.join(f'{k:.3f}' for k in kls)}")
    assert kls[-1] < 0.7 * kls[0]


def test_warmup_attends_densely() -> None:
    """In the warm-up the main attention ignores the picks: the logits are those of the same
    weights with a topk that keeps every key."""
    warm = _model(replace(TINY, indexer_train="warmup", moe=replace(TINY.moe, bias_update_rate=0)))
    dense = _model(replace(TINY, index_topk=64))
    with torch.no_grad():
        torch.testing.assert_close(warm.eval()(_batch()), dense.eval()(_batch()))


def test_sparse_training_detaches_the_indexer_input(randomize) -> None:
    """The KL loss alone gives gradients to the indexers only; the language-model loss alone
    gives them none. Trained on the KL alone, the indexers approach the sparse attention."""
    model = _model(randomize=randomize)
    lm, kl = _losses(model, _batch())
    kl.backward(retain_graph=True)
    for name, param in model.named_parameters():
        has_grad = param.grad is not None and bool(param.grad.abs().sum() > 0)
        assert has_grad == _indexer(name), name
    model.zero_grad(set_to_none=True)
    lm.backward()
    for name, param in model.named_parameters():
        assert (param.grad is None) == _indexer(name), name
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kls = []
    for _ in range(8):
        optimizer.zero_grad()
        _, kl = _losses(model, _batch())
        kl.backward()
        optimizer.step()
        kls.append(kl.item())
    print(f"sparse KL (3 layers, picked keys): {' '.join(f'{k:.3f}' for k in kls)}")
    assert kls[-1] < 0.7 * kls[0]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_the_same_gradients(mode, randomize) -> None:
    """The KL leaves its block as module state, not as an output: recomputing the blocks in
    the backward still gives every gradient, the indexers' included, bitwise."""
    from torchloom.train.remat import RematConfig, apply_remat

    grads = []
    for remat in ("none", mode):
        model = _model(randomize=randomize)
        apply_remat(model.layers, RematConfig(mode=remat), compile_enabled=False)
        lm, kl = _losses(model, _batch())
        (lm + kl).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(map(_indexer, grads[0]))
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


@torch.no_grad()
def test_packed_documents_attend_within_their_own() -> None:
    """Two documents packed in one row give each document's logits alone: no pick crosses."""
    model = _model().eval()
    first, second = _batch(40, seed=1)[:1], _batch(30, seed=2)[:1]
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(40), torch.arange(30)])[None]
    doc_ids = torch.cat([torch.zeros(40), torch.ones(30)]).long()[None]
    logits = model(packed, positions, doc_ids)
    for part, alone in ((logits[:, :40], model(first)), (logits[:, 40:], model(second))):
        diff = (part - alone).abs().max().item()
        print(f"  packed vs alone: max abs diff {diff:.2e}")
        torch.testing.assert_close(part, alone, rtol=1e-5, atol=1e-5)


def test_picks_are_visible_keys_and_short_rows_pick_all() -> None:
    indexer = _model().layers["1"].attention.indexer
    x_BTD, q_latent_BTq = torch.randn(1, 20, 64), torch.randn(1, 20, 32)
    cos, sin = TINY.rotary()(torch.arange(20)[None])
    picks_BTk = indexer.picks(indexer(x_BTD, q_latent_BTq, cos, sin))
    assert picks_BTk.shape == (1, 20, 16)
    for t in range(20):
        chosen = set(picks_BTk[0, t].tolist()) - {-1}
        assert max(chosen) <= t
        assert len(chosen) == min(t + 1, 16)


@torch.no_grad()
def test_prefill_then_decode_equals_the_full_forward(randomize) -> None:
    """Two prompts (20 and 27 tokens) prefilled together into slots 2 and 0, then decoded one
    token at a time past index_topk (16): every step's logits are the full forward's."""
    model = _model(randomize=randomize).eval()
    full = _batch(48, seed=3)
    expected = model(full)
    cache = model.new_cache(3, 64, torch.device("cpu"), torch.float32)
    slots, lengths = torch.tensor([2, 0]), torch.tensor([20, 27])
    positions = torch.arange(27).expand(2, 27)
    logits = model(full[:, :27], positions, cache=cache.bind(slots, positions, lengths))
    worst = 0.0
    for row, n in enumerate(lengths.tolist()):
        worst = max(worst, (logits[row, :n] - expected[row, :n]).abs().max().item())
    for step in range(20):
        positions = (lengths + step)[:, None]
        tokens = full.gather(1, positions)
        logits = model(tokens, positions, cache=cache.bind(slots, positions))
        for row in range(2):
            diff = (logits[row, 0] - expected[row, positions[row, 0]]).abs().max().item()
            worst = max(worst, diff)
    print(f"  prefill + decode vs full forward: max abs logit diff {worst:.2e}")
    assert worst < 1e-4 * expected.abs().max().item()


def test_generator_logprobs_equal_a_full_forward(randomize) -> None:
    """The generator under continuous batching (6 requests, 3 slots) on the decode path the
    GPU replays from CUDA graphs (leading slots, dummy rows at the last index), here eagerly,
    with 4 picks per query: its log-probabilities are a full forward's. (The gathered path:
    test_prefill_then_decode_equals_the_full_forward and the generate command's test.)"""
    from tests.generate.test_engine import PROMPTS, full_forward_logprobs
    from torchloom.generate.engine import Generator, Request, SamplingParams, score
    from torchloom.generate.graphs import DecodeGraphs

    cfg = replace(TINY, vocab_size=512, index_topk=4, index_num_heads=16)
    model = _model(cfg, randomize).eval()
    requests = [Request(p, SamplingParams(max_new_tokens=4 + 2 * i, seed=i))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    generator = Generator(model, max_batch=3, max_len=64)
    generator.graphs = DecodeGraphs(model, generator.cache, score, capture=False)
    worst = 0.0
    for request, completion in zip(requests, generator.generate(requests)):
        assert len(completion.tokens) == request.params.max_new_tokens
        reference = full_forward_logprobs(model, request.prompt_ids, completion.tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, completion.logprobs)))
    print(f"  max |generator logprob - full forward logprob| = {worst:.1e}")
    assert worst < 1e-4


def test_refusals_are_one_line() -> None:
    model = _model()
    with pytest.raises(ConfigError, match="does not divide the model's num_heads"):
        model.layers["0"].attention.check_tp(3)
    with pytest.raises(ConfigError, match="attends with SDPA"):
        replace(TINY, attn_backend="flex").validate()
    with pytest.raises(ConfigError, match="bias_update_rate 0.001 would still move"):
        replace(TINY, indexer_train="warmup").validate()
    with pytest.raises(ConfigError, match="needs a low-rank query"):
        replace(TINY, q_lora_rank=None).validate()


def test_flops_count_the_picked_keys_only() -> None:
    """Beyond index_topk keys the attention's FLOPs per token stop growing with the sequence."""
    attention = _model().layers["0"].attention
    short, long = (attention.flops_per_token(n) for n in (16, 4096))
    grow = (attention.flops_per_token(8192) - long) / (long - short)
    indexer = attention.indexer.flops_per_token
    assert grow == pytest.approx((indexer(8192) - indexer(4096)) / (long - short), rel=0.2)


def test_published_flavor_is_deepseek_v3_plus_the_indexers() -> None:
    """671B: DeepSeek-V3's parameters plus, in each of the 61 layers and the MTP depth, an
    indexer of 64 heads x 128 (wq_b from the 1536-wide query latent, wk, k_norm with its bias,
    weights_proj): 0.87B."""
    from torchloom.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS

    v32, v3 = DEEPSEEK_V32_FLAVORS["671B"], DEEPSEEK_V3_FLAVORS["671B"]
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert v32.num_params() - v3.num_params() == 62 * indexer
    print(f"671B: {v32.num_params() / 1e9:.2f}B (indexers {62 * indexer / 1e9:.2f}B)")
