import pytest

from torchloom.config import ConfigError, validate_tree
from torchloom.recipes import get_recipe, list_recipes
from torchloom.train.job import JobConfig


def test_every_recipe_builds_a_valid_job_with_a_summary():
    recipes = list_recipes()
    assert {"debug", "llama3_tiny"} <= {r.name for r in recipes}
    for recipe in recipes:
        job = recipe.build()
        assert isinstance(job, JobConfig), recipe.name
        validate_tree(job)
        assert recipe.summary, f"recipe {recipe.name} has no one-line summary"


def test_unknown_recipe_names_near_matches():
    with pytest.raises(ConfigError, match="Unknown recipe 'debgu'.*Did you mean 'debug'"):
        get_recipe("debgu")
