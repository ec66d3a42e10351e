"""Walking typed config trees: field docstrings, dotted paths, parsing values, dict round trips.

A config is a tree of dataclasses. A field's help text is the string literal written on the
line after it (an "attribute docstring"), read once from the class source.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

from torchloom.config.errors import ConfigError, did_you_mean, warn


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass and its bases: {field name: help text}."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def leaf_paths(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted path, type, current value, help) for every non-dataclass field in the tree."""
    docs = field_docs(type(cfg))
    for name, hint in field_types(type(cfg)).items():
        value = getattr(cfg, name)
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            yield from leaf_paths(value, path + ".")
        else:
            yield path, hint, value, docs.get(name, "")


def type_name(hint: Any) -> str:
    """A short human name for a type hint, as shown in help and errors."""
    origin = get_origin(hint)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(hint))
    if origin is not None:
        args = ", ".join(type_name(a) for a in get_args(hint))
        return f"{origin.__name__}[{args}]"
    return getattr(hint, "__name__", str(hint))


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_ALIASES = {"gpu": "cuda"}
"""Words users type for a choice under another name: the hint suggests the choice (gpu ->
cuda), which spelling distance would miss (it picks cpu)."""


def parse_value(text: str, hint: Any, path: str) -> Any:
    """Parse a command-line string into a value of type ``hint`` or raise ConfigError."""

    def bad(expected: str) -> ConfigError:
        return ConfigError(
            f"--{path} expects {expected}, got {text!r}. Example: --{path} {_example(hint)}"
        )

    origin = get_origin(hint)
    if hint is Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return parse_value(text, arg, path)
            except ConfigError:
                continue
        raise bad(type_name(hint))
    if origin is Literal:
        choices = get_args(hint)
        for choice in choices:
            if str(choice) == text:
                return choice
        alias = _ALIASES.get(text.lower())
        hint = (
            f" Did you mean '{alias}'?"
            if alias in map(str, choices)
            else did_you_mean(text, map(str, choices))
        )
        raise ConfigError(
            f"--{path} must be one of {', '.join(map(str, choices))}; got {text!r}." + hint
        )
    if hint is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise bad("true or false")
    if hint is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise bad("an integer") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise bad("a number") from None
    if hint is str:
        return text
    if origin in (list, tuple, dict):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if origin is dict:
                raise bad(f"a JSON object such as {_example(hint)}") from None
            if text.lstrip().startswith("["):
                raise bad(f"a JSON list ({e.msg} at character {e.pos})") from None
            # A bare comma-separated list is accepted too: a,b,c or 0.6,0.4
            value = [v for v in text.split(",") if v]
            element = next(iter(get_args(hint)), str)
            if element not in (str, Any, Ellipsis):
                try:
                    value = [parse_value(v.strip(), element, path) for v in value]
                except ConfigError:
                    raise bad(f"a list of {type_name(element)}") from None
        try:
            return check_type(value, hint, path)
        except ConfigError:
            raise bad(type_name(hint)) from None
    raise ConfigError(f"--{path} has a type ({type_name(hint)}) the command line cannot set.")


def check_type(value: Any, hint: Any, path: str) -> Any:
    """Check (and gently coerce: int -> float, list -> tuple) a value against a type hint."""
    origin = get_origin(hint)
    wrong = ConfigError(f"{path} expects {type_name(hint)}, got {value!r}.")
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in get_args(hint):
            try:
                return check_type(value, arg, path)
            except ConfigError:
                continue
        raise wrong
    if hint is type(None):
        if value is None:
            return None
        raise wrong
    if origin is Literal:
        if value in get_args(hint):
            return value
        raise wrong
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise wrong
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise wrong
        args = get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise wrong
            return tuple(check_type(v, a, path) for v, a in zip(value, args))
        item = args[0] if args else Any
        items = [check_type(v, item, path) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong
        return dict(value)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return from_dict(hint, value, prefix=path + ".")
        raise wrong
    return value


def _example(hint: Any) -> str:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _example(next(a for a in get_args(hint) if a is not type(None)))
    if origin is Literal:
        return str(get_args(hint)[0])
    if origin in (list, tuple):
        element = next(iter(get_args(hint)), str)
        if element in (int, float):
            return "'[0.6, 0.4]'" if element is float else "'[1, 2]'"
        return '\'["a", "b"]\''
    if origin is dict:
        return "'{\"key\": 1}'"
    return {bool: "true", int: "8", float: "0.001", str: "text"}.get(hint, "VALUE")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config tree."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a config of type ``cls`` from a dict (as written by ``to_dict``), type-checked."""
    hints = field_types(cls)
    unknown = set(data) - set(hints)
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(
            f"Unknown config field '{prefix}{name}'."
            + did_you_mean(name, hints)
            + f" Known fields: {', '.join(hints)}."
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            kwargs[name] = from_dict(hint, value, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = check_type(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def warn_unused_options(config: Any, section: str, names: tuple[str, ...], until: str) -> None:
    """The rule for the options of a feature that is off: ``validate`` checks their values all
    the same (a typo must not wait for the run that turns the feature on), and each one set
    away from its default is accepted with a warning that it does nothing ``until`` the feature
    is on."""
    defaults = {f.name: f for f in dataclasses.fields(config)}
    for name in names:
        f = defaults[name]
        default = f.default_factory() if callable(f.default_factory) else f.default
        value = getattr(config, name)
        if value != default:
            shown = value if isinstance(value, str) else json.dumps(value)
            warn(f"--{section}.{name} {shown} has no effect until {until}.")
