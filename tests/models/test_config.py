"""The job's model section: flavor, overrides (typed, near matches), slots, transforms."""

from __future__ import annotations

from typing import Any

import pytest

from torchloom.config.errors import ConfigError
from torchloom.models import ModelConfig, resolve_model_config
from torchloom.models.llama3 import LLAMA3_FLAVORS


def test_default_is_llama3_debug() -> None:
    assert resolve_model_config(ModelConfig()) == LLAMA3_FLAVORS["debug"]


def test_overrides_including_nested_rope_fields() -> None:
    cfg = resolve_model_config(
        ModelConfig(
            overrides={
                "num_layers": 4,
                "vocab_size": 8192,
                "norm_eps": 1,  # an int is accepted for a float field
                "head_dim": None,
                "rope.theta": 1e6,
                "rope.scaling": "yarn",
                "rope.attention_factor": 1.5,
            }
        )
    )
    assert (cfg.num_layers, cfg.vocab_size, cfg.norm_eps) == (4, 8192, 1.0)
    assert isinstance(cfg.norm_eps, float)
    assert (cfg.rope.theta, cfg.rope.scaling, cfg.rope.attention_factor) == (1e6, "yarn", 1.5)
    assert LLAMA3_FLAVORS["debug"].num_layers == 2, "the flavor table must not change"


def test_order_is_overrides_then_slots_then_transforms() -> None:
    cfg = resolve_model_config(
        ModelConfig(
            name="qwen3",
            attn_backend="flex",
            transforms=["untie_embeddings", "sdpa_attention"],
            overrides={"tie_embeddings": True},
        )
    )
    assert not cfg.tie_embeddings and cfg.attn_backend == "sdpa"
    assert resolve_model_config(ModelConfig(attn_backend="flex")).attn_backend == "flex"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_layer": 4}, r"Unknown model override 'num_layer'\. Did you mean 'num_layers'"),
        ({"rope.thetta": 1.0}, r"Did you mean 'rope.theta'"),
        ({"theta": 1.0}, r"Did you mean 'rope.theta'"),
        ({"num_layers": "4"}, r"'num_layers' must be int, got str '4'"),
        ({"num_layers": 4.0}, r"'num_layers' must be int, got float"),
        ({"num_layers": True}, r"'num_layers' must be int, got bool"),
        ({"qk_norm": 1}, r"'qk_norm' must be bool, got int"),
        ({"rope.theta": "1e6"}, r"'rope.theta' must be float, got str"),
        ({"head_dim": 1.5}, r"'head_dim' must be int"),
        ({"rope.scaling": "llama"}, r"must be one of 'none', 'llama3', 'yarn'.*'llama3'"),
        ({"rope": {"theta": 1.0}}, r"'rope.<field>'"),
        ({"attn_backend": "flex"}, r"use --model.attn_backend flex"),
        ({"num_kv_heads": 3}, r"multiple of num_kv_heads"),
    ],
)
def test_bad_overrides_name_the_problem(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_model_config(ModelConfig(overrides=overrides))


def test_bad_slots_and_names() -> None:
    with pytest.raises(ConfigError, match=r"Unknown attn_backend 'flax'\. Did you mean 'flex'"):
        resolve_model_config(ModelConfig(attn_backend="flax"))
    with pytest.raises(
        ConfigError, match=r"Unknown norm_impl 'fused'.*Available: batch_invariant, torch, triton"
    ):
        resolve_model_config(ModelConfig(norm_impl="fused"))
    with pytest.raises(ConfigError, match=r"Unknown flavor '0.6b'.*Did you mean '0.6B'"):
        resolve_model_config(ModelConfig(name="qwen3", flavor="0.6b"))
    with pytest.raises(ConfigError, match=r"Unknown model 'qwen'"):
        resolve_model_config(ModelConfig(name="qwen"))


def test_tuple_fields_take_lists() -> None:
    """qwen3's layer_types (tuple[str, ...]) from a JSON list; each element type-checked."""
    layers = ["sliding_attention", "full_attention"]
    cfg = resolve_model_config(
        ModelConfig(name="qwen3", overrides={"layer_types": layers, "sliding_window": 8})
    )
    assert cfg.layer_types == tuple(layers) and cfg.sliding_window == 8
    with pytest.raises(ConfigError, match=r"'layer_types\[1\]' must be str, got int 3"):
        resolve_model_config(ModelConfig(name="qwen3", overrides={"layer_types": ["x", 3]}))
    with pytest.raises(ConfigError, match="has sliding_attention layers but sliding_window"):
        resolve_model_config(ModelConfig(name="qwen3", overrides={"layer_types": layers}))
