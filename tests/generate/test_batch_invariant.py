"""Batch-invariant mode (CPU reference kernels; on a GPU the Triton kernels): a sequence's
log-probabilities are bitwise the same whatever shares its batch and wherever it sits, in decode
and in a full forward, in the generator and in a training-mode forward."""

import json

import pytest
import torch

from torchloom.cli import main, resolve_job
from torchloom.config.errors import ConfigError
from torchloom.generate.engine import Generator, Request, SamplingParams
from torchloom.models import ModelConfig, build_model, resolve_model_config


def invariant_model(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    config = resolve_model_config(ModelConfig(name=family, flavor="debug", batch_invariant=True))
    model = build_model(config, family)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to(device=device, dtype=dtype).eval()


TARGET = Request([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=8, seed=11))
OTHERS = [Request([7] * n, SamplingParams(max_new_tokens=5, seed=n)) for n in (2, 9, 4)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_bitwise_across_batches_decode_and_trainer_forward(family, dtype, device):
    model = invariant_model(family, dtype, device)
    alone = Generator(model, max_batch=1, max_len=64).generate([TARGET])[0]
    # Third of four in one batch; then last of four through two slots (joins mid-decode).
    mixed = Generator(model, max_batch=4, max_len=64).generate([*OTHERS[:2], TARGET, OTHERS[2]])[2]
    later = Generator(model, max_batch=2, max_len=64).generate([*OTHERS, TARGET])[3]
    assert alone.tokens == mixed.tokens == later.tokens
    assert alone.logprobs == mixed.logprobs == later.logprobs  # bitwise
    # The trainer's forward: train mode, a padded batch of 3 rows, the sequence in row 1.
    sequence = TARGET.prompt_ids + alone.tokens
    batch = torch.zeros(3, len(sequence), dtype=torch.long, device=device)
    batch[0], batch[1], batch[2, :4] = 5, torch.tensor(sequence), 9
    model.train()
    logprobs = torch.log_softmax(model(batch).float(), -1)[1]
    prompt = len(TARGET.prompt_ids)
    trainer = [logprobs[prompt - 1 + i, t].item() for i, t in enumerate(alone.tokens)]
    print(f"{family} {device}: generator {alone.logprobs[:3]}..., trainer {trainer[:3]}...")
    assert trainer == alone.logprobs  # bitwise


def test_normal_mode_is_not_bitwise_there(capsys):
    """What the mode buys: without it the same comparison differs by rounding (CPU BLAS)."""
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    model = build_model(config, "llama3")
    model.init_weights(torch.Generator().manual_seed(0))
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
