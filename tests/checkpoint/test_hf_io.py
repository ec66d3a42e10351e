"""Streaming safetensors folders, HF folder loading (from_hf), the model folder, and the errors
that name what is wrong."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import torchloom
from torchloom.checkpoint.hf import load_hf_weights, model_config_from_hf
from torchloom.checkpoint.model_io import load_model, save_model, write_model_folder
from torchloom.checkpoint.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    ShardWriter,
    iter_tensors,
    write_tensors,
)
from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, build_model
from torchloom.models.qwen3 import QWEN3_FLAVORS

QWEN_TINY = {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def named(count: int, numel: int = 1000) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(numel, generator=generator)) for i in range(count)]


def test_writer_flushes_each_shard_as_it_fills_and_indexes_them(tmp_path) -> None:
    tensors = named(5)  # 4000 bytes each; two fit in a 10 kB shard
    writer = ShardWriter(tmp_path, max_shard_bytes=10_000)
    for name, tensor in tensors[:3]:
        writer.add(name, tensor)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1, "the first shard is on disk already"
    for name, tensor in tensors[3:]:
        writer.add(name, tensor)
    summary = writer.close()
    assert summary.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 5 * 4000 == summary.total_bytes
    assert index["weight_map"]["t2"] == "model-00002-of-00003.safetensors"
    read = list(iter_tensors(tmp_path))
    assert [n for n, _ in read] == [n for n, _ in tensors]
    for (_, a), (_, b) in zip(read, tensors):
        assert torch.equal(a, b)


def test_small_model_is_one_file_and_dtype_can_be_chosen(tmp_path) -> None:
    tensors = [*named(2), ("ids", torch.arange(4))]
    summary = write_tensors(tmp_path, tensors, dtype=torch.bfloat16)
    assert summary.files == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()
    read = dict(iter_tensors(tmp_path))
    assert read["t0"].dtype == torch.bfloat16 and read["ids"].dtype == torch.int64
    assert torch.equal(read["t0"], tensors[0][1].bfloat16())


def test_transformers_sharded_folder_is_read_tensor_by_tensor(hf_checkpoint) -> None:
    path, reference = hf_checkpoint("llama", max_shard_size="40KB")
    assert (path / INDEX_FILE).exists()
    state = reference.state_dict()
    read = dict(iter_tensors(path))
    assert read.keys() == state.keys()
    assert all(torch.equal(read[name], state[name]) for name in state)


def test_from_hf_casts_to_the_requested_dtype(hf_checkpoint) -> None:
    path, reference = hf_checkpoint("llama")
    model = torchloom.from_hf(path, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(tokens).float() - reference(tokens).logits).abs().max().item()
    print(f"bf16 vs fp32 reference: max abs logit diff {diff:.3f}")
    assert diff < 0.5


def test_model_folder_streams_in_shards_and_stays_complete_on_failure(tmp_path) -> None:
    cfg = QWEN3_FLAVORS["debug"]
    model = build_model(cfg)
    model.init_weights(0)
    path = tmp_path / "model"
    save_model(model, "qwen3", cfg, path, max_shard_bytes=200_000)
    assert (path / INDEX_FILE).exists() and len(list(path.glob("*.safetensors"))) > 2
    loaded, family, config = load_model(path)
    assert family == "qwen3" and config == cfg
    tokens = torch.randint(0, 4096, (1, 8))
    torch.testing.assert_close(loaded(tokens), model.eval()(tokens), rtol=0, atol=0)

    def failing():
        yield from list(model.state_dict().items())[:3]
        raise RuntimeError("disk full")

    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(RuntimeError, match="disk full"):
        write_model_folder(path, "qwen3", cfg, failing(), max_shard_bytes=200_000)
    assert sorted(p.name for p in path.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no .partial folder left behind"


def test_missing_or_broken_folders_are_named(tmp_path, hf_checkpoint) -> None:
    with pytest.raises(ConfigError, match=f"{tmp_path / 'nope'} does not exist"):
        torchloom.from_hf(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty is not a Hugging Face model folder.*config.json"):
        torchloom.from_hf(tmp_path / "empty")
    path, _ = hf_checkpoint("llama", max_shard_size="40KB")
    shard = path / "model-00002-of-00011.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match="model-00002-of-00011.safetensors is not a readable"):
        torchloom.from_hf(path)
    shard.unlink()
    with pytest.raises(ConfigError, match="model-00002-of-00011.safetensors, listed in .* not"):
        torchloom.from_hf(path)
    for file in path.glob("model*"):
        file.unlink()
    with pytest.raises(ConfigError, match="has no model.safetensors or model.safetensors.index"):
        torchloom.from_hf(path)


def test_weights_that_disagree_with_config_json_are_refused(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama")
    weights = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                          r"\[160, 64\].*needs \[128, 64\]"):  # fmt: skip
        torchloom.from_hf(path)
    # A config.json whose vocab_size is not its embedding's: named as the config's fault before
    # a training run compares the model's vocabulary with its tokenizer's.
    rows = config["vocab_size"]
    (path / "config.json").write_text(json.dumps(config | {"vocab_size": rows - 8}))
    wrong = (f"config.json gives vocab_size {rows - 8}, but the embedding "
             f"'model.embed_tokens.weight' in its weights has {rows} rows.*set its vocab_size to {rows}")  # fmt: skip
    with pytest.raises(ConfigError, match=wrong):
        torchloom.from_hf(path)
    with pytest.raises(ConfigError, match=wrong):
        model_config_from_hf(path, ModelConfig(name="llama3"))
    (path / "config.json").write_text(json.dumps(config | {"model_type": "mistral"}))
    with pytest.raises(ConfigError, match="config.json: Hugging Face model_type 'mistral'"):
        torchloom.from_hf(path)
    (path / "config.json").write_text(json.dumps(config))
    del weights["model.norm.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="is missing tensor\\(s\\) model.norm.weight"):
        torchloom.from_hf(path)


def test_training_config_from_hf_keeps_slots_and_transforms(hf_checkpoint) -> None:
    path, reference = hf_checkpoint("qwen3", tie_word_embeddings=True, **QWEN_TINY)
    job_model = ModelConfig(name="qwen3", transforms=["untie_embeddings"])
    cfg = model_config_from_hf(path, job_model)
    assert not cfg.tie_embeddings and cfg.head_dim == 32 and cfg.vocab_size == 512
    model = build_model(cfg).eval()
    load_hf_weights(model, path)  # the untied head starts as a copy of the embedding
    tokens = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="holds a qwen3 model.*pass --model.name qwen3"):
        model_config_from_hf(path, ModelConfig(name="llama3"))
    with pytest.raises(ConfigError, match="--model.overrides .*num_layers.*pass --model.overrides"):
        model_config_from_hf(path, replace(job_model, overrides={"num_layers": 4}))
    untied_path, _ = hf_checkpoint("qwen3", name="untied", tie_word_embeddings=False, **QWEN_TINY)
    tied_cfg = model_config_from_hf(untied_path, ModelConfig(name="qwen3", transforms=["tie_embeddings"]))  # fmt: skip
    with pytest.raises(ConfigError, match="own lm_head.weight.*Drop the tie_embeddings"):
        load_hf_weights(build_model(tied_cfg), untied_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": None}, "device= must be cpu, cuda or cuda:N; got None"),
        ({"device": "gpu"}, "device= must be cpu, cuda or cuda:N; got 'gpu'"),
        ({"device": "mps"}, "device= must be cpu, cuda or cuda:N"),
        ({"device": 0}, "device= must be cpu, cuda or cuda:N; got 0"),
        ({"dtype": torch.int64}, "dtype torch.int64 cannot hold a model's weights"),
        ({"dtype": torch.float8_e4m3fn}, "dtype torch.float8_e4m3fn cannot hold"),
        ({"dtype": 16}, "dtype must be 'bf16' or 'fp32' or a torch dtype; got 16"),
        ({"dtype": "int8"}, "Unknown dtype 'int8'"),  # float16 and bfloat16 are read
    ],
)
def test_from_hf_refuses_bad_arguments_before_reading(hf_checkpoint, kwargs, message) -> None:
    path, _ = hf_checkpoint("llama")
    with pytest.raises(ConfigError, match=re.escape(message)):
        torchloom.from_hf(path, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_from_hf_on_cuda_without_a_gpu_says_so(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("llama")
    with pytest.raises(ConfigError, match="device= cuda: this machine has no CUDA device"):
        torchloom.from_hf(path, device="cuda")
    with pytest.raises(ConfigError, match="from_hf takes a folder path"):
        torchloom.from_hf(None)
    model = torchloom.from_hf(path, dtype=torch.float16)  # a floating type: allowed
    assert next(model.parameters()).dtype == torch.float16
