"""What the journal's modules keep to themselves: only `observers/journal.py` touches a journal's engine (the
rest read through `Journal.reading`, whose errors are translated), and the schema never imports the projection
built on it, so the dependency between them goes one way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("bus", "observers", "mesh", "epibus")
ENGINE_OF_A_JOURNAL = re.compile(r"journal\.engine\b")


def test_only_the_journal_class_touches_its_engine() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for layer in PRODUCT
        for path in sorted((ROOT / layer).rglob("*.py"))
        if path != ROOT / "observers" / "journal.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if ENGINE_OF_A_JOURNAL.search(line)
    ]
    assert found == []


def test_the_schema_imports_nothing_of_the_observers() -> None:
    tree = ast.parse((ROOT / "observers" / "schema.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert sorted(m for m in imported if m.split(".")[0] == "observers") == []
