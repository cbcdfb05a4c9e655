"""`epibus chaos --attach` on a cluster `epibus cluster up` runs: a module of its own, so it runs beside the other
chaos runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.chaos_support import (
    PRESENCE_ONLY,
    RUN_TIMEOUT_S,
    assert_every_store_holds_every_acknowledged_event,
    chaos,
    left_running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


def test_an_attached_cluster_is_broken_audited_and_left_running(tmp_path: Path) -> None:
    """`epibus cluster up --failpoints`, then `epibus chaos --attach`: the cluster's own supervisor restarts the
    node a fault killed, the running nodes' journals and mirrors are read beside them, and they go on running."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(home)}
    cluster = subprocess.Popen(
        [sys.executable, "-m", "epibus", "cluster", "up", "3", "--failpoints", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert cluster.stdout is not None
        assert cluster.stderr is not None
        first = cluster.stdout.readline()
        if not first:  # the cluster ended before it ran: its error line is on stderr
            pytest.fail(f"epibus cluster up exited {cluster.wait(timeout=60)}: {cluster.stderr.read()[-2000:]}")
        assert json.loads(first)["status"] == "running"
        code, report = chaos(
            home / "chaos" / "attached", "--attach", "--home", str(home), "--faults", "node,observer,partition",
            "--min-run-s", "5",
        )  # fmt: skip
        assert code == 0, report
        assert report["settings"]["attached"] == str(home)
        assert_every_store_holds_every_acknowledged_event(report, nodes=3)
        mirrors = [store for store in report["stores"] if store["store"].startswith("mirror@")]
        assert {store["note"] for store in mirrors} == {PRESENCE_ONLY}
        outcomes = {fault["fault"]: fault["outcome"] for fault in report["faults"]}
        assert outcomes["node"] == outcomes["observer"] == "injected"
        assert outcomes["partition"].startswith("not available: the attached cluster's servers share the loopback")
        assert cluster.poll() is None  # chaos left the cluster running
        nodes = json.loads((home / "cluster" / "cluster.json").read_text())["nodes"]
        assert all(isinstance(node["pid"], int) for node in nodes)
    finally:
        cluster.terminate()
        cluster.wait(timeout=120)
    assert left_running(home) == []
