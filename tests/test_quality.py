"""The code itself: imports go one way between layers (relative imports too), ruff and mypy --strict are clean
over the whole tree (tests and bench included), and no file cites a document outside the repository."""

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


def reached_modules(node: ast.ImportFrom, path: Path, root: Path) -> set[str]:
    """The top-level names a `from` import reaches; a relative one (`from ..x import y`) is resolved against the
    package of `path` under `root`, so that an import written relative to its file is judged like any other."""
    if node.level == 0:
        return {node.module.split(".")[0]} if node.module else set()
    package = path.relative_to(root).parts[:-1]  # bus/x.py and bus/__init__.py are both in the package bus
    if node.level - 1 > len(package):
        raise ValueError(f"{path}: a relative import climbs {node.level} levels above a package {len(package)} deep")
    base = [*package[: len(package) - (node.level - 1)], *(node.module.split(".") if node.module else [])]
    # `from .. import observers` at the top of a layer: the imported names are the top-level modules.
    return {base[0]} if base else {alias.name.split(".")[0] for alias in node.names}


def imported_layers(path: Path, root: Path = ROOT) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= reached_modules(node, path, root)
    return found & set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_go_one_way(layer: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_layers(path) - ALLOWED[layer] - {layer})
        for path in (ROOT / layer).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(
    ("where", "source", "layers"),
    [
        ("mesh/service.py", "from ..observers.journal import Journal\n", {"observers"}),
        ("mesh/sub/watch.py", "from ...epibus import node\n", {"epibus"}),
        ("mesh/service.py", "from .. import observers\n", {"observers"}),
        ("mesh/service.py", "from .protocol import advance\nfrom . import store\n", {"mesh"}),
        ("mesh/sub/watch.py", "from ..protocol import advance\n", {"mesh"}),
        ("observers/x.py", "from bus.model.event import Envelope\nimport mesh.agent\n", {"bus", "mesh"}),
    ],
)
def test_the_import_guard_resolves_relative_imports_to_the_layer_they_reach(
    tmp_path: Path, where: str, source: str, layers: set[str]
) -> None:
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert imported_layers(path, root=tmp_path) == layers


def test_the_import_guard_refuses_a_relative_import_it_cannot_place(tmp_path: Path) -> None:
    path = tmp_path / "mesh" / "service.py"
    path.parent.mkdir()
    path.write_text("from ...elsewhere import thing\n")
    with pytest.raises(ValueError, match="climbs 3 levels"):
        imported_layers(path, root=tmp_path)


def test_a_relative_import_across_layers_is_an_offence(tmp_path: Path) -> None:
    """What test_imports_go_one_way computes for a file, here for one that crosses by a relative import."""
    path = tmp_path / "bus" / "client.py"
    path.parent.mkdir()
    path.write_text("from ..observers.journal import Journal\n")
    assert imported_layers(path, root=tmp_path) - ALLOWED["bus"] - {"bus"} == {"observers"}


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_is_clean_on_the_code_the_tests_and_the_bench() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *LAYERS, "tests", "bench"], cwd=ROOT, capture_output=True, text=True
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
