"""A home written by an older epibus opens with today's: tests/fixtures/home-2026-12-03.tar.gz is the home of a
node of 2026-12-03 (commit 9a768f7) holding six claims of the project `legacy` by three agents, a verification,
a resolution and a contradiction (its journal, keys and stream store; the mirror is rebuilt, not kept). Today's
node starts on it, keeps every state, rebuilds the mirror from the stream, reconciles clean and takes new
events."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tests.support import eventually_sync, last_json, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).parents[1] / "fixtures" / "home-2026-12-03.tar.gz"
COLD, SLOW, ASK = (
    "01a24dca-7de3-7065-94c8-a109855f00b2",
    "01a24dca-81a8-71e1-adf7-01ed02913288",
    "01a24dca-88e1-70f5-8f72-554c7ab14460",
)
STATES = {
    COLD: ("verified", "active"),
    SLOW: ("contradicted", "active"),
    ASK: ("unverified", "resolved"),
    "01a24dca-8c11-7323-9f5b-e3de6283e17e": ("unverified", "active"),
    "01a24dca-8f2d-724f-a121-dcc25e9dba49": ("unverified", "active"),
    "01a24dca-9250-73dd-9236-2dce955e5f51": ("unverified", "active"),
}


def test_a_home_written_by_the_release_of_2026_12_03_opens_with_every_state_kept(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(home, filter="data")
    process, _ = start_node_process(home)
    try:
        audit = last_json(run_epibus(home, "audit", "-p", "legacy", "--journal", "node", "--json"))
        assert {a["artifact_id"]: (a["trust"], a["lifecycle"]) for a in audit} == STATES
        assert [a["resolution"] for a in audit if a["artifact_id"] == ASK] == ["stale"]
        events = last_json(run_epibus(home, "events", "-p", "legacy", "--limit", "100", "--json"))
        assert len(events) == 9

        def recalled() -> list[str] | None:
            answer = last_json(run_epibus(home, "recall", "why is the cache cold", "-p", "legacy", "--json"))
            found = [h["artifact_id"] for h in answer["hits"]]
            return found if COLD in found else None

        found = eventually_sync(recalled, timeout_s=60)  # the mirror, rebuilt from the stream
        assert SLOW not in found  # contradicted: never through the safe door
        report = last_json(run_epibus(home, "reconcile", "-p", "legacy", "--json"))
        assert report["ok"] is True
        run_epibus(home, "publish", "finding", "-p", "legacy", "--text", "today's node writes here too",
                   "--impact", "0.3", "--confidence", "0.5", "--subject", "cache", "--wait", "journaled")  # fmt: skip
        after = last_json(run_epibus(home, "events", "-p", "legacy", "--limit", "100", "--json"))
        assert len(after) == 10
    finally:
        stop_node_process(process)
