"""Batch-invariant mode (CPU reference kernels; on a GPU the Triton kernels): a sequence's
log-probabilities are bitwise the same whatever shares its batch and wherever it sits, in decode
and in a full forward, in the generator and in a training-mode forward."""

import itertools
import json
import random

import pytest
import torch

from torchloom.cli import main, resolve_job
from torchloom.config.errors import ConfigError
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.kernels import batch_invariant
from torchloom.models import ModelConfig, build_model, resolve_model_config
from torchloom.train.loss import IGNORE_INDEX, TokenLogProbs

# The debug flavors, and a shape where nothing is a multiple of 16: one kv head of head_dim 20
# (the GPU kernels need head_dim >= 16), widths 100 and 150, a vocabulary of 1000.
SHAPES = {
    "debug": {},
    "odd": {"dim": 100, "num_heads": 5, "num_kv_heads": 1, "head_dim": 20, "ffn_dim": 150,
            "vocab_size": 1000},
}  # fmt: skip


def invariant_model(
    family: str, dtype: torch.dtype = torch.float32, device: str = "cpu", shape: str = "debug"
):
    model_cfg = ModelConfig(name=family, flavor="debug", batch_invariant=True,
                            overrides=SHAPES[shape])  # fmt: skip
    model = build_model(resolve_model_config(model_cfg))
    model.init_weights(0)
    return model.to(device=device, dtype=dtype).eval()


