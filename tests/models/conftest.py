"""Shared fixtures for the model tests: Hugging Face reference models with our weights, and a
recurrent layer's padded prefill."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from torchloom.checkpoint.safetensors_io import iter_tensors
from torchloom.cli import main
from torchloom.models import Decoder, get_model_spec

HFBuilder = Callable[[Decoder, str], nn.Module]


@pytest.fixture
def hf_model() -> HFBuilder:
    """Build the transformers reference of torchloom family ``family`` holding ``model``'s weights
    (config and names mapped by the family's HF adapter)."""

    def build(model: Decoder, family: str) -> nn.Module:
        import transformers

        adapter = get_model_spec(family).hf_adapter
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        }[adapter.model_type]
        hf_config = config_cls(**adapter.config_to_hf(model.config), attn_implementation="eager")
        reference = model_cls(hf_config).eval()
        state = {adapter.to_hf_name(k): v for k, v in model.state_dict().items()}
        missing, unexpected = reference.load_state_dict(state, strict=False)
        tied = ["lm_head.weight"] if model.config.tie_embeddings else []
        assert sorted(missing) == tied and not unexpected, (missing, unexpected)
        return reference

    return build


@pytest.fixture
def randomize() -> Callable[[Decoder, int], None]:
    """Give every weight (norms and MoE choice biases included) a distinct random value,
    reproducibly."""

    @torch.no_grad()
    def fill(model: Decoder, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))

    return fill


@pytest.fixture
def generate_matches_greedy(tmp_path: Path) -> Callable[[Path, nn.Module, int], None]:
    """Check that `torchloom generate` on the Hugging Face folder ``path``, with prompts of
    different lengths decoded together, gives ``reference``'s greedy continuations."""

    def check(path: Path, reference: nn.Module, max_new_tokens: int) -> None:
        from torchloom.cli import main

        prompts = [[5, 17, 300, 2], [9], [44, 45, 46, 47, 48, 49]]
        prompts_file = tmp_path / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
        out = tmp_path / "out.jsonl"
        assert main(["generate", "--from-hf", str(path), "--prompts-file", str(prompts_file),
                     "--greedy", "--max-new-tokens", str(max_new_tokens), "--device", "cpu",
                     "--dtype", "fp32", "--output", str(out)]) == 0  # fmt: skip
        ours = [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
        for prompt, tokens in zip(prompts, ours, strict=True):
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()  # fmt: skip
            assert tokens == expected, (prompt, tokens, expected)

    return check


@pytest.fixture
def padded_prefill():
    """``prefill(layer, x_BTD, lengths, slots) -> (state, out)``: a generation state for the
    recurrent layer with stale values in every slot (a row at position 0 must ignore them), and
    the layer's output for the rows' first ``lengths`` tokens right-padded into one prefill into
    ``slots``."""
    from torchloom.models.components.cache import Binding

    def prefill(layer: nn.Module, x_BTD: torch.Tensor, lengths: list[int], slots: list[int]):
        state = layer.new_state(slots=max(slots) + 1, max_len=32, device=torch.device("cpu"),
                                dtype=torch.float32)  # fmt: skip
        state.recurrent.fill_(7.0)
        state.conv.fill_(7.0)
        rows, longest = len(lengths), max(lengths)
        prompt = torch.zeros(rows, longest, x_BTD.shape[-1])
        for row, n in enumerate(lengths):
            prompt[row, :n] = x_BTD[row, :n]
        positions = torch.arange(longest).expand(rows, -1)
        binding = Binding(torch.tensor(slots), positions, longest, leading=False,
                          lengths_B=torch.tensor(lengths))  # fmt: skip
        return state, layer(prompt, cache=state.bound(binding))

    return prefill


ConvertRoundTrip = Callable[[Path], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


@pytest.fixture
def convert_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> ConvertRoundTrip:
    """`torchloom convert` of an HF folder to torchloom and back to HF: (the folder's tensors,
    the tensors that came back), by name."""

    def run(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        for args in (["--from-hf", path, "--to", tmp_path / "tl"],
                     ["--from", tmp_path / "tl", "--to-hf", tmp_path / "back"]):  # fmt: skip
            assert main(["convert", *map(str, args)]) == 0, capsys.readouterr().err
        return dict(iter_tensors(path)), dict(iter_tensors(tmp_path / "back"))

    return run
