"""Model registry: lookup with near matches, listing, building from either config."""

from __future__ import annotations

import pytest
import torch

from torchloom.config.errors import ConfigError
from torchloom.models import (
    Decoder,
    ModelConfig,
    ModelSpec,
    TransformerConfig,
    build_model,
    get_model_spec,
    list_models,
    register_model,
    resolve_model_config,
)
from torchloom.models.llama3 import LLAMA3_FLAVORS
from torchloom.models.qwen3 import Qwen3Config


def test_families_are_registered() -> None:
    names = [spec.name for spec in list_models()]
    assert names == [
        "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k25", "kimi_linear", "llama3", "muse_glimmer",
        "muse_spark", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_vl",
    ]  # fmt: skip
    spec = get_model_spec("qwen3")
    assert spec.config_cls is Qwen3Config and "0.6B" in spec.flavors and spec.description


def test_unknown_names_suggest_near_matches() -> None:
    with pytest.raises(ConfigError, match=r"Unknown model 'lama3'\. Did you mean 'llama3'"):
        get_model_spec("lama3")
    with pytest.raises(ConfigError, match=r"Did you mean '8B'.*Available: debug, 1B"):
        get_model_spec("llama3").flavor("8b")


def test_registering_a_name_twice_fails() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_model(ModelSpec("llama3", TransformerConfig, {}))


def test_build_from_job_section_or_architecture() -> None:
    from_job = build_model(resolve_model_config(ModelConfig(name="qwen3", flavor="debug")))
    assert isinstance(from_job, Decoder) and from_job.config.qk_norm
    assert type(build_model(LLAMA3_FLAVORS["debug"])) is Decoder


def test_build_on_meta_allocates_nothing() -> None:
    with torch.device("meta"):
        model = build_model(resolve_model_config(ModelConfig(name="llama3", flavor="405B")))
    assert all(p.is_meta for p in model.parameters())


def test_build_validates() -> None:
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        build_model(resolve_model_config(ModelConfig(overrides={"num_kv_heads": 3})))
