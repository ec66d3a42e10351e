"""Bad input to the Python entry points a notebook calls (`torchloom.from_hf`, a model's call,
`save_model` / `load_model`, the weight dtype names) ends in one exception naming the problem
and the fix, before anything is allocated or written; found by a sweep of 209 inputs
(benchmarks/RESULTS.md, twenty-ninth session). Each case here was wrong before: a silent tie,
NaN accepted, torch's or safetensors' own errors, a 2.6 GB allocation, a folder that could not
be read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torchloom
from torchloom.checkpoint.model_io import load_model, save_model
from torchloom.checkpoint.safetensors_io import INDEX_FILE, parse_dtype, weight_map
from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model, resolve_model_config


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def test_config_json_switches_and_numbers_must_be_what_they_say(tmp_path, hf_checkpoint):
    """ "false" is a truthy string: the head was tied and lm_head.weight dropped (logits 0.96
    off transformers'); NaN passed every '> 0' check (all-NaN logits)."""
    path, _ = hf_checkpoint("llama", tie_word_embeddings=False)
    _edit_config(path, tie_word_embeddings="false")
    with pytest.raises(ConfigError, match='tie_word_embeddings must be true or false .*"false"'):
        torchloom.from_hf(path)
    _edit_config(path, tie_word_embeddings=False, rms_norm_eps=float("nan"))
    with pytest.raises(ConfigError, match="holds NaN"):
        torchloom.from_hf(path)
    for overrides in ({"norm_eps": float("inf")}, {"rope.theta": float("nan")}):
        name = next(iter(overrides))
        with pytest.raises(ConfigError, match=f"model {name} must be a finite number"):
            resolve_model_config(ModelConfig(name="llama3", flavor="debug", overrides=overrides))


def test_shapes_are_checked_from_the_headers_before_allocating(
    tmp_path, hf_checkpoint, monkeypatch
):
    path, _ = hf_checkpoint("llama")
    _edit_config(path, intermediate_size=10**7)

    def allocate(*args, **kwargs):
        raise AssertionError("the config's shapes were allocated before the check")

    monkeypatch.setattr(torch.nn.Module, "to_empty", allocate)
    with pytest.raises(ConfigError, match=r"has shape \[\d+, \d+\], but the architecture"):
        torchloom.from_hf(path)


def test_an_index_mapping_a_tensor_to_the_wrong_shard_names_both(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("llama", max_shard_size="100KB")
    mapping = weight_map(path)
    name = "model.embed_tokens.weight"
    other = next(f for f in sorted(set(mapping.values())) if f != mapping[name])
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"][name] = other
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError) as error:
        torchloom.from_hf(path)
    assert f"maps tensor '{name}' to {other}, which does not hold it" in str(error.value)


def test_a_model_call_names_the_ids_it_takes(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model = torchloom.from_hf(path)
    vocab = model.config.vocab_size
    cases = [
        (torch.tensor([[1, vocab]]), ValueError, f"token id {vocab} is outside the model's "),
        (torch.tensor([[-1, 2]]), ValueError, "token id -1 is outside"),
        (torch.tensor([1, 2, 3]), ValueError, r"got shape \[3\] .*add the batch dim"),
        (torch.ones(1, 3), ValueError, "integer tensor, got shape .* torch.float32"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, "got no tokens"),
        ([[1, 2]], TypeError, "got a list"),
    ]
    for ids, kind, message in cases:
        with pytest.raises(kind, match=message):
            model(ids)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, vocab)


def test_dtype_names_torch_and_hf_use_are_read_and_others_named():
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("fp16") is parse_dtype("half") is torch.float16
    with pytest.raises(ConfigError, match="Unknown dtype 'int8'.*bf16 or fp32, or a weight"):
        parse_dtype("int8")


def test_save_model_refuses_what_load_model_could_not_read(tmp_path):
    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    qwen = resolve_model_config(ModelConfig(name="qwen3", flavor="debug"))
    model = build_model(config)
    (tmp_path / "file").write_text("x")
    cases = [
        ((model, "llamaX", config, tmp_path / "a"), ConfigError, "Unknown model 'llamaX'"),
        ((model, "qwen3", config, tmp_path / "b"), ConfigError, "not the qwen3 family's"),
        ((model, "llama3", qwen, tmp_path / "c"), ConfigError, "does not match its config"),
        ((model, "llama3", config, tmp_path / "file" / "m"), ConfigError, "is a file"),
        ((None, "llama3", config, tmp_path / "d"), TypeError, "an nn.Module"),
    ]
    for args, kind, message in cases:
        with pytest.raises(kind, match=message):
            save_model(*args)
        assert not args[3].exists()
    save_model(model, "llama3", config, tmp_path / "ok")
    with pytest.raises(ConfigError, match="device= must be cpu, cuda or cuda:N"):
        load_model(tmp_path / "ok", device="tpu")
    meta = json.loads((tmp_path / "ok" / "config.json").read_text())
    del meta["family"]
    (tmp_path / "ok" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="is damaged: it lacks family"):
        load_model(tmp_path / "ok")


def test_save_functions_replace_a_folder_only_when_told(tmp_path):
    """save_model and save_hf replaced any existing folder without a word (one named at the
    user's home would have been deleted); like convert, they now want overwrite=True."""
    from torchloom.checkpoint.hf import save_hf

    config = resolve_model_config(ModelConfig(name="llama3", flavor="debug"))
    model = build_model(config)
    saves = {
        "model": lambda path, **kw: save_model(model, "llama3", config, path, **kw),
        "hf": lambda path, **kw: save_hf(path, "llama3", config, model.state_dict().items(), **kw),
    }
    for name, save in saves.items():
        busy = tmp_path / f"busy_{name}"
        busy.mkdir()
        (busy / "notes.txt").write_text("mine")
        with pytest.raises(
            ConfigError, match="is not empty; choose another or pass overwrite=True"
        ):
            save(busy)
        assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
        (tmp_path / f"file_{name}").write_text("x")
        with pytest.raises(ConfigError, match="exists and is not a folder"):
            save(tmp_path / f"file_{name}", overwrite=True)
        (tmp_path / f"empty_{name}").mkdir()
        save(tmp_path / f"empty_{name}")  # an empty folder is no one's work
        save(busy, overwrite=True)
        assert not (busy / "notes.txt").exists() and (busy / "config.json").is_file()
    assert torch.equal(
        load_model(tmp_path / "busy_model")[0].state_dict()["norm.weight"],
        model.state_dict()["norm.weight"],
    )


def test_an_index_cannot_point_outside_its_folder(tmp_path, hf_checkpoint):
    """A shard named with a path ('../x.safetensors') was read from wherever it pointed."""
    path, _ = hf_checkpoint("llama", max_shard_size="100KB")
    index = json.loads((path / INDEX_FILE).read_text())
    name = "model.embed_tokens.weight"
    outside = tmp_path / "elsewhere.safetensors"
    (path / index["weight_map"][name]).rename(outside)
    index["weight_map"] = {
        key: "../elsewhere.safetensors" if file == index["weight_map"][name] else file
        for key, file in index["weight_map"].items()
    }
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="lists '../elsewhere.safetensors' as a shard"):
        torchloom.from_hf(path)
