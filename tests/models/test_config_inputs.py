"""Wrong types in a ModelConfig or a resolved family config, from Python callers: one error
naming the field and the type it takes, before anything compares or iterates the value."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from torchloom.config.errors import ConfigError
from torchloom.models import (
    ModelConfig,
    apply_transforms,
    build_model,
    get_model_spec,
    resolve_model_config,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": None}, "--model.name expects str, got None"),
        ({"overrides": [("num_layers", 4)]}, r"--model.overrides expects dict.*got \[\("),
        ({"transforms": "tie_embeddings"}, "--model.transforms expects list.*'tie_embeddings'"),
        ({"batch_invariant": "yes"}, "--model.batch_invariant expects bool, got 'yes'"),
        ({"loss_impl": "fast"}, "Unknown --model.loss_impl 'fast'"),
    ],
)
def test_model_config_fields_are_checked(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_model_config(ModelConfig(**fields))


def test_a_family_name_must_be_a_string() -> None:
    with pytest.raises(ConfigError, match="family name must be a str, got 3; known: .*llama3"):
        get_model_spec(3)  # type: ignore[arg-type]


def test_a_transform_list_given_as_a_string_is_refused() -> None:
    cfg = resolve_model_config(ModelConfig())
    with pytest.raises(TypeError, match="a list of names; got the string 'tie_embeddings'"):
        apply_transforms(cfg, "tie_embeddings")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dim", "64", "model dim expects int, got '64'"),
        ("num_layers", 2.0, "model num_layers expects int, got 2.0"),
        ("tie_embeddings", "no", "model tie_embeddings expects bool, got 'no'"),
        ("rope", None, "model rope expects RopeConfig, got None"),
    ],
)
def test_build_model_names_a_field_of_the_wrong_type(field: str, value: Any, message: str) -> None:
    cfg = dataclasses.replace(resolve_model_config(ModelConfig()), **{field: value})
    with pytest.raises(ConfigError, match=message):
        build_model(cfg)


def test_nested_fields_are_checked_by_path() -> None:
    cfg = resolve_model_config(ModelConfig())
    cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, theta="big"))
    with pytest.raises(ConfigError, match="model rope.theta expects float, got 'big'"):
        build_model(cfg)


def test_a_literal_field_keeps_its_near_match_message() -> None:
    cfg = dataclasses.replace(resolve_model_config(ModelConfig()), float8="rowise")
    with pytest.raises(ConfigError, match="Unknown float8 recipe 'rowise'.*'rowwise'"):
        build_model(cfg)
