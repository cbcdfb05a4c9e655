"""Reading a stream to its last sequence: filtered reads, a tail of other subjects, reads across a killed
server. Every read is compared with an independent read of each sequence by number (STREAM.MSG.GET)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

import bus.intake.stream_read
from bus.broker.streams import ensure_streams
from bus.errors import Unavailable
from bus.host.server import NatsServer
from bus.intake.stream_read import last_sequence, read_stream
from bus.subjects import STREAM
from tests.support import eventually, missing_and_extra


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NatsClient]:
    conn = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        await ensure_streams(conn.jetstream())
        yield conn
    finally:
        await conn.close()


async def publish(nc: NatsClient, subjects: list[str]) -> list[str]:
    """Publish one message per subject (its id as the payload) and wait until the stream holds them all."""
    js = nc.jetstream()
    before = await last_sequence(js, STREAM)
    ids = [f"{subject}#{before + i + 1}" for i, subject in enumerate(subjects)]
    for subject, message_id in zip(subjects, ids, strict=True):
        await nc.publish(subject, message_id.encode())  # core publish: fast, and the stream stores it
    await nc.flush()
    await eventually(lambda: _stored(js, before + len(subjects)), timeout_s=30)
    return ids


async def _stored(js: JetStreamContext, count: int) -> bool:
    try:
        return await last_sequence(js, STREAM) >= count
    except Unavailable:
        return False  # a request sent while the client reconnected: ask again


async def ids_by_sequence(js: JetStreamContext, matches: Callable[[str], bool]) -> list[str]:
    """The ids of matching messages, fetched one sequence at a time: no consumer, no filter index."""
    found: list[str] = []
    for seq in range(1, await last_sequence(js, STREAM) + 1):
        try:
            msg = await js.get_msg(STREAM, seq=seq)
        except nats.js.errors.NotFoundError:
            continue  # deleted
        assert msg.subject is not None
        assert msg.data is not None
        if matches(msg.subject):
            found.append(msg.data.decode())
    return found


async def ids_read(js: JetStreamContext, **kwargs: Any) -> list[str]:
    return [m.data.decode() async for batch in read_stream(js, STREAM, **kwargs) for m in batch]


def in_project(project: str) -> Callable[[str], bool]:
    return lambda subject: subject.startswith(f"epi.{project}.")


def spread(projects: int, artifacts: int, rounds: int) -> list[str]:
    """Subjects interleaved over projects and artifacts, `rounds` messages on each."""
    return [f"epi.p{p}.finding.a{a}" for _ in range(rounds) for a in range(artifacts) for p in range(projects)]


async def test_a_filtered_read_returns_every_match_when_the_stream_ends_with_other_subjects(nc: NatsClient) -> None:
    await publish(nc, spread(projects=2, artifacts=5, rounds=30))
    await publish(nc, [f"epi.other.finding.a{i}" for i in range(400)])
    js = nc.jetstream()
    expected = await ids_by_sequence(js, in_project("p1"))
    found = await ids_read(js, filter_subject="epi.p1.>", batch_size=50)
    assert len(expected) == 150
    assert missing_and_extra(set(expected), found) == {"missing": [], "extra": [], "doubled": []}
    assert found == expected  # in stream order


async def test_a_read_stops_at_the_last_sequence_of_when_it_began(nc: NatsClient) -> None:
    first = await publish(nc, [f"epi.p0.finding.a{i}" for i in range(20)])
    js = nc.jetstream()
    batches = read_stream(js, STREAM, filter_subject="epi.p0.>", batch_size=5)
    found = [m.data.decode() for m in await anext(batches)]
    await publish(nc, [f"epi.p0.finding.b{i}" for i in range(20)])  # written during the read
    found += [m.data.decode() async for batch in batches for m in batch]
    assert found == first


async def test_a_read_after_a_kill_and_restart_returns_every_message(nats_server: NatsServer, nc: NatsClient) -> None:
    await publish(nc, spread(projects=6, artifacts=50, rounds=20))  # 6,000 messages on 300 subjects
    nats_server.kill()
    nats_server.start()
    js = nc.jetstream()
    await eventually(lambda: _stored(js, 6000), timeout_s=30)
    for project in ("p0", "p5"):
        expected = await ids_by_sequence(js, in_project(project))
        found = await ids_read(js, filter_subject=f"epi.{project}.>")
        assert len(expected) == 1000
        assert missing_and_extra(set(expected), found) == {"missing": [], "extra": [], "doubled": []}
    everything = await ids_by_sequence(js, lambda _subject: True)
    assert missing_and_extra(set(everything), await ids_read(js)) == {"missing": [], "extra": [], "doubled": []}


async def test_a_read_interrupted_by_a_killed_server_resumes_where_it_stopped(
    nats_server: NatsServer, nc: NatsClient
) -> None:
    await publish(nc, spread(projects=3, artifacts=20, rounds=50))
    js = nc.jetstream()
    expected = await ids_by_sequence(js, in_project("p1"))
    batches = read_stream(js, STREAM, filter_subject="epi.p1.>", batch_size=100)
    found = [m.data.decode() for m in await anext(batches)]
    nats_server.kill()  # the read's consumer lives in memory: it is gone after the restart
    nats_server.start()
    found += [m.data.decode() async for batch in batches for m in batch]
    assert missing_and_extra(set(expected), found) == {"missing": [], "extra": [], "doubled": []}


async def test_a_last_per_subject_read_returns_the_newest_message_of_each_matching_subject(nc: NatsClient) -> None:
    await publish(nc, spread(projects=2, artifacts=10, rounds=3))
    await publish(nc, [f"epi.other.finding.a{i}" for i in range(100)])
    js = nc.jetstream()
    newest: dict[str, str] = {}
    for message_id in await ids_by_sequence(js, in_project("p0")):
        newest[message_id.split("#")[0]] = message_id
    found = await ids_read(js, filter_subject="epi.p0.>", last_per_subject=True)
    assert missing_and_extra(set(newest.values()), found) == {"missing": [], "extra": [], "doubled": []}


async def test_a_read_that_cannot_make_progress_raises_unavailable(
    nats_server: NatsServer, nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bus.intake.stream_read, "READ_STALL_S", 1.0)
    monkeypatch.setattr(bus.intake.stream_read, "READ_TIMEOUT_S", 1.0)
    await publish(nc, [f"epi.p0.finding.a{i}" for i in range(50)])
    batches = read_stream(nc.jetstream(), STREAM, batch_size=10)
    assert len(await anext(batches)) == 10
    nats_server.kill()  # and not started again while the read goes on
    with pytest.raises(Unavailable, match="made no progress"):
        async for _batch in batches:
            pass
    nats_server.start()  # so the connection closes cleanly
    await eventually(lambda: nc.is_connected, timeout_s=30)
