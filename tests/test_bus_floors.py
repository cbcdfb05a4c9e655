"""The floors of `bus`: each sub-package imports only the floors below it (and the two root modules every floor
shares, `bus.errors` and `bus.subjects`), deferred and type-only imports included. A new module goes into a
floor; one that would need a floor above it belongs higher, or the dependency is cut with a narrow protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_import_circles import ROOT, import_graph

# Lowest first. Each package's __init__ docstring says what it owns.
FLOORS = ("model", "host", "identity", "broker", "enrolment", "intake", "outbox", "services", "client")
ROOT_MODULES = {"bus.errors", "bus.subjects"}


def floor_of(module: str) -> str | None:
    """The floor a bus module stands on, or None for `bus` itself and the root modules."""
    return None if module in ROOT_MODULES or module == "bus" else module.split(".")[1]


def offences(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module -> the imports it makes that reach a floor above its own (or, for a root module, any floor)."""
    found: dict[str, list[str]] = {}
    for module, imported in graph.items():
        if module == "bus":
            continue
        own = floor_of(module)
        ceiling = FLOORS.index(own) if own in FLOORS else -1
        bad = [
            target
            for target in sorted(imported)
            if target not in ROOT_MODULES and target != "bus" and FLOORS.index(floor_of(target) or "") > ceiling
        ]
        if bad:
            found[module] = bad
    return found


def test_every_bus_module_stands_on_a_known_floor() -> None:
    graph = import_graph("bus")
    stray = sorted(m for m in graph if floor_of(m) not in (*FLOORS, None))
    assert stray == [], f"put these in one of {FLOORS} (or name the new floor in FLOORS): {stray}"


def test_each_floor_imports_only_the_floors_below_it() -> None:
    assert offences(import_graph("bus")) == {}


@pytest.mark.parametrize("floor", FLOORS)
def test_each_floor_says_what_it_owns_and_what_it_may_import(floor: str) -> None:
    docstring = ast.get_docstring(ast.parse((ROOT / "bus" / floor / "__init__.py").read_text())) or ""
    assert len(docstring) > 80, f"bus/{floor}/__init__.py: say what the floor owns and what it may import"
    below = FLOORS[: FLOORS.index(floor)]
    assert ("Imports: " + (", ".join(below) if below else "nothing of bus but errors and subjects")) in docstring


def test_the_model_floor_does_no_io() -> None:
    """The event model and its rules load without nats, SQL or the node's files: a reader can use them alone."""
    io_packages = {"nats", "sqlalchemy", "sqlite3", "qdrant_client", "qdrant_edge", "fastembed", "nkeys"}
    for path in sorted((ROOT / "bus" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & io_packages, f"{path.name} imports {names}"


def test_the_check_finds_an_import_of_a_higher_floor(tmp_path: Path) -> None:
    for floor in ("model", "client"):
        (tmp_path / "bus" / floor).mkdir(parents=True)
        (tmp_path / "bus" / floor / "__init__.py").write_text("")
    (tmp_path / "bus" / "__init__.py").write_text("")
    (tmp_path / "bus" / "errors.py").write_text("")
    (tmp_path / "bus" / "model" / "event.py").write_text("def f() -> None:\n    from bus.client import client\n")
    (tmp_path / "bus" / "client" / "client.py").write_text("from bus.model.event import f\nfrom bus import errors\n")
    assert offences(import_graph("bus", tmp_path)) == {"bus.model.event": ["bus.client", "bus.client.client"]}
