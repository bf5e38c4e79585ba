"""The package layers of docs/architecture.md hold: storage <- engine, sql <- api <-
server front ends, protocols pure, and no module imports itself back in a cycle.

Read from the source with ``ast`` (nothing is imported): an import inside
``if TYPE_CHECKING:`` is for annotations only and does not count."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# package -> what it must never import
FORBIDDEN = {
    "headwater.storage": ("engine", "sql", "api", "protocols", "server", "client", "entities"),
    "headwater.engine": ("sql", "api", "protocols", "server", "client", "entities", "ripple"),
    "headwater.sql": ("api", "protocols", "server", "client", "entities", "ripple"),
    "headwater.api": ("protocols", "server", "client", "entities", "ripple", "cli", "spark"),
    "headwater.protocols": ("api", "server", "client", "entities", "ripple", "cli", "spark"),
}


def modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in (SRC / "headwater").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def runtime_imports(name: str, path: Path, package: bool, known: set[str]) -> set[str]:
    """Modules of ours that ``name`` imports when it runs (a ``from X import sub`` of a
    submodule counts as importing the submodule, as Python resolves it)."""
    tree = ast.parse(path.read_text())
    annotations_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
        for node in ast.walk(branch)
    }
    here = name if package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(source)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: runtime_imports(name, *found[name], known) for name in found}


def test_lower_layers_import_no_upper_layer() -> None:
    wrong = []
    for name, imported in sorted(graph().items()):
        for layer, banned in FORBIDDEN.items():
            if name == layer or name.startswith(layer + "."):
                wrong += [
                    f"{name} imports {target}"
                    for target in sorted(imported)
                    if any(target.startswith(f"headwater.{b}") for b in banned)
                ]
    assert wrong == []


def test_no_import_cycles() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_checks_see_imports() -> None:
    # The graph must find what is plainly there, or the tests above pass vacuously.
    edges = graph()
    assert "headwater.engine.engine" in edges["headwater.api"]
    assert "headwater.storage.log" in edges["headwater.engine.engine"]
    assert "headwater.api" in edges["headwater.server.app"]
