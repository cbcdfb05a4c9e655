"""Failures in the middle of work: NATS killed while publishing, the observer process killed mid-stream.
Every case ends with each event in the journal exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from bus.client.client import connect
from bus.host.server import NatsServer
from bus.model.vocab import ReceiptLevel
from bus.subjects import STREAM
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.support import eventually, journal_event_ids, missing_and_extra

pytestmark = pytest.mark.slow


async def project_messages(url: str, project: str) -> int:
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(STREAM, subjects_filter=f"epi.{project}.>")
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def test_nats_killed_while_publishing_5000_events_loses_and_doubles_nothing(
    nats_server: NatsServer, home: Path, project: str, sqlite_journal_url: str
) -> None:
    total, chunk = 5000, 50
    levels: dict[str, int] = {}
    expected: set[str] = set()
    async with Node(
        NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")
    ) as node:
        async with connect(nats_server.url, agent="alice", home=home, publish_timeout_s=2, connect_timeout_s=2) as c:
            for start in range(0, total, chunk):
                if start == 1500:
                    nats_server.kill()  # SIGKILL, as a crash: only what was fsynced survives
                if start == 3500:
                    nats_server.start()
                events = [c.event("finding", finding(i), project=project) for i in range(start, start + chunk)]
                expected |= {str(e.event_id) for e in events}
                for receipt in await c.publish_many(events, timeout_s=2):
                    levels[receipt.level.value] = levels.get(receipt.level.value, 0) + 1

            async def drained() -> bool:
                return await c.outbox_depth() == 0

            await eventually(drained, timeout_s=120, interval_s=0.2)
        assert node.journal is not None
        journal_url = node.journal.url
        await eventually(lambda: len(journal_event_ids(journal_url, project)) >= total, timeout_s=120)
    assert levels.get("outboxed", 0) > 0, f"the outage never showed: {levels}"
    report = missing_and_extra(expected, journal_event_ids(sqlite_journal_url, project))
    assert report == {"missing": [], "extra": [], "doubled": []}
    assert await project_messages(nats_server.url, project) == total  # Nats-Msg-Id deduplicated the resends


def start_node_process(home: Path, nats_url: str, journal_url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "EPIBUS_HOME": str(home), "EPIBUS_LOG_LEVEL": "INFO"}
    with log.open("ab") as out:
        return subprocess.Popen(
            # The journal is under test; the mirror is off so it does not compete for the 2 cores.
            [
                sys.executable,
                "-m",
                "epibus",
                "up",
                "--nats",
                nats_url,
                "--journal",
                journal_url,
                "--mirror",
                "off",
                "--json",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )


def wait_until_running(process: subprocess.Popen[bytes]) -> dict[str, object]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"node exited with {process.poll()} before reporting"
    status: dict[str, object] = json.loads(line)
    assert status["status"] == "running"
    return status


async def test_observer_process_killed_mid_stream_loses_and_doubles_nothing(
    nats_server: NatsServer, tmp_path: Path, home: Path, project: str, sqlite_journal_url: str
) -> None:
    node_home, log = tmp_path / "node-home", tmp_path / "node.log"
    total = 6000
    node = start_node_process(node_home, nats_server.url, sqlite_journal_url, log)
    try:
        wait_until_running(node)
        async with connect(nats_server.url, agent="alice", home=home, outbox=False) as client:
            events = [client.event("finding", finding(i), project=project) for i in range(total)]
            expected = {str(e.event_id) for e in events}
            await client.publish_many(events[:500])
            await eventually(lambda: len(journal_event_ids(sqlite_journal_url, project)) >= 1, timeout_s=30)
            async with asyncio.TaskGroup() as group:
                publishing = group.create_task(client.publish_many(events[500:], timeout_s=60))
                await eventually(lambda: len(journal_event_ids(sqlite_journal_url, project)) >= 1000, timeout_s=30)
                node.send_signal(signal.SIGKILL)
                node.wait(timeout=10)
                journaled_at_kill = len(journal_event_ids(sqlite_journal_url, project))
            receipts = publishing.result()
            assert 0 < journaled_at_kill < total, "the kill must land while the stream is being consumed"
            assert {r.level for r in receipts} == {ReceiptLevel.published}

            node = start_node_process(node_home, nats_server.url, sqlite_journal_url, log)
            wait_until_running(node)
            await eventually(lambda: len(journal_event_ids(sqlite_journal_url, project)) >= total, timeout_s=60)
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=20)
    report = missing_and_extra(expected, journal_event_ids(sqlite_journal_url, project))
    assert report == {"missing": [], "extra": [], "doubled": []}


async def test_the_node_restarts_its_embedded_server_after_a_crash(tmp_path: Path, project: str) -> None:
    home = tmp_path / "home"
    async with Node(NodeConfig(home=home)) as node:
        assert node.server is not None
        url = node.server.url
        node.server.kill()
        await eventually(
            lambda: node.server_restarts == 1 and node.server is not None and node.server.running(), timeout_s=20
        )
        assert node.server.url == url
        async with connect(url, agent="alice", home=home, outbox=False) as client:
            receipt = await client.publish(
                client.event("finding", finding(), project=project), wait_for=ReceiptLevel.journaled, timeout_s=30
            )
    assert receipt.level is ReceiptLevel.journaled