TARGET = Request([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=8, seed=11))
OTHERS = [Request([7] * n, SamplingParams(max_new_tokens=5, seed=n)) for n in (2, 9, 4)]


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The defined order, written out here: lane i + lane i + half over the last dim zero-padded
    to a power of two, halving until one lane is left."""
    x = torch.nn.functional.pad(x, (0, (1 << (x.shape[-1] - 1).bit_length()) - x.shape[-1]))
    while x.shape[-1] > 1:
        x = x[..., : x.shape[-1] // 2] + x[..., x.shape[-1] // 2 :]
    return x[..., 0]


def assert_fixed_order_arithmetic(model, dtype: torch.dtype) -> None:
    """The CPU mode computes what docs/batch_invariance.md defines, bit for bit: linears as fp32
    products summed by the pairwise tree, attention per query over its own keys. A host whose
    BLAS happens to give the same bits for any row count (bf16 here) cannot show a swapped-in
    ``F.linear`` or another summation order through batch comparisons; this check can, given
    enough outputs that some round differently in bf16."""
    generator = torch.Generator().manual_seed(2)
    block = model.layers["0"]
    linears = [("q_proj", block.attention.q_proj)]
    if hasattr(block.mlp, "down_proj"):  # a dense feed-forward (an MoE layer's experts: below)
        linears.append(("down_proj", block.mlp.down_proj))
    for name, linear in linears:
        x = torch.randn(64, linear.weight.shape[1], generator=generator).to(dtype)
        want = _tree_sum(x.float()[:, None, :] * linear.weight.float()[None]).to(dtype)
        diff = (linear(x).float() - want.float()).abs().max().item()
        assert torch.equal(linear(x), want), f"{name}: not the fixed order, max |diff| {diff:.2e}"
    if hasattr(block.mlp, "experts"):  # MoE: the experts' rows, expert by expert, alike
        experts = block.mlp.experts
        x = torch.randn(512, experts.gate_proj.shape[2], generator=generator).to(dtype)
        ends = torch.tensor(
            [200, 200] + [512] * (experts.gate_proj.shape[0] - 2), dtype=torch.int32
        )
        rows = []
        for row, e in zip(x, [0] * 200 + [2] * 312, strict=True):
            gate, up = (_tree_sum(row.float() * w[e].float()).to(dtype)
                        for w in (experts.gate_proj, experts.up_proj))  # fmt: skip
            hidden = batch_invariant.pointwise(torch.nn.functional.silu, gate) * up
            rows.append(_tree_sum(hidden.float() * experts.down_proj[e].float()).to(dtype))
        assert torch.equal(experts(x, ends), torch.stack(rows)), "experts: not the fixed order"
    # Attention in fp32 whatever the case's dtype: it accumulates in fp32 for either, and a
    # bf16 output rounds most order differences away.
    B, H, K, T, d = 2, 4, 2, 48, 20
    q, k, v = (torch.randn(B, h, T, d, generator=generator) for h in (H, K, K))
    got = batch_invariant.causal_attention(q, k, v, None)
    want = torch.empty_like(got)
    for b, h, t in itertools.product(range(B), range(H), range(T)):
        keys, values = k[b, h // 2, : t + 1], v[b, h // 2, : t + 1]
        scores = _tree_sum(q[b, h, t] * keys) * d**-0.5
        weights = batch_invariant.pointwise(torch.exp, scores - scores.max())
        want[b, h, t] = _tree_sum((weights / _tree_sum(weights))[None, :] * values.T)
    diff = (got.float() - want.float()).abs().max().item()
    assert torch.equal(got, want), f"attention: not the fixed order, max |diff| {diff:.2e}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
def test_bitwise_across_batches_decode_and_trainer_forward(family, shape, dtype, device):
    model = invariant_model(family, dtype, device, shape)
    check_bitwise_across_batches(model, device, f"{family} {shape}")
    if device == "cpu":
        assert_fixed_order_arithmetic(model, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "kimi_linear", "deepseek_v3"])
def test_recurrent_and_latent_attention_families_bitwise(family, dtype, device):
    """Gated DeltaNet hybrids (Qwen3.5 dense, Qwen3-Next with its gated shared expert) and
    Kimi Linear's KDA: the delta rule token by token with fixed-order sums, the convolution
    tap by tap, every transcendental op through ``pointwise``. MLA (DeepSeek-V3, Kimi Linear):
    decode up-projects the cached latents as the trainer's forward does, no absorbed weights.
    The same checks as the dense families."""
    model = invariant_model(family, dtype, device)
    check_bitwise_across_batches(model, device, f"{family} debug")


def check_bitwise_across_batches(model, device: str, label: str) -> None:
    """The generator alone, in a batch and joining mid-decode, the trainer's forward, and every
    logit of a full forward alone and in a batch: bitwise the same."""
    alone = Generator(model, max_batch=1, max_len=64).generate([TARGET])[0]
    # Third of four in one batch; then last of four through two slots (joins mid-decode).
    mixed = Generator(model, max_batch=4, max_len=64).generate([*OTHERS[:2], TARGET, OTHERS[2]])[2]
    later = Generator(model, max_batch=2, max_len=64).generate([*OTHERS, TARGET])[3]
    assert alone.tokens == mixed.tokens == later.tokens
    assert alone.logprobs == mixed.logprobs == later.logprobs  # bitwise
    # The trainer's forward: train mode, a padded batch of 3 rows, the sequence in row 1.
    sequence = torch.tensor(TARGET.prompt_ids + alone.tokens, device=device)
    batch = torch.zeros(3, len(sequence), dtype=torch.long, device=device)
    batch[0], batch[1], batch[2, :4] = 5, sequence, 9
    # Through the trainer's own loss component (the RL objectives read it the same way).
    model.train()
    labels = torch.full_like(batch, IGNORE_INDEX)
    labels[1, :-1] = sequence[1:]
    out = model(batch, objective=TokenLogProbs(), targets={"labels": labels})
    prompt = len(TARGET.prompt_ids)
    logprobs = out.per_token["logprobs"][1, prompt - 1 : prompt - 1 + len(alone.tokens)]
    trainer = logprobs.tolist()
    print(f"{label} {device}: generator {alone.logprobs[:3]}..., trainer {trainer[:3]}...")
    assert trainer == alone.logprobs  # bitwise
    # Every logit of every position: the sequence alone, and fourth of five longer rows.
    rows = torch.randint(
        0, 1000, (5, len(sequence) + 7), generator=torch.Generator().manual_seed(1)
    )
    rows = rows.to(device)
    rows[3, : len(sequence)] = sequence
    with torch.no_grad():
        alone_TV, batch_TV = model(sequence[None])[0], model(rows)[3, : len(sequence)]
    diff = (alone_TV.float() - batch_TV.float()).abs().max().item()
    assert torch.equal(alone_TV, batch_TV), f"logits alone vs in a batch: max |diff| {diff:.2e}"


def test_random_shapes_bitwise_on_cpu():
    """Any head_dim (even), kv heads, group size and width, fp32 and bf16: the generator alone,
    in a batch and joining mid-decode, and the trainer's forward, agree bit for bit."""
    rng = random.Random(0)
    target = Request([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=5, seed=11))
    for _ in range(6):
        kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        overrides = {"dim": rng.randint(20, 130), "num_heads": kv_heads * group,
                     "num_kv_heads": kv_heads, "head_dim": rng.choice([6, 10, 14, 18, 22]),
                     "ffn_dim": rng.randint(30, 300), "vocab_size": rng.randint(200, 1500)}  # fmt: skip
        family, dtype = rng.choice(["llama3", "qwen3"]), rng.choice([torch.float32, torch.bfloat16])
        config = ModelConfig(name=family, batch_invariant=True, overrides=overrides)
        model = build_model(resolve_model_config(config))
        model.init_weights(0)
        model = model.to(dtype).eval()
        runs = [
            Generator(model, max_batch=1, max_len=48).generate([target])[0],
            Generator(model, max_batch=4, max_len=48).generate([*OTHERS[:2], target])[2],
            Generator(model, max_batch=2, max_len=48).generate([*OTHERS, target])[3],
        ]
        sequence = target.prompt_ids + runs[0].tokens
        rows = torch.randint(0, 200, (3, len(sequence) + 5), generator=torch.Generator())
        rows[1, : len(sequence)] = torch.tensor(sequence)
        logprobs = torch.log_softmax(model.train()(rows).float(), -1)[1]
        prompt = len(target.prompt_ids)
        trainer = [logprobs[prompt - 1 + i, t].item() for i, t in enumerate(runs[0].tokens)]
        label = f"{family} {dtype} {overrides}"
        assert all(r.tokens == runs[0].tokens for r in runs), label
        assert all(r.logprobs == runs[0].logprobs for r in runs), label
        assert trainer == runs[0].logprobs, f"{label}: trainer {trainer} vs {runs[0].logprobs}"


