"""Model-config transforms: built-ins, order, registration, unknown names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from torchloom.config.errors import ConfigError
from torchloom.models import TransformerConfig, apply_transforms, list_transforms
from torchloom.models import transforms as transforms_module
from torchloom.models.llama3 import LLAMA3_FLAVORS

BASE = LLAMA3_FLAVORS["debug"]


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("tie_embeddings", "tie_embeddings", True),
        ("untie_embeddings", "tie_embeddings", False),
        ("flex_attention", "attn_backend", "flex"),
        ("sdpa_attention", "attn_backend", "sdpa"),
    ],
)
def test_builtin_transforms(name: str, field: str, value: object) -> None:
    start = replace(BASE, tie_embeddings=not value) if field == "tie_embeddings" else BASE
    out = apply_transforms(start, [name])
    assert getattr(out, field) == value
    assert replace(out, **{field: getattr(start, field)}) == start, "only that field changes"


def test_applied_in_order() -> None:
    assert apply_transforms(BASE, ["flex_attention", "sdpa_attention"]).attn_backend == "sdpa"
    assert apply_transforms(BASE, ["sdpa_attention", "flex_attention"]).attn_backend == "flex"


def test_unknown_transform_suggests_near_matches() -> None:
    with pytest.raises(
        ConfigError, match=r"Unknown model transform 'tie_embedding'.*'tie_embeddings'"
    ):
        apply_transforms(BASE, ["tie_embedding"])


def test_list_transforms_shows_first_docstring_line() -> None:
    listed = dict(list_transforms())
    assert {"tie_embeddings", "untie_embeddings", "flex_attention", "sdpa_attention"} <= set(listed)
    assert all(doc and "\n" not in doc for doc in listed.values()), listed


def test_register_transform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transforms_module, "_TRANSFORMS", dict(transforms_module._TRANSFORMS))

    @transforms_module.register_transform("deeper")
    def deeper(cfg: TransformerConfig) -> TransformerConfig:
        """Double the number of layers.

        Longer explanation that list_transforms leaves out.
        """
        return replace(cfg, num_layers=2 * cfg.num_layers)

    assert apply_transforms(BASE, ["deeper", "deeper"]).num_layers == 4 * BASE.num_layers
    assert ("deeper", "Double the number of layers.") in list_transforms()
    with pytest.raises(ValueError, match="already registered"):
        transforms_module.register_transform("deeper")(deeper)
