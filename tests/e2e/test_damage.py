"""Damage is found and repaired from the stream. A node is stopped, a store's file damaged, the node started
again: `health` and `doctor` name the damaged store and the command that rebuilds it, a read that meets the
damage says so in one line (never an SQL statement), and the named command brings every event back."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from bus.client.client import connect
from tests.support import eventually_sync, last_json, run_epibus, start_node_process, stop_node_process

pytestmark = pytest.mark.slow
EVENTS = 120
CHECK_OFTEN = {"EPIBUS_STORE_CHECK_S": "1"}  # the node checks its stores every second, not every ten minutes


async def publish_claims(home: Path, project: str) -> None:
    async with connect(home=home, agent="alice") as client:
        events = [
            client.event(
                "finding",
                {"text": f"claim {i} about the cache", "impact": 0.5, "confidence": 0.5, "subject": "cache"},
                project=project,
            )
            for i in range(EVENTS)
        ]
        receipts = await client.publish_many(events, wait_for="indexed", timeout_s=120)
    assert {r.level for r in receipts} == {"indexed"}


def health(home: Path) -> tuple[int, str]:
    result = run_epibus(home, "health", check=False)
    return result.returncode, result.stdout + result.stderr


def reported(home: Path, words: str) -> str:
    """What `health` says once it fails saying `words`."""

    def failing() -> str | None:
        code, said = health(home)
        return said if code == 1 and words in said else None

    return eventually_sync(failing)


def doctor(home: Path) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = last_json(run_epibus(home, "doctor", "--json", check=False))
    return checks


def damage_in_the_middle(path: Path, size: int = 8192) -> None:
    length = path.stat().st_size
    assert length > 4 * size, length
    with path.open("r+b") as f:
        f.seek(length // 2)
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())


async def test_a_journal_damaged_under_a_running_node_is_found_and_rebuilt_from_the_stream(
    tmp_path: Path, project: str
) -> None:
    home = tmp_path / "home"
    process, _ = start_node_process(home, env=CHECK_OFTEN)
    try:
        await publish_claims(home, project)
        with contextlib.closing(sqlite3.connect(home / "journal.db")) as conn:  # the events into the file itself
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        damage_in_the_middle(home / "journal.db")  # a disk fault under a running node
        said = reported(home, "journal damaged")
        assert "epibus replay --rebuild" in said
        failed = [c for c in doctor(home) if c["status"] == "fail"]
        assert any("damaged" in c["detail"] and "replay --rebuild" in c["hint"] for c in failed), failed

        rebuilt = last_json(run_epibus(home, "replay", "--rebuild", "--json", timeout_s=300))
        assert rebuilt["rebuilt"] is True
        assert rebuilt["events"] >= EVENTS
        assert (home / Path(rebuilt["aside"]).name).exists()  # the damaged file is kept aside
        assert rebuilt["first_stream_seq"] == 1

        assert eventually_sync(lambda: health(home)[0] == 0, timeout_s=20)
        assert_every_claim_is_back(home, project)
        # the node goes on journaling into the new file, through the consumer it had
        run_epibus(home, "publish", "finding", "-p", project, "--text", "after the rebuild", "--impact", "0.5",
                   "--confidence", "0.5", "--subject", "cache", "--wait", "journaled")  # fmt: skip
        after = last_json(run_epibus(home, "events", "-p", project, "--limit", "500", "--json"))
        assert len(after) == EVENTS + 1
    finally:
        stop_node_process(process)


async def test_a_journal_found_damaged_at_start_names_the_flag_that_rebuilds_it(tmp_path: Path, project: str) -> None:
    home = tmp_path / "home"
    process, _ = start_node_process(home)
    try:
        await publish_claims(home, project)
    finally:
        stop_node_process(process)
    with (home / "journal.db").open("r+b") as journal:
        journal.write(os.urandom(100))  # the header: SQLite no longer knows the file

    refused = run_epibus(home, "up", check=False, timeout_s=60)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "journal damaged" in refused.stderr
    assert "epibus up --rebuild-journal" in refused.stderr

    process, _ = start_node_process(home, "--rebuild-journal")
    try:
        assert list(home.glob("journal.db.aside-*"))  # kept aside
        eventually_sync(lambda: len(last_json(run_epibus(home, "events", "-p", project, "--limit", "500",
                                                         "--json"))) == EVENTS, timeout_s=60)  # fmt: skip
        assert_every_claim_is_back(home, project)
        assert health(home)[0] == 0
    finally:
        stop_node_process(process)


def assert_every_claim_is_back(home: Path, project: str) -> None:
    rows = last_json(run_epibus(home, "events", "-p", project, "--limit", "500", "--json"))
    assert sorted(row["body"]["text"] for row in rows) == sorted(f"claim {i} about the cache" for i in range(EVENTS))
    report = last_json(run_epibus(home, "reconcile", "-p", project, "--json"))
    assert report["ok"] is True


async def test_a_damaged_mirror_is_named_with_its_remedy_and_reindexed_from_the_stream(
    tmp_path: Path, project: str
) -> None:
    home = tmp_path / "home"
    process, _ = start_node_process(home)
    try:
        await publish_claims(home, project)
    finally:
        stop_node_process(process)
    (vectors,) = list((home / "mirror").rglob("vector_storage/vectors/chunk_0.mmap"))
    os.truncate(vectors, 1000)  # cut short: most vectors are gone from it

    process, _ = start_node_process(home, env=CHECK_OFTEN)
    try:
        said = reported(home, "mirror damaged")
        assert "epibus reindex" in said
        failed = [c for c in doctor(home) if c["status"] == "fail"]
        assert any(c["check"] == "mirror pages" and "reindex" in c["hint"] for c in failed), failed
        recalled = run_epibus(home, "recall", "claim about the cache", "-p", project, check=False)
        assert "SELECT" not in recalled.stderr
        if recalled.returncode != 0:
            assert "mirror damaged" in recalled.stdout + recalled.stderr

        run_epibus(home, "reindex", timeout_s=300)
        assert eventually_sync(lambda: health(home)[0] == 0, timeout_s=20)
        hits = last_json(run_epibus(home, "recall", "claim 7 about the cache", "-p", project, "--json"))
        assert hits["hits"]
        report = last_json(run_epibus(home, "reconcile", "-p", project, "--json"))
        assert report["ok"] is True
    finally:
        stop_node_process(process)
