import pytest

from torchloom.cli import resolve_job
from torchloom.config import ConfigError, errors, validate_tree
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


def test_no_recipe_sets_an_option_that_does_nothing(capsys, monkeypatch):
    """The rule for options of a feature that is off warns about them; a shipped recipe must not
    trip it (every run of it would print the warning)."""
    monkeypatch.setattr(errors, "_warned", set())
    for recipe in list_recipes():
        validate_tree(recipe.build())
        assert capsys.readouterr().err == "", recipe.name


def test_a_recipe_given_twice_must_be_the_same():
    assert resolve_job(["--recipe", "debug", "--recipe=debug"])[0] == "debug"
    with pytest.raises(ConfigError, match=r"^--recipe is given twice \(debug, qwen3_tiny\); "):
        resolve_job(["--recipe", "debug", "--recipe", "qwen3_tiny"])
