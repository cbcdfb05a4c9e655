"""`epibus chaos` on a cluster, as an operator runs it: real nodes and servers, real faults (SIGKILL, SIGSTOP, outages,
failpoints, a partition in network namespaces), then every store read back. The quick runs are part of the
suite; the long one is `pytest -m soak`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from epibus.chaos.audit import journal_copies
from epibus.chaos.faults import FAULTS
from epibus.chaos.ledger import audit_store, read_attempts
from epibus.cluster.netns import namespaces_made_by, netns_unavailable
from tests.e2e.chaos_support import (
    RUN_TIMEOUT_S,
    assert_every_store_holds_every_acknowledged_event,
    assert_failpoints_fired,
    chaos_process,
    left_running,
    what_failed,
)

ClusterRun = tuple[Path, int, dict[str, Any], int]  # run directory, exit code, report, the command's pid

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory) -> ClusterRun:
    run_dir = tmp_path_factory.mktemp("chaos-cluster") / "run"
    code, report, pid = chaos_process(
        run_dir, "--nodes", "3", "--faults", "all", "--rate", "80", "--min-run-s", "20", "--min-events", "800"
    )
    return run_dir, code, report, pid


def test_the_cluster_loses_duplicates_and_changes_nothing_under_every_fault(
    cluster_run: ClusterRun,
) -> None:
    run_dir, code, report, _ = cluster_run
    assert code == 0, what_failed(report, run_dir)
    assert report["attempts"]["total"] >= 800
    assert_every_store_holds_every_acknowledged_event(report, nodes=3)
    outcomes = {fault["fault"]: fault["outcome"] for fault in report["faults"]}
    reason = netns_unavailable()
    if reason is not None:  # only where the machine refuses namespaces, and then it says why
        assert outcomes.pop("partition") == f"not available: {reason}"
    assert outcomes == {name: "injected" for name in FAULTS if reason is None or name != "partition"}
    assert_failpoints_fired(run_dir)


def test_nothing_the_cluster_run_started_outlives_it(cluster_run: ClusterRun) -> None:
    run_dir, _, _, pid = cluster_run
    assert left_running(run_dir) == []
    assert namespaces_made_by(pid) == []


def test_the_audit_sees_a_journal_row_deleted_or_changed_after_the_run(
    cluster_run: ClusterRun,
) -> None:
    """The audit can fail: the same ledger against a journal with one row gone and one row changed."""
    run_dir, _, report, _ = cluster_run
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
