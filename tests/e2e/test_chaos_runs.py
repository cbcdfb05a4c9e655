"""`epibus chaos` on one node, stopped with SIGTERM, and the long soak (`pytest -m soak`); the cluster run is in
test_chaos.py and the attached run in test_chaos_attached.py (a module each, so the runs go side by side)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epibus.chaos.faults import FAULTS
from epibus.cluster.netns import namespaces_made_by, netns_unavailable
from tests.e2e.chaos_support import (
    RUN_TIMEOUT_S,
    SOAK_TIMEOUT_S,
    assert_every_store_holds_every_acknowledged_event,
    chaos,
    left_running,
    what_failed,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


def test_one_node_on_its_embedded_server_loses_nothing_and_says_which_faults_need_a_cluster(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    code, report = chaos(run_dir, "--faults", "all", "--rate", "40", "--min-run-s", "5")
    assert code == 0, what_failed(report, run_dir)
    assert_every_store_holds_every_acknowledged_event(report, nodes=1)
    outcomes = {fault["fault"]: fault["outcome"] for fault in report["faults"]}
    assert outcomes["follower"] == outcomes["partition"] == "not applicable: one node has one server"
    assert {outcomes[name] for name in FAULTS if name not in ("follower", "partition")} == {"injected"}
    assert left_running(run_dir) == []


def test_an_unknown_fault_is_refused_with_the_allowed_names_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "epibus", "chaos", "--faults", "leader,meteor", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode != 0
    assert "'meteor'" in done.stderr
    assert "nats-down" in done.stderr
    assert not (tmp_path / "run" / "cluster").exists()


def test_a_run_stopped_with_sigterm_leaves_no_node_server_or_namespace_behind(tmp_path: Path) -> None:
    reason = netns_unavailable()
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "epibus", "chaos", "--nodes", "3", "--faults", "partition", "--min-run-s", "600",
         "--run-dir", str(run_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def publishing() -> bool:
            return (run_dir / "publishers").is_dir() and (reason is not None or bool(namespaces_made_by(process.pid)))

        deadline = time.monotonic() + 300
        while not publishing():
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the run never started publishing"
            time.sleep(0.5)
        assert left_running(run_dir) != []  # nodes and servers run
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert left_running(run_dir) == []
    assert namespaces_made_by(process.pid) == []


@pytest.mark.soak
@pytest.mark.timeout(SOAK_TIMEOUT_S + 60)
def test_a_long_cluster_run_with_every_fault_three_times_over_loses_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, report = chaos(
        run_dir, "--nodes", "3", "--faults", "all", "--rounds", "3", "--rate", "100", "--hold-s", "10",
        "--min-run-s", "300", timeout_s=SOAK_TIMEOUT_S,
    )  # fmt: skip
    assert code == 0, what_failed(report, run_dir)
    assert_every_store_holds_every_acknowledged_event(report, nodes=3)
    print(json.dumps(report, indent=2))  # the figures the README quotes
