"""The qwen3_vl_debug, kimi_k25_debug and Muse recipes: a short run's assistant-token loss falls
on builtin:shapes_chat (and builtin:tones_chat for muse_spark_debug) and its step records count
the media encoders; jobs whose model cannot read
the data are refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from torchloom.cli import resolve_job
from torchloom.config.errors import ConfigError
from torchloom.data.build import build_tokenizer
from torchloom.models import ModelConfig, resolve_model_config
from torchloom.train.builders import build_model_config, check_media_fits
from torchloom.train.trainer import Trainer


@pytest.mark.slow  # 12 steps: about a minute on an idle CPU, three under load
@pytest.mark.parametrize(
    "recipe", ["qwen3_vl_debug", "kimi_k25_debug", "muse_glimmer_debug", "muse_spark_debug"]
)
def test_vl_debug_recipes_learn_the_picture_chats(recipe: str, tmp_path: Path) -> None:
    _, job = resolve_job([
        "--recipe", recipe, "--training.steps", "12", "--training.global_batch_size",
        "4", "--training.val_interval", "0", "--training.val_sequences", "4",
        "--metrics.tensorboard", "false", "--checkpoint.save_final_model", "false",
        "--output.dir", str(tmp_path / "run"),
    ])  # fmt: skip
    result = Trainer(job).train()
    print(f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}")
    assert result.last_loss < result.first_loss - 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "tps" in r]
    assert all(r["media_tflops"] > 0 and r["tflops"] > r["media_tflops"] for r in steps)


@pytest.fixture(scope="module")
def vl_job():
    _, job = resolve_job(["--recipe", "qwen3_vl_debug"])
    return job, build_tokenizer(job.data)


def test_the_recipe_model_fits_its_data(vl_job) -> None:
    job, tokenizer = vl_job
    check_media_fits(build_model_config(job), tokenizer, job.data)
    for recipe in ("kimi_k25_debug", "muse_glimmer_debug", "muse_spark_debug"):
        _, other = resolve_job(["--recipe", recipe])
        check_media_fits(build_model_config(other), build_tokenizer(other.data), other.data)


def test_models_that_cannot_read_the_data_are_refused(vl_job) -> None:
    job, tokenizer = vl_job
    config = build_model_config(job)
    text_model = resolve_model_config(ModelConfig(name="qwen3", flavor="debug"))
    with pytest.raises(ConfigError, match="needs a model with a media encoder"):
        check_media_fits(text_model, tokenizer, job.data)
    flavor_ids = resolve_model_config(
        ModelConfig(name="qwen3_vl", flavor="debug", overrides={"vocab_size": 4103})
    )  # the flavor's own placeholder ids (4093, 4090): not the builtin tokenizer's
    with pytest.raises(ConfigError, match="image_token_id=4093"):
        check_media_fits(flavor_ids, tokenizer, job.data)
    small_patches = replace(config, vision=replace(config.vision, patch_size=4))
    with pytest.raises(ConfigError, match="encoder reads"):
        check_media_fits(small_patches, tokenizer, job.data)
    kimi = resolve_model_config(ModelConfig(name="kimi_k25", flavor="debug"))
    with pytest.raises(ConfigError, match="set --data.media_layout kimi_k25"):
        check_media_fits(kimi, tokenizer, job.data)  # data rendered for qwen3_vl
    check_media_fits(config, tokenizer, replace(job.data, format="chat"))  # text on a VL model


@pytest.mark.parametrize(
    "recipe", ["qwen3_vl_debug", "kimi_k25_debug", "muse_glimmer_debug", "muse_spark_debug"]
)
def test_vl_recipes_split_over_two_tensor_parallel_ranks(recipe: str) -> None:
    """The tokenizer's 4103 ids padded to 4104: every VL recipe's model takes --parallel.tp 2
    (its plan builds; the vocabulary split refused 4103)."""
    import torch

    from torchloom.models import build_model, get_model_spec

    _, job = resolve_job(["--recipe", recipe])
    config = build_model_config(job)
    assert config.vocab_size == 4104
    with torch.device("meta"):
        model = build_model(config)
    assert "embed_tokens" in get_model_spec(job.model.name).tp_plan(model, 2)
