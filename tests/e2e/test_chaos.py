"""`epibus chaos` as an operator runs it: real nodes and servers, real faults (SIGKILL, SIGSTOP, outages,
failpoints, a partition in network namespaces), then every store read back. The quick runs are part of the
suite; the long one is `pytest -m soak`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from epibus.chaos.audit import journal_copies
from epibus.chaos.faults import FAULTS
from epibus.chaos.ledger import audit_store, read_attempts
from epibus.netns import netns_unavailable

RUN_TIMEOUT_S = 900
SOAK_TIMEOUT_S = 3600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]
PRESENCE_ONLY = "presence only: asked through the running node's lookup service"


def chaos(run_dir: Path, *args: str, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """`epibus chaos --json` in a process of its own, as a user runs it: its exit code and its report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(run_dir.parent)}
    done = subprocess.run(
        [sys.executable, "-m", "epibus", "chaos", "--json", "--run-dir", str(run_dir), *args],
        capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no report (exit {done.returncode}): {done.stderr[-3000:]}"
    return done.returncode, json.loads(lines[-1])


def left_running(run_dir: Path) -> list[str]:
    """Processes whose command line names the run directory: none may outlive the command."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if str(run_dir) in argv:
            found.append(f"{proc.name}: {argv.replace(chr(0), ' ')[:200]}")
    return found


def assert_every_store_holds_every_acknowledged_event(report: dict[str, Any], nodes: int) -> None:
    acknowledged = report["attempts"]["published"] + report["attempts"]["outboxed"]
    stores = {store["store"]: store for store in report["stores"]}
    expected = {f"{kind}@node-{i}" for kind in ("stream", "journal", "mirror") for i in range(1, nodes + 1)}
    assert set(stores) == expected
    for name, store in stores.items():
        assert (store["acked"], store["present"]) == (acknowledged, acknowledged), name
        assert (store["lost"], store["duplicated"], store["wrong"], store["error"]) == (0, 0, 0, None), name
    assert report["ok"] is True


def assert_failpoints_fired(run_dir: Path) -> None:
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "cluster").glob("node-*/node.log"))
    assert "failpoint observer-kill" in logs  # a node died half-way through a batch
    assert "failpoint mirror-unavailable is armed" in logs  # and a mirror held its events through an outage


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("chaos-cluster") / "run"
    code, report = chaos(run_dir, "--nodes", "3", "--faults", "all", "--rate", "80", "--min-run-s", "20")
    return run_dir, code, report


def test_the_cluster_loses_duplicates_and_changes_nothing_under_every_fault(
    cluster_run: tuple[Path, int, dict[str, Any]],
) -> None:
    run_dir, code, report = cluster_run
    assert code == 0, report
    assert report["attempts"]["total"] >= 1000
    assert_every_store_holds_every_acknowledged_event(report, nodes=3)
    outcomes = {fault["fault"]: fault["outcome"] for fault in report["faults"]}
    reason = netns_unavailable()
    if reason is not None:  # only where the machine refuses namespaces, and then it says why
        assert outcomes.pop("partition") == f"not available: {reason}"
    assert outcomes == {name: "injected" for name in FAULTS if reason is None or name != "partition"}
    assert_failpoints_fired(run_dir)


def test_nothing_the_cluster_run_started_outlives_it(cluster_run: tuple[Path, int, dict[str, Any]]) -> None:
    run_dir, _, _ = cluster_run
    assert left_running(run_dir) == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert "epibus-" not in namespaces


def test_the_audit_sees_a_journal_row_deleted_or_changed_after_the_run(
    cluster_run: tuple[Path, int, dict[str, Any]],
) -> None:
    """The audit can fail: the same ledger against a journal with one row gone and one row changed."""
    run_dir, _, report = cluster_run
    attempts = read_attempts(run_dir / "attempts.jsonl")
    journal = run_dir / "cluster" / "node-2" / "journal.db"
    gone, changed = [a.event_id for a in attempts if a.acknowledged][:2]
    engine = create_engine(f"sqlite:///{journal}")
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM events WHERE event_id = :id"), {"id": gone})
        conn.execute(text("UPDATE events SET digest = 'tampered' WHERE event_id = :id"), {"id": changed})
    engine.dispose()
    audit = audit_store("journal@node-2", attempts, journal_copies(journal, report["settings"]["projects"]))
    assert audit.lost == [gone]
    assert audit.wrong == [changed]
    assert audit.failed


def test_one_node_on_its_embedded_server_loses_nothing_and_says_which_faults_need_a_cluster(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    code, report = chaos(run_dir, "--faults", "all", "--rate", "80", "--min-run-s", "5")
    assert code == 0, report
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
        assert json.loads(cluster.stdout.readline())["status"] == "running"
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


def namespaces_of(pid: int) -> list[str]:
    """The network namespaces a chaos process made (their names carry its pid in base 36)."""
    digits, tag, n = "0123456789abcdefghijklmnopqrstuvwxyz", "", pid
    while n:
        n, digit = divmod(n, 36)
        tag = digits[digit] + tag
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"epibus-{tag}-")]


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
            return (run_dir / "publishers").is_dir() and (reason is not None or bool(namespaces_of(process.pid)))

        deadline = time.monotonic() + 300
        while not publishing():
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the run never started publishing"
            time.sleep(0.5)
        assert left_running(run_dir) != []  # nodes and servers run
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert left_running(run_dir) == []
    assert namespaces_of(process.pid) == []


@pytest.mark.soak
@pytest.mark.timeout(SOAK_TIMEOUT_S + 60)
def test_a_long_cluster_run_with_every_fault_three_times_over_loses_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, report = chaos(
        run_dir, "--nodes", "3", "--faults", "all", "--rounds", "3", "--rate", "100", "--hold-s", "10",
        "--min-run-s", "300", timeout_s=SOAK_TIMEOUT_S,
    )  # fmt: skip
    assert code == 0, report
    assert_every_store_holds_every_acknowledged_event(report, nodes=3)
    print(json.dumps(report, indent=2))  # the figures the README quotes
