"""`torchloom <command>`: train, recipes, plot.

Every command turns bad input into one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from torchloom.config import (
    ConfigError,
    apply_overrides,
    format_help,
    get_recipe,
    list_recipes,
    to_dict,
    validate_tree,
)

DEFAULT_RECIPE = "llama3_tiny"

_USAGE = """usage: torchloom <command> [options]

commands:
  train     train a recipe:  torchloom train --recipe NAME [--section.field VALUE ...]
  recipes   list the registered recipes
  plot      draw loss and throughput curves:  torchloom plot OUTPUT_DIR

`torchloom train --recipe NAME --help` lists every option with its help text."""


def _pop_flag(argv: list[str], flag: str) -> bool:
    if flag in argv:
        argv.remove(flag)
        return True
    return False


def _pop_option(argv: list[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == option:
            if i + 1 >= len(argv):
                raise ConfigError(f"{option} needs a value.")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if arg.startswith(option + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def resolve_job(argv: list[str]):
    """(recipe name, job config) from ``--recipe NAME`` and dotted overrides, validated."""
    argv = list(argv)
    name = _pop_option(argv, "--recipe") or DEFAULT_RECIPE
    job = apply_overrides(get_recipe(name).build(), argv)
    validate_tree(job)
    return name, job


def cmd_train(argv: list[str]) -> int:
    argv = list(argv)
    if _pop_flag(argv, "--help") or _pop_flag(argv, "-h"):
        name = _pop_option(argv, "--recipe") or DEFAULT_RECIPE
        title = f"torchloom train --recipe {name} [options]  (values shown are this recipe's)"
        print(format_help(get_recipe(name).build(), title))
        return 0
    print_config = _pop_flag(argv, "--print-config")
    name, job = resolve_job(argv)
    if print_config:
        print(json.dumps({"recipe": name, **to_dict(job)}, indent=2))
        return 0

    from torchloom.generate.greedy import greedy_complete
    from torchloom.train.trainer import Trainer

    trainer = Trainer(job)
    result = trainer.train()
    print(
        f"done: {result.steps} steps, train loss {result.first_loss:.3f} -> {result.last_loss:.3f}, "
        f"validation loss {result.val_loss_before:.3f} -> {result.val_loss_after:.3f}"
    )
    t = job.training
    if t.sample_tokens:
        tok = trainer.tokenizer
        new = greedy_complete(
            trainer.model, tok.encode(t.sample_prompt), t.sample_tokens, tok.eos_id
        )
        print(f"sample: {t.sample_prompt}{tok.decode(new)!r}"[:400])
    return 0


def cmd_recipes(argv: list[str]) -> int:
    recipes = list_recipes()
    width = max(len(r.name) for r in recipes)
    for recipe in recipes:
        marker = " (default)" if recipe.name == DEFAULT_RECIPE else ""
        print(f"{recipe.name:<{width}}  {recipe.summary}{marker}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    if len(argv) != 1:
        raise ConfigError("usage: torchloom plot OUTPUT_DIR (a folder holding metrics.jsonl)")
    from torchloom.train.plot import plot_metrics

    png = plot_metrics(Path(argv[0]))
    print(f"wrote {png}")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train,
    "recipes": cmd_recipes,
    "plot": cmd_plot,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        from torchloom.config import did_you_mean

        print(
            f"error: unknown command '{command}'.{did_you_mean(command, COMMANDS)}", file=sys.stderr
        )
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from torchloom.train.trainer import TrainingError

        if not isinstance(err, TrainingError):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
