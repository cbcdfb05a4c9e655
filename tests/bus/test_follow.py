"""Following across restarts, in-process against real nats-servers: a stream follower resumes after the last
message it handed out, and a connection whose URL came from node.json finds the node where it moved."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from bus.broker.loops import stop_all
from bus.broker.streams import ensure_streams
from bus.client.client import connect
from bus.client.connection import open_nats
from bus.host.home import NodeInfo, write_node_info
from bus.host.server import NatsServer
from bus.intake.follow import StreamFollower
from bus.subjects import STREAM, events_filter
from tests.bus.test_client import stream_messages
from tests.conftest import finding
from tests.support import eventually


@contextlib.asynccontextmanager
async def followed(nc: NatsClient, project: str, start_seq: int | None = None) -> AsyncIterator[list[bytes]]:
    """Runs a follower of the project's events in the background; yields the payloads it hands out, in order."""
    seen: list[bytes] = []
    follower = StreamFollower(
        nc.jetstream(), STREAM, events_filter(project), start_seq=start_seq, closed=lambda: nc.is_closed
    )

    async def follow() -> None:
        async for msg in follower.messages():
            seen.append(msg.data)

    task = asyncio.create_task(follow())
    try:
        await eventually(lambda: follower.stats.resubscribed >= 1)  # started: "new" means after this point
        yield seen
    finally:
        await stop_all([task])  # one cancel can be swallowed inside nats-py's fetch (bus/broker/loops.py)


async def publish(nc: NatsClient, project: str, *payloads: bytes) -> None:
    js = nc.jetstream()
    for payload in payloads:
        await js.publish(f"epi.{project}.finding.a1", payload, timeout=10)


async def test_a_follower_resumes_after_a_server_restart_missing_and_repeating_nothing(
    nats_server: NatsServer, project: str
) -> None:
    nc = await open_nats([nats_server.url], name="follower", timeout_s=5)
    try:
        await ensure_streams(nc.jetstream())
        async with followed(nc, project) as seen:
            await publish(nc, project, b"before-1", b"before-2")
            await eventually(lambda: len(seen) == 2)
            await asyncio.to_thread(nats_server.restart)
            await eventually(lambda: nc.is_connected, timeout_s=15)
            await publish(nc, project, b"after-1", b"after-2")
            await eventually(lambda: len(seen) >= 4, timeout_s=15)
            assert seen == [b"before-1", b"before-2", b"after-1", b"after-2"]
    finally:
        await nc.close()


async def test_a_follower_that_saw_nothing_before_a_restart_does_not_replay_older_events(
    nats_server: NatsServer, project: str
) -> None:
    nc = await open_nats([nats_server.url], name="follower", timeout_s=5)
    try:
        await ensure_streams(nc.jetstream())
        await publish(nc, project, b"older")
        async with followed(nc, project) as seen:
            await asyncio.to_thread(nats_server.restart)
            await eventually(lambda: nc.is_connected, timeout_s=15)
            await publish(nc, project, b"after-1", b"after-2")
            await eventually(lambda: len(seen) >= 2, timeout_s=15)
            assert seen == [b"after-1", b"after-2"]
    finally:
        await nc.close()


def record_node(home: Path, server: NatsServer) -> None:
    """node.json as `epibus up` writes it; this test process stands in for the node (its pid is alive)."""
    info = NodeInfo(
        pid=os.getpid(),
        nats_url=server.url,
        monitor_url=server.monitor_url,
        journal_url=f"sqlite:///{home / 'journal.db'}",
        outbox_path=str(home / "outbox.db"),
        embedded_server=True,
        started_at=datetime.now(UTC).isoformat(),
    )
    write_node_info(home, info)


async def test_a_client_following_the_local_node_reconnects_where_node_json_says_it_moved(
    tmp_path: Path, home: Path, project: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPIBUS_NATS_URL", raising=False)
    first, second = NatsServer(tmp_path / "first"), NatsServer(tmp_path / "second")
    try:
        first.start()
        record_node(home, first)
        async with connect(agent="alice", home=home, outbox=False, connect_timeout_s=2) as client:
            assert client.follow is not None
            await asyncio.to_thread(second.start)  # while the first still listens: another port for sure
            record_node(home, second)
            first.stop()

            def connected_port() -> int | None:
                url = client.nc.connected_url if client.nc is not None else None
                return url.port if url is not None else None

            assert await eventually(lambda: connected_port() == second.port, timeout_s=15)
            assert client.follow.moves == 1
            receipt = await client.publish(client.event("finding", finding(1), project=project))
        assert await stream_messages(second.url, f"epi.{project}.>") == 1
        assert receipt.stream_seq == 1
    finally:
        first.stop()
        second.stop()
