"""Backups an operator can trust: a backup taken while agents publish restores onto a fresh home, and the node
started there reconciles clean (every event of the snapshot in its journal and its rebuilt mirror). A backup
never goes into a directory that holds something, a restore never over a node's home, and what holds keys is
owner-only."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path

import pytest

from bus.client.client import connect
from tests.conftest import finding
from tests.support import (
    cli_env,
    eventually,
    eventually_sync,
    last_json,
    run_epibus,
    start_node_process,
    stop_node_process,
)

pytestmark = pytest.mark.slow


async def publish_until(home: Path, project: str, stop: asyncio.Event, progress: list[int]) -> int:
    """Publish until stopped; `progress[0]` counts what was published so far."""
    sent = 0
    async with connect(home=home, agent="writer") as client:
        while not stop.is_set():
            events = [client.event("finding", finding(sent + i), project=project) for i in range(20)]
            await client.publish_many(events)
            sent += len(events)
            progress[0] = sent
            await asyncio.sleep(0.01)
    return sent


async def epibus_async(home: Path, *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epibus", *args, env=cli_env(home), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, err = await process.communicate()
    return process.returncode or 0, out.decode(), err.decode()


async def test_a_backup_taken_under_load_restores_onto_a_fresh_home_and_reconciles_clean(
    tmp_path: Path, project: str
) -> None:
    home, fresh, backup = tmp_path / "home", tmp_path / "fresh", tmp_path / "backup"
    process, _ = start_node_process(home)
    try:
        stop, progress = asyncio.Event(), [0]
        writer = asyncio.create_task(publish_until(home, project, stop, progress))
        await eventually(lambda: progress[0] >= 100, timeout_s=60)  # agents are publishing when the backup starts
        code, out, err = await epibus_async(home, "backup", str(backup), "--json")
        stop.set()
        sent = await writer
        assert code == 0, err
        made = json.loads(out.strip().splitlines()[-1])
        (events_stream,) = [s for s in made["streams"] if s["name"] == "EPI"]
        assert 0 < events_stream["messages"] <= sent  # a point in time while publishing went on
        assert made["journal"]["copied"] is True
        assert made["journal"]["events"] <= events_stream["messages"]  # copied first: nothing the snapshot lacks
    finally:
        stop_node_process(process)

    for path in backup.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert (backup / "home" / "node.nk").exists()

    again = run_epibus(home, "restore", str(backup), "--home", str(home), check=False)
    assert again.returncode == 1
    assert "restore goes onto a fresh home" in again.stderr
    assert again.stderr.count("\n") == 1, again.stderr
    restored = last_json(run_epibus(fresh, "restore", str(backup), "--home", str(fresh), "--json", timeout_s=120))
    assert restored["streams"]["EPI"] == events_stream["messages"]

    process, _ = start_node_process(fresh)
    try:

        def caught_up() -> dict[str, object] | None:
            report = last_json(run_epibus(fresh, "reconcile", "-p", project, "--json", check=False))
            (node,) = report["nodes"]
            return node if node["clean"] and node["stream_events"] == events_stream["messages"] else None

        node = eventually_sync(caught_up, timeout_s=180, interval_s=2)
        rows = last_json(run_epibus(fresh, "events", "-p", project, "--limit", "100000", "--json"))
        assert len(rows) == events_stream["messages"]
        assert node["stream_events"] == events_stream["messages"]
    finally:
        stop_node_process(process)


def test_a_backup_never_writes_into_a_directory_that_holds_something(tmp_path: Path) -> None:
    home, backup = tmp_path / "home", tmp_path / "backup"
    backup.mkdir()
    (backup / "precious.txt").write_text("keep me")
    process, _ = start_node_process(home)
    try:
        refused = run_epibus(home, "backup", str(backup), check=False)
    finally:
        stop_node_process(process)
    assert refused.returncode == 1
    assert "is not empty" in refused.stderr
    assert sorted(p.name for p in backup.iterdir()) == ["precious.txt"]
