"""epibus's layers are installed as top-level `bus`, `observers` and `mesh`: a package by one of those names that
is not epibus's is refused at import, in words, and reported by `epibus doctor`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from epibus.layers import LAYERS, claimed_by_others, shadowed_layers
from epibus.ops.doctor_local import FAIL, OK, layers_check

ROOT = Path(__file__).resolve().parent.parent.parent


def _python(code: str, *, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_this_install_owns_every_layer() -> None:
    assert shadowed_layers() == {}
    assert claimed_by_others() == {}
    assert layers_check().status == OK
    for name in LAYERS:
        module = __import__(name)
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().parent.parent == ROOT


def test_a_local_package_named_like_a_layer_is_refused_at_import_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "mesh").mkdir()
    (tmp_path / "mesh" / "__init__.py").write_text("")
    result = _python("import epibus", cwd=tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: epibus needs its own package 'mesh'")
    assert str(tmp_path / "mesh" / "__init__.py") in last
    assert "its own virtual environment" in last


def test_another_distribution_shipping_a_layer_name_is_reported_by_the_doctor(tmp_path: Path) -> None:
    info = tmp_path / "other_mesh-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-mesh\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("mesh\n")
    code = (
        "import json; from epibus.layers import claimed_by_others; from epibus.ops.doctor_local import layers_check; "
        "c = layers_check(); print(json.dumps([claimed_by_others(), c.status, c.detail]))"
    )
    result = _python(code, cwd=ROOT, pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    claimed, status, detail = json.loads(result.stdout)
    assert claimed == {"mesh": ["other-mesh"]}
    assert status == FAIL
    assert detail == "mesh also installed by other-mesh"
