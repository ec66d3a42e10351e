"""Command-line overrides of a config tree by dotted path: ``--training.steps 20``."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Collection
from typing import Any

from torchloom.config.errors import ConfigError, did_you_mean, warn
from torchloom.config.fields import field_types, leaf_paths, parse_value, type_name


def split_overrides(argv: list[str]) -> list[tuple[str, str | None]]:
    """Pair each ``--a.b`` with its value; ``--a.b=v`` works too; a bare flag has value None."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(
                f"Unexpected argument {arg!r}: options look like --section.field VALUE "
                "(for example --training.steps 20)."
            )
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            pairs.append((name, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((name, argv[i + 1]))
            i += 2
        else:
            pairs.append((name, None))
            i += 1
    return pairs


def apply_overrides(cfg: Any, argv: list[str], flags: Collection[str] = ()) -> Any:
    """A copy of ``cfg`` with every ``--dotted.path value`` in ``argv`` applied, type-checked.
    ``flags``: the command's own switches (``--dry-run``), suggested for a near miss.

    An option given twice keeps its last value (scripts append the user's flags to their own),
    with a warning naming both values when they differ: a dict such as --model.overrides is
    replaced, not merged."""
    cfg = copy.deepcopy(cfg)
    paths = {path: hint for path, hint, _, _ in leaf_paths(cfg)}
    given: dict[str, tuple[str | None, Any]] = {}  # path -> (text, value) as first given
    for typed, text in split_overrides(argv):
        path = typed.replace("-", "_")
        if path not in paths:
            renamed = _renamed(cfg, path)
            if renamed:
                raise ConfigError(f"--{typed} no longer exists; {renamed}")
            options = [f"--{p}" for p in paths]
            sections = {f"--{p.split('.')[0]}" for p in paths}
            hint = (
                did_you_mean(f"--{typed}", [*flags, *options])
                or did_you_mean(f"--{path}", options)
                or did_you_mean(f"--{path.split('.')[0]}", sections)
            )
            raise ConfigError(
                f"Unknown option --{typed}.{hint} Run with --help to list every option."
            )
        hint = paths[path]
        if text is None:
            if hint is not bool:
                raise ConfigError(f"--{path} needs a value ({type_name(hint)}).")
            value: Any = True
        else:
            value = parse_value(text, hint, path)
        if path in given and given[path][1] != value:
            warn(
                f"--{path} is given twice ({_shown(given[path][0])}, then {_shown(text)}); the "
                "last one is used"
                + (", not merged with the first" if isinstance(value, dict) else "")
                + "."
            )
        elif path not in given and isinstance(value, dict):
            _warn_dropped_keys(path, get_path(cfg, path), value)
        given[path] = (text, value)
        set_path(cfg, path, value)
    return cfg


def _warn_dropped_keys(path: str, before: Any, value: dict) -> None:
    """A dict option replaces the config's (the recipe's) dict: say which of its keys that
    drops, which a user giving one key would otherwise not see (the model quietly fell back to
    its flavor's width and heads, and a later error named values never typed)."""
    if not isinstance(before, dict):
        return
    dropped = {key: item for key, item in before.items() if key not in value}
    if dropped:
        kept = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in dropped.items())
        warn(
            f"--{path} replaces the recipe's, so its {', '.join(dropped)} go back to the "
            f"flavor's; to keep them, give them in the same dict ({kept})."
        )


def get_path(cfg: Any, path: str) -> Any:
    """The value at a dotted path."""
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _shown(text: str | None) -> str:
    """A command-line value as the user typed it (a bare flag: true)."""
    return "true" if text is None else text


def _renamed(cfg: Any, path: str) -> str | None:
    """What replaced a removed field, from the ``RENAMED`` table ({old name: what to use
    instead}) of the config class that held it."""
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part, None)
        if not dataclasses.is_dataclass(node):
            return None
    return getattr(type(node), "RENAMED", {}).get(leaf)


def set_path(cfg: Any, path: str, value: Any) -> None:
    """Set the field at a dotted path in place."""
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    if leaf not in field_types(type(node)):
        raise ConfigError(f"Unknown config field {path}.")
    setattr(node, leaf, value)


def validate_tree(cfg: Any) -> None:
    """Call ``validate()`` on every config in the tree that defines one, children first."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()


def format_help(cfg: Any, title: str, hidden: Collection[str] = ()) -> str:
    """Every option but the ``hidden`` ones with its type, current value and help text, grouped
    by section."""
    lines = [title, ""]
    section = None
    for path, hint, value, doc in leaf_paths(cfg):
        if path in hidden:
            continue
        head = path.split(".")[0]
        if head != section:
            section = head
            lines.append(f"[{head}]")
        lines.append(f"  --{path} {type_name(hint)}  (default: {value!r})")
        for doc_line in doc.splitlines():
            lines.append(f"      {doc_line}")
    return "\n".join(lines)
