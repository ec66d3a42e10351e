"""A Hugging Face folder whose weight is not stored as a floating-point type is refused where HF
weights are read (checkpoint/hf.py's HFReader), so `torchloom convert --from-hf`,
`torchloom.from_hf` and `--checkpoint.initial_load_hf` refuse it for every family, in one line
naming the tensor, its dtype and its file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchloom
from tests.checkpoint.test_hf_io import QWEN_TINY
from tests.models.test_deepseek_v3_hf import DS_TINY
from tests.models.test_kimi_linear import KL_TINY
from tests.models.test_qwen3_moe_hf import MOE_TINY
from tests.models.test_qwen3_next import NEXT_TINY
from torchloom.checkpoint.safetensors_io import weight_map
from torchloom.cli import main
from torchloom.config.errors import ConfigError

# model_type -> (tiny config, the weight rewritten: a plain weight, a norm, a stacked expert,
# a renamed router, a fused projection read in row slices, a routing bias).
FAMILIES = {
    "llama": ({}, "model.layers.1.mlp.down_proj.weight"),
    "qwen3": (QWEN_TINY, "model.layers.1.self_attn.k_norm.weight"),
    "deepseek_v3": (DS_TINY, "model.layers.1.mlp.experts.5.up_proj.weight"),
    "qwen3_moe": (MOE_TINY, "model.layers.1.mlp.gate.weight"),
    "qwen3_next": (NEXT_TINY, "model.layers.1.linear_attn.in_proj_qkvz.weight"),
    "qwen3_5_text": ({}, "model.layers.1.linear_attn.in_proj_qkv.weight"),
    "kimi_linear": (KL_TINY, "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"),
}


def _store_as(folder: Path, name: str, dtype: torch.dtype) -> Path:
    """Rewrite tensor ``name`` of ``folder`` in ``dtype``; returns the file that holds it."""
    file = folder / weight_map(folder)[name]
    tensors = load_file(file)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def _refusal(file: Path, name: str, dtype: str) -> str:
    """The pattern of the one-line refusal."""
    return rf"{re.escape(str(file))}: tensor '{re.escape(name)}' is stored as {dtype}, [^\n]*Fix: "


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_integer_weight_is_refused_by_from_hf_and_convert(model_type, tmp_path, hf_checkpoint):
    config, name = FAMILIES[model_type]
    path, _ = hf_checkpoint(model_type, **config)
    file = _store_as(path, name, torch.int32)
    with pytest.raises(ConfigError, match="^" + _refusal(file, name, "int32")) as err:
        torchloom.from_hf(path)
    print(err.value)
    assert "\n" not in str(err.value)

    out = tmp_path / "converted"
    assert main(["convert", "--from-hf", str(path), "--to", str(out)]) != 0
    assert not out.exists() and not (tmp_path / "converted.partial").exists()


def test_integer_weight_is_refused_by_initial_load_hf(tmp_path, hf_checkpoint, capsys):
    name = FAMILIES["llama"][1]
    path, _ = hf_checkpoint("llama", vocab_size=4100)  # the builtin tokenizer has 4096 ids
    file = _store_as(path, name, torch.int32)
    code = main(["train", "--recipe", "debug", "--checkpoint.initial_load_hf", str(path),
                 "--training.steps", "2", "--metrics.tensorboard", "false",
                 "--output.dir", str(tmp_path / "run")])  # fmt: skip
    error = capsys.readouterr().err
    print(error)
    assert code != 0
    assert re.search("^error: " + _refusal(file, name, "int32"), error, re.M)
    assert not (tmp_path / "run" / "config.json").exists()


def test_fp8_weight_without_its_scales_is_refused(hf_checkpoint):
    """FP8 is floating point, but its values mean nothing without the block scales that a
    quantization_config names (which is refused itself): never cast by accident."""
    name = FAMILIES["deepseek_v3"][1]
    path, _ = hf_checkpoint("deepseek_v3", **DS_TINY)
    file = _store_as(path, name, torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="^" + _refusal(file, name, "float8_e4m3fn")) as err:
        torchloom.from_hf(path)
    assert "block scales" in str(err.value)


@torch.no_grad()
def test_half_precision_weights_still_load(hf_checkpoint):
    name = FAMILIES["llama"][1]
    path, reference = hf_checkpoint("llama")
    _store_as(path, name, torch.float16)
    model = torchloom.from_hf(path)
    loaded = model.state_dict()["layers.1.mlp.down_proj.weight"]
    expected = reference.state_dict()[name].to(torch.float16).float()
    assert torch.equal(loaded, expected), (loaded - expected).abs().max()
