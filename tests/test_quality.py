"""The code itself: imports go one way between layers, ruff and mypy --strict are clean, and no
file cites a document outside the repository."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("bus", "observers", "mesh", "epibus")
# What each layer may import from the others: observers → bus, mesh → bus, epibus → all, bus → none.
ALLOWED = {"bus": set(), "observers": {"bus"}, "mesh": {"bus"}, "epibus": {"bus", "observers", "mesh"}}


def imported_layers(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_go_one_way(layer: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_layers(path) - ALLOWED[layer] - {layer})
        for path in (ROOT / layer).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", *LAYERS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean_on_the_layers() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "bus", "observers", "mesh"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Spelled in pieces so that this file does not match itself.
DOC = "DES" + "IGN"
STYLE_DOC = "STY" + "LE"
CITATIONS = (
    "sha" + f"red/{DOC}",  # in pieces: tests/test_docs.py refuses the whole word in any file
    f"{DOC}.md",
    f"{DOC} \N{SECTION SIGN}",
    "\N{SECTION SIGN}",
    f"{STYLE_DOC}.md",
    f"({STYLE_DOC}:",
    f"{STYLE_DOC}: ",
)


def citations_in(text: str) -> list[tuple[int, str]]:
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if any(citation in line for citation in CITATIONS)
    ]


def test_no_file_cites_the_design_document() -> None:
    """The repository stands on its own: a reason is said in words, not by pointing at a section elsewhere."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    found = []
    for name in sorted(filter(None, listed.stdout.decode().split("\0"))):
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        found += [f"{name}:{number}: {line}" for number, line in citations_in(data.decode(errors="replace"))]
    assert found == [], "\n".join(found)
