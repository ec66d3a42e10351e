"""Typed configuration: dataclass trees, dotted command-line overrides, the recipe registry."""

from torchloom.config.errors import ConfigError, did_you_mean, near_matches
from torchloom.config.fields import field_docs, from_dict, leaf_paths, to_dict
from torchloom.config.overrides import apply_overrides, format_help, validate_tree
from torchloom.config.recipes import Recipe, get_recipe, list_recipes, register_recipe

__all__ = [
    "ConfigError",
    "Recipe",
    "apply_overrides",
    "did_you_mean",
    "field_docs",
    "format_help",
    "from_dict",
    "get_recipe",
    "leaf_paths",
    "list_recipes",
    "near_matches",
    "register_recipe",
    "to_dict",
    "validate_tree",
]
