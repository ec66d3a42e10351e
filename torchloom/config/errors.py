"""The one error type users see for bad input, and the near-match helper its messages use."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable


class ConfigError(ValueError):
    """Bad user input: the message names the problem and the fix, and is shown as-is."""


_warned: set[str] = set()


def warn(message: str) -> None:
    """Print ``warning: message`` on stderr, once per process: for input that runs but likely
    does not do what the user meant. A config may be validated more than once in a run."""
    if message not in _warned:
        _warned.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def near_matches(name: str, options: Iterable[str], n: int = 3) -> list[str]:
    """Options that look like ``name`` (typos, wrong separators), best first."""
    options = list(options)
    by_lower = {o.lower(): o for o in options}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)
    # A dotted path whose leaf is right but whose section is wrong (--training.lr for
    # --optimizer.lr): the surest guess, so it comes first.
    leaf = name.rsplit(".", 1)[-1].lower()
    same_leaf = [o for o in by_lower if "." in o and o.rsplit(".", 1)[-1] == leaf]
    hits = same_leaf + [h for h in close if h not in same_leaf]
    return [by_lower[h] for h in hits][:n]


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """' Did you mean x or y?' or an empty string when nothing is close."""
    hits = near_matches(name, options)
    if not hits:
        return ""
    return " Did you mean " + " or ".join(f"'{h}'" for h in hits) + "?"