def test_normal_mode_is_not_bitwise_there(capsys):
    """What the mode buys: without it the same comparison differs by rounding (CPU BLAS)."""
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    model = build_model(config)
    model.init_weights(0)
    alone = Generator(model.eval(), max_batch=1, max_len=64).generate([TARGET])[0]
    sequence = torch.tensor([TARGET.prompt_ids + alone.tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(sequence).float(), -1)[0]
    full = [logprobs[4 + i, t].item() for i, t in enumerate(alone.tokens)]
    diff = max(abs(a - b) for a, b in zip(full, alone.logprobs))
    print(f"normal mode: max |decode - full forward| = {diff:.1e}")
    assert diff < 1e-5


def test_refusals():
    with pytest.raises(ConfigError, match="batch_invariant true brings its own"):
        resolve_model_config(ModelConfig(batch_invariant=True, attn_backend="flex"))
    with pytest.raises(ConfigError, match="whole-model ranks only"):
        resolve_job(["--recipe", "debug", "--model.batch_invariant", "true", "--parallel.tp", "2"])
    with pytest.raises(ConfigError, match="--compile.enabled true do not mix"):
        resolve_job(["--recipe", "debug", "--model.batch_invariant", "true",
                     "--compile.enabled", "true"])  # fmt: skip
    with pytest.raises(ValueError, match="compile and batch-invariant mode do not mix"):
        Generator(invariant_model("llama3"), max_batch=1, max_len=16, compile=True)


def test_generate_command_batch_invariant(tmp_path, hf_checkpoint):
    folder, _ = hf_checkpoint("llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([1, 2, 3], [4], [5, 6]))
    )
    outputs = []
    for max_batch in ("1", "3"):
        out = tmp_path / f"out{max_batch}.jsonl"
        assert main(["generate", "--from-hf", str(folder), "--prompts-file", str(prompts),
                     "--batch-invariant", "--max-new-tokens", "4", "--seed", "0",
                     "--max-batch", max_batch, "--output", str(out)]) == 0  # fmt: skip
        outputs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert outputs[0] == outputs[1]  # tokens and logprobs, bitwise, batch 1 vs 3
