"""Imports flow downward only (docs/architecture.md): no package imports a package above it, no
chain of imports leads from a package or a module back to itself, and the rules below between
files hold. Every import counts for the packages (at module level, inside functions, under
TYPE_CHECKING); between modules, imports for type annotations only (under TYPE_CHECKING) do not
run, so they close no circle."""

from __future__ import annotations

import ast
from pathlib import Path

import torchloom

ROOT = Path(torchloom.__file__).parent

LAYERS = [
    "config", "data", "kernels", "models", "parallel", "checkpoint", "train", "generate", "rl",
    "recipes", "cli",
]  # fmt: skip
"""Lowest first: a package may import the packages before it, never one after it."""
TOP_LEVEL = {"__init__", "__main__"}
"""The package's own entry points, above every layer."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only_nodes(tree: ast.Module) -> set[int]:
    """ids of the import statements inside ``if TYPE_CHECKING:`` blocks."""
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return nodes


def _imports(path: Path, runtime_only: bool = False) -> set[str]:
    """torchloom modules ``path`` imports, wherever the import statement sits (with
    ``runtime_only``, not those under TYPE_CHECKING)."""
    found = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent / "x")
    package = package.rsplit(".", 1)[0] if path.name != "__init__.py" else package
    tree = ast.parse(path.read_text())
    skipped = _type_only_nodes(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def _graph(runtime_only: bool = False) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {i for i in _imports(path, runtime_only) if i in modules} - {name}
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while (top := stack.pop()) != node:
                part.append(top)
            if part:
                found.append(sorted([node, *part]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_cycles() -> None:
    """No module imports itself back through others (a function-level import counts: it runs).
    A circle means one of its files belongs in the other, or a fact both need in a third."""
    cycles = _cycles(_graph(runtime_only=True))
    assert not cycles, "module cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


NEVER = [
    # (importer prefix, imported prefix, why)
    ("torchloom.config", "torchloom.", "config/ is the mechanism only: it knows no component"),
    ("torchloom.models.components", "torchloom.models.",
     "components know no family, registry or job section"),
    ("torchloom.kernels", "torchloom.models", "kernels are the ops the model's slots choose"),
    ("torchloom.models", "torch.distributed.pipelining", "pipelining is applied from outside"),
    ("torchloom.train.step", "torchloom.train.trainer", "the step is below the loop"),
    ("torchloom.train.run", "torchloom.train.trainer", "the scaffold is shared with RL"),
    ("torchloom.rl.objectives", "torchloom.rl.loop", "an objective is a loss, not a runner"),
    ("torchloom.rl.batches", "torchloom.rl.loop", "batches are data for the step"),
    ("torchloom.generate", "torchloom.train", "generation runs the model, not the trainer"),
]  # fmt: skip
ALLOWED = {
    # components/ imports within itself and the layers below are the point of it
    ("torchloom.models.components", "torchloom.models.components"),
}
"""Edges NEVER's prefixes would catch that are allowed."""


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports (torchloom's and others'), wherever it sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_never_rules_between_files() -> None:
    broken = []
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        for target in _imports(path) | _all_imports(path):
            for importer, imported, why in NEVER:
                if not (module == importer or module.startswith(importer + ".")):
                    continue
                if not (target == imported.rstrip(".") or target.startswith(imported)):
                    continue
                if target in (module, importer) or target.startswith(importer + "."):
                    continue  # within the importer's own package
                if any(module.startswith(a) and target.startswith(b) for a, b in ALLOWED):
                    continue
                broken.append(f"{module} -> {target}: {why}")
    assert not broken, "imports that break a rule:\n" + "\n".join(sorted(set(broken)))
