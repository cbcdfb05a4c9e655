"""`epibus mesh propose` as a user runs it: a --payload it cannot take is one line on stderr and exit code 1,
before any key is made or any node is asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ('{"a": ' + "[" * 3000 + "]" * 3000 + "}", "is JSON nested too deeply to decode"),
        ('{"a": 1' + "0" * 5000 + "}", "holds a value JSON cannot decode here (Exceeds the limit (4300 digits)"),
        ('{"a":', "is not JSON (Expecting value"),
    ],
    ids=["deep-nesting", "huge-integer", "cut-short"],
)
def test_a_payload_json_cannot_decode_is_one_line_naming_the_option(tmp_path: Path, payload: str, problem: str) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)}
    propose = ["mesh", "propose", "-p", "demo", "--agent", "bob", "--title", "t", "--summary", "s"]
    result = subprocess.run(
        [sys.executable, "-m", "epibus", *propose, "--payload", payload],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: InvalidEvent: --payload: {problem}")
    assert not (home / "keys").exists()
