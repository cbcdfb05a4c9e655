"""No circle of imports inside a layer, deferred ones (inside a function) and type-only ones (TYPE_CHECKING)
included: an import moved into a function hides a circle from Python, not from the reader."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("bus", "observers", "mesh", "epibus")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file imports, wherever the import statement stands."""
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}  # `from bus import state`
    return found & modules


def ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:n]) for n in range(1, len(parts) + 1)}


def import_graph(layer: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of its layer it imports. A module's own packages are left out: Python loads them
    before it whatever it imports, and a package's __init__ may load its children lazily (the CLI's lean path)."""
    files = sorted((root / layer).rglob("*.py"))
    modules = {module_name(path, root) for path in files}
    graph = {}
    for path in files:
        module = module_name(path, root)
        graph[module] = imported_modules(path, root, modules) - ancestors(module)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep chain of imports cannot overflow the recursion limit.
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_has_a_circle_of_imports(layer: str) -> None:
    assert circles(import_graph(layer)) == []


def test_the_check_sees_a_circle_hidden_in_a_function_and_behind_type_checking(tmp_path: Path) -> None:
    (tmp_path / "bus").mkdir()
    (tmp_path / "bus" / "__init__.py").write_text("")
    (tmp_path / "bus" / "a.py").write_text("def f() -> None:\n    from bus.b import g\n")
    (tmp_path / "bus" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n")
    (tmp_path / "bus" / "c.py").write_text("import bus.a\n")
    (tmp_path / "bus" / "d.py").write_text("from bus import a\n")
    (tmp_path / "bus" / "__init__.py").write_text("def main() -> None:\n    from bus.d import x\n")
    assert circles(import_graph("bus", tmp_path)) == [["bus.a", "bus.b", "bus.c"]]
