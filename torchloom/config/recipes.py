"""The recipe registry: named Python functions that return a complete job config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchloom.config.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[], Any]
    summary: str


_RECIPES: dict[str, Recipe] = {}


def register_recipe(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Register ``fn`` (no arguments, returns a job config) under ``name``.

    The first line of the function's docstring is the one-line summary ``torchloom recipes``
    prints.
    """

    def wrap(fn: Callable[[], Any]) -> Callable[[], Any]:
        if name in _RECIPES:
            raise ValueError(f"recipe {name!r} is registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _RECIPES[name] = Recipe(name, fn, summary)
        return fn

    return wrap


def get_recipe(name: str) -> Recipe:
    """The registered recipe ``name`` (``torchloom.recipes`` registers the built-in ones when
    imported), or a ConfigError with near matches."""
    if name not in _RECIPES:
        raise ConfigError(
            f"Unknown recipe '{name}'."
            + did_you_mean(name, _RECIPES)
            + " Run `torchloom recipes` to list them."
        )
    return _RECIPES[name]


def list_recipes() -> list[Recipe]:
    """Every registered recipe, sorted by name."""
    return sorted(_RECIPES.values(), key=lambda r: r.name)
