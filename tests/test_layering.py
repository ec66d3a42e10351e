"""Imports flow downward only (docs/architecture.md): no package imports a package above it, and
no module imports itself back through others. Every import counts: at module level, inside
functions, and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import torchloom

ROOT = Path(torchloom.__file__).parent

LAYERS = [
    "config", "kernels", "models", "parallel", "data", "checkpoint", "train", "generate", "rl",
    "recipes", "cli",
]  # fmt: skip
"""Lowest first: a package may import the packages before it, never one after it."""
TOP_LEVEL = {"__init__", "__main__"}
"""The package's own entry points, above every layer."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """torchloom modules ``path`` imports, wherever the import statement sits."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent / "x")
    package = package.rsplit(".", 1)[0] if path.name != "__init__.py" else package
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("torchloom")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name.startswith("torchloom"):
                found.add(name)
                # ``from torchloom.x import y`` may import the module torchloom.x.y
                found |= {f"{name}.{alias.name}" for alias in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {i for i in _imports(path) if i in modules} - {name}
            for name, path in modules.items()}  # fmt: skip


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_package_imports_a_package_above_it() -> None:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for module, imported in _graph().items():
        layer = _layer(module)
        if layer in TOP_LEVEL:
            continue
        assert layer in rank, f"{module}: package {layer!r} has no place in LAYERS"
        for target in imported:
            target_layer = _layer(target)
            if target_layer != layer and rank.get(target_layer, -1) > rank[layer]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_package_cycles() -> None:
    """Between packages (torchloom.models, torchloom.train, ...): a package may import a lazy
    sibling module of its own, but no chain of imports leads from one package back to it."""
    graph: dict[str, set[str]] = {}
    for module, imported in _graph().items():
        graph.setdefault(_layer(module), set()).update(_layer(t) for t in imported)
    for package in graph:
        graph[package].discard(package)
    cycles, state = [], {}

    def visit(package: str, path: list[str]) -> None:
        state[package] = "open"
        for target in sorted(graph.get(package, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[package] = "done"

    for package in sorted(graph):
        if package not in state:
            visit(package, [package])
    assert not cycles, "package cycles:\n" + "\n".join(cycles)
