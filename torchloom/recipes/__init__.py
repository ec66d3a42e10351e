"""Built-in recipes. Importing this package registers them, so ``get_recipe`` and
``list_recipes`` from here see them (and any a user's own module registered)."""

from torchloom.config.recipes import Recipe, get_recipe, list_recipes, register_recipe
from torchloom.recipes import moe, pretrain, real_size, reasoning, rl, sft, vision  # noqa: F401  (registers the built-in recipes)

__all__ = ["Recipe", "get_recipe", "list_recipes", "register_recipe"]
