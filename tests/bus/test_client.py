"""Publishing through the client: receipts, dedupe, the outbox across an outage."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import nats
import pytest

from bus.broker.streams import ensure_streams
from bus.client.client import connect
from bus.errors import ConfigError, Conflict, InvalidEvent, Unavailable
from bus.host.home import outbox_path
from bus.host.server import NatsServer
from bus.model.vocab import ReceiptLevel
from bus.subjects import STREAM, artifact_filter
from epibus.node.node import Node, NodeConfig
from tests.conftest import finding
from tests.support import eventually, journal_event_ids


async def stream_messages(url: str, subject: str) -> int:
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(STREAM, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def test_publish_round_trip_is_read_back_from_the_journal_by_sql(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        event = client.event("finding", finding(text="disk fills at 80% on node 3"), project=project)
        receipt = await client.publish(event, wait_for=ReceiptLevel.journaled)
    assert receipt.level is ReceiptLevel.journaled
    assert receipt.stream_seq is not None
    assert receipt.stream_seq >= 1
    assert node.journal is not None
    assert journal_event_ids(node.journal.url, project) == [str(event.event_id)]
    (row,) = node.journal.query(__import__("observers.journal").journal.EventQuery(project=project))
    assert row.event() == event
    assert row.envelope["body"]["text"] == "disk fills at 80% on node 3"


async def test_same_event_twice_gives_one_stream_message_and_one_row(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        event = client.event("unknown", {"question": "why is p99 bimodal?", "impact": 0.4}, project=project)
        first = await client.publish(event, wait_for=ReceiptLevel.journaled)
        second = await client.publish(event, wait_for=ReceiptLevel.journaled)
    assert (first.duplicate, second.duplicate) == (False, True)
    assert first.stream_seq == second.stream_seq
    assert await stream_messages(nats_server.url, artifact_filter(project, event.artifact_id)) == 1
    assert node.journal is not None
    assert journal_event_ids(node.journal.url, project) == [str(event.event_id)]


async def test_publish_many_without_outbox_lands_every_event_once(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home, outbox=False) as client:
        events = [client.event("finding", finding(i), project=project) for i in range(1500)]
        receipts = await client.publish_many(events, wait_for=ReceiptLevel.journaled, timeout_s=60)
    assert [r.event_id for r in receipts] == [e.event_id for e in events]
    assert {r.level for r in receipts} == {ReceiptLevel.journaled}
    assert node.journal is not None
    assert sorted(journal_event_ids(node.journal.url, project)) == sorted(str(e.event_id) for e in events)


async def test_one_invalid_event_in_a_batch_writes_none(nats_server: NatsServer, home: Path, project: str) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        good = client.event("finding", finding(1), project=project)
        bad = good.model_copy(update={"body": good.body.model_copy(update={"text": "x" * 70_000})})
        with pytest.raises(InvalidEvent):
            await client.publish_many([good, bad])
        assert await client.outbox_depth() == 0
    assert await stream_messages(nats_server.url, f"epi.{project}.>") == 0


async def test_publishing_offline_keeps_events_in_the_outbox_until_nats_returns(
    tmp_path: Path, home: Path, project: str
) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    url = server.url
    server.stop()  # the port is now known and nothing answers on it
    try:
        async with connect(url, agent="alice", home=home, connect_timeout_s=1, publish_timeout_s=1) as client:
            events = [client.event("finding", finding(i), project=project) for i in range(20)]
            receipts = await client.publish_many(events)
            assert {r.level for r in receipts} == {ReceiptLevel.outboxed}
            with sqlite3.connect(outbox_path(home)) as db:  # durable on disk, read by another path
                stored = {row[0] for row in db.execute("SELECT event_id FROM outbox")}
            assert stored == {str(e.event_id) for e in events}

            server.start()
            await eventually(lambda: client.connected, timeout_s=20)

            async def drained() -> bool:
                return await client.outbox_depth() == 0

            await eventually(drained, timeout_s=20)
        assert await stream_messages(url, f"epi.{project}.>") == 20
    finally:
        server.stop()


async def test_without_an_outbox_an_unreachable_nats_raises_unavailable(home: Path) -> None:
    with pytest.raises(Unavailable, match="nats"):
        async with connect("nats://127.0.0.1:1", agent="alice", home=home, outbox=False, connect_timeout_s=1):
            pass


def test_no_running_node_and_no_url_is_a_clear_config_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPIBUS_NATS_URL", raising=False)
    with pytest.raises(ConfigError, match=r"no epibus node is running.*epibus up"):
        connect(agent="alice", home=home)


async def test_journaled_wait_without_a_journal_says_so(nats_server: NatsServer, home: Path, project: str) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        event = client.event("finding", finding(), project=project)
        with pytest.raises(Unavailable, match="no journal observer answered"):
            await client.publish(event, wait_for=ReceiptLevel.journaled, timeout_s=1)


async def test_stale_expected_sequence_is_a_conflict_not_a_timeout(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        first = client.event("finding", finding(1), project=project)
        await client.publish(first)
        scope = artifact_filter(project, first.artifact_id)
        cas = {"Nats-Expected-Last-Subject-Sequence": "0", "Nats-Expected-Last-Subject-Sequence-Subject": scope}
        transition = client.event("verified", {"note": "late"}, project=project, artifact_id=first.artifact_id)
        with pytest.raises(Conflict, match="10071"):
            await client.publish_expecting(transition, expected_headers=cas, timeout_s=5)


async def test_ensure_streams_is_idempotent(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        for _ in range(3):
            await ensure_streams(nc.jetstream())
        info = await nc.jetstream().stream_info(STREAM)
        assert info.config.subjects == ["epi.>"]
        assert info.config.duplicate_window >= 120
    finally:
        await nc.close()


async def test_an_agent_cannot_publish_with_another_agents_name(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    first_home, second_home = tmp_path / "a", tmp_path / "b"
    async with connect(nats_server.url, agent="mallory", home=first_home, outbox=False):
        pass
    with pytest.raises(Conflict, match="agent mallory"):
        async with connect(nats_server.url, agent="mallory", home=second_home, outbox=False):
            pass


async def test_stream_is_recreated_after_the_server_loses_its_store(tmp_path: Path, home: Path, project: str) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        async with connect(server.url, agent="alice", home=home, publish_timeout_s=2) as client:
            await client.publish(client.event("finding", finding(1), project=project))
            server.stop()
            import shutil

            shutil.rmtree(tmp_path / "nats" / "jetstream")
            server.start()
            await client.publish(client.event("finding", finding(2), project=project), timeout_s=15)

            async def republished() -> bool:
                return await client.outbox_depth() == 0 and client.connected

            await eventually(republished, timeout_s=30)
        # The wiped store lost event 1 with it; event 2 went to the stream the client re-created.
        assert await stream_messages(server.url, f"epi.{project}.>") == 1
    finally:
        server.stop()


async def test_direct_publish_rides_out_a_short_restart_with_the_same_ids(
    tmp_path: Path, home: Path, project: str
) -> None:
    import threading

    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        async with connect(server.url, agent="alice", home=home, outbox=False, publish_timeout_s=1) as client:
            await client.publish(client.event("finding", finding(0), project=project))
            server.stop()
            restart = threading.Timer(1.0, server.start)
            restart.start()
            events = [client.event("finding", finding(i), project=project) for i in range(1, 200)]
            receipts = await client.publish_many(events)
            restart.join()
        assert {r.level for r in receipts} == {ReceiptLevel.published}
        assert await stream_messages(server.url, f"epi.{project}.>") == 200
    finally:
        server.stop()


def test_the_sync_facade_publishes_and_waits_for_the_journal(
    nats_server: NatsServer, home: Path, project: str, sqlite_journal_url: str
) -> None:
    import threading

    from epibus import sync

    ready, stop = threading.Event(), threading.Event()

    def run_node() -> None:
        async def main() -> None:
            async with Node(
                NodeConfig(home=home, nats_url=nats_server.url, journal_url=sqlite_journal_url, mirror="off")
            ):
                ready.set()
                await asyncio.to_thread(stop.wait)

        asyncio.run(main())

    thread = threading.Thread(target=run_node)
    thread.start()
    try:
        assert ready.wait(30)
        receipt = sync.publish(
            "unknown",
            {"question": "sync ok?", "impact": 0.3},
            project=project,
            agent="alice",
            nats_url=nats_server.url,
            home=home,
            wait_for=ReceiptLevel.journaled,
        )
    finally:
        stop.set()
        thread.join(30)
    assert receipt.level is ReceiptLevel.journaled
    assert journal_event_ids(sqlite_journal_url, project) == [str(receipt.event_id)]


async def test_a_receipt_is_read_from_the_shared_outbox_when_another_forwarder_sent_the_event(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        for task in client._tasks:  # this client's forwarder stops: only the node's drains the shared outbox
            task.cancel()
        event = client.event("finding", finding(), project=project)
        receipt = await client.publish(event, timeout_s=15)
    assert receipt.level is ReceiptLevel.published
    assert receipt.stream_seq is not None
    assert node.forwarder is not None
    assert node.forwarder.stats.sent >= 1
    assert node.journal is not None
    journal_url = node.journal.url
    await eventually(lambda: journal_event_ids(journal_url, project) == [str(event.event_id)])


async def test_wait_for_accepts_strings_and_refuses_levels_it_cannot_reach(
    node: Node, nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        receipt = await client.publish(client.event("finding", finding(), project=project), wait_for="journaled")
        assert receipt.level is ReceiptLevel.journaled
        unindexed = client.event("finding", finding(), project=project)
        with pytest.raises(ConfigError, match="not indexed: this node has no mirror"):  # at once, not at a timeout
            await asyncio.wait_for(client.publish(unindexed, wait_for="indexed", timeout_s=30), timeout=10)
        assert node.journal is not None
        assert str(unindexed.event_id) in journal_event_ids(node.journal.url, project)  # published all the same
        with pytest.raises(ConfigError, match="allowed: outboxed, published, journaled"):
            await client.publish(client.event("finding", finding(), project=project), wait_for="soon")
        quick = await client.publish(client.event("finding", finding(), project=project), wait_for="outboxed")
        assert quick.level is ReceiptLevel.outboxed
    async with connect(nats_server.url, agent="alice", home=home, outbox=False) as direct:
        with pytest.raises(ConfigError, match="outbox"):
            await direct.publish(direct.event("finding", finding(), project=project), wait_for="outboxed")
