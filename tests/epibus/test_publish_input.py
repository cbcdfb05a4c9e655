"""`epibus publish` as a user runs it: input the event would refuse is one line on stderr and exit code 1,
before any key is made or any node is asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("evidence", "problem"),
    [
        ("file:", "at least 1 character"),
        ("url:" + "a" * 2001, "at most 2000 characters"),
        ("file:a\udc9bb", "unicode string"),  # a byte that is not UTF-8 in argv
    ],
    ids=["empty", "too-long", "not-utf8"],
)
def test_an_evidence_ref_the_event_would_refuse_is_one_line_naming_the_option(
    tmp_path: Path, evidence: str, problem: str
) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)}
    claim = ["-p", "demo", "--agent", "alice", "--text", "t", "--impact", "0.5", "--confidence", "0.5"]
    claim += ["--subject", "s"]
    result = subprocess.run(
        [sys.executable, "-m", "epibus", "publish", "finding", *claim, "--evidence", evidence],
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: InvalidEvent: --evidence=")
    assert problem in result.stderr
    assert not (home / "keys").exists()
