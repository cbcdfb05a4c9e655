"""The consumer runner: ack after the durable write, dead letters with reasons, no double writes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import nats

from bus.broker.loops import stop_all
from bus.client.client import connect
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey, wire_message
from bus.intake.admission import Delivery
from bus.intake.reader import dead_letters, stream_figures
from bus.intake.runner import ConsumerRunner, dead_letter_copy
from bus.model.event import encode_event
from bus.model.vocab import ReceiptLevel
from bus.subjects import (
    DLQ_DIGEST,
    DLQ_ERROR,
    DLQ_REASON,
    DLQ_SIZE,
    DLQ_STREAM_SEQ,
    DLQ_SUBJECT,
    DLQ_TRUNCATED,
    event_subject,
)
from observers.journal import Journal, JournalObserver
from tests.conftest import finding
from tests.support import eventually, headers_of, journal_event_ids, missing_and_extra


@asynccontextmanager
async def running(url: str, *observers: object, **options: object) -> AsyncIterator[list[ConsumerRunner]]:
    """Each observer on its own connection and runner, as separate processes would be."""
    connections = [await nats.connect(url) for _ in observers]
    runners = [ConsumerRunner(nc, ob, **options) for nc, ob in zip(connections, observers, strict=True)]  # type: ignore[arg-type]
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(r.run()) for r in runners]
        try:
            yield runners
        finally:
            await stop_all(tasks)  # one cancel can be swallowed inside nats-py's fetch (bus/broker/loops.py)
    for nc in connections:
        await nc.close()


async def test_foreign_garbage_is_dead_lettered_with_reasons_and_the_journal_stays_intact(
    nats_server: NatsServer, home: Path, project: str, journal: Journal, tmp_path: Path
) -> None:
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, JournalObserver(journal)) as (runner,),
    ):
        good = client.event("finding", finding(1), project=project)
        await client.publish(good)
        raw = await nats.connect(nats_server.url)
        js = raw.jetstream()
        await js.publish(f"epi.{project}.finding.junk", b"\x00\xffnot json at all")
        await js.publish(f"epi.{project}.finding.junk", b'{"kind": "finding"}')
        wrong_subject = client.event("finding", finding(2), project=project)
        await js.publish(
            f"epi.{project}.finding.elsewhere",
            encode_event(wrong_subject),
            headers=dict(wire_message(wrong_subject).headers),
        )
        tampered = json.loads(encode_event(client.event("finding", finding(3), project=project)))
        tampered["body"]["impact"] = 1.0
        await js.publish(event_subject(project, "finding", tampered["artifact_id"]), json.dumps(tampered).encode())
        impostor = AgentKey.load_or_create(tmp_path / "other", "alice")  # same name, another key
        forged = impostor.sign(
            client.event("finding", finding(4), project=project).model_copy(
                update={"actor": impostor.actor, "signature": None}
            )
        )
        forged_wire = wire_message(forged)
        await js.publish(forged_wire.subject, forged_wire.data, headers=dict(forged_wire.headers))
        last = client.event("finding", finding(5), project=project)
        await client.publish(last)
        await raw.close()

        await eventually(lambda: runner.stats.handled == 2 and sum(runner.stats.dead_lettered.values()) == 5)
        letters = await dead_letters(client.js)
    reasons = sorted(headers_of(m)[DLQ_REASON] for m in letters)
    assert reasons == ["bad_signature", "invalid_event", "invalid_event", "subject_mismatch", "unknown_actor_key"]
    for letter in letters:
        assert headers_of(letter)[DLQ_ERROR]
        assert headers_of(letter)[DLQ_SUBJECT].startswith(f"epi.{project}.")
        assert int(headers_of(letter)[DLQ_STREAM_SEQ]) > 0
    garbage = [m for m in letters if headers_of(m)[DLQ_REASON] == "invalid_event"]
    assert {m.data for m in garbage} == {b"\x00\xffnot json at all", b'{"kind": "finding"}'}  # kept as received
    report = missing_and_extra({str(good.event_id), str(last.event_id)}, journal_event_ids(journal.url, project))
    assert report == {"missing": [], "extra": [], "doubled": []}


async def test_a_bad_message_costs_the_dlq_one_copy_however_many_consumers_refuse_it(
    nats_server: NatsServer, home: Path, project: str, tmp_path: Path
) -> None:
    journals = [Journal(f"sqlite:///{tmp_path / f'journal-{i}.db'}") for i in range(3)]
    for journal in journals:
        journal.migrate()
    observers = [JournalObserver(journal) for journal in journals]
    assert len({o.name for o in observers}) == 3  # three durable consumers, as three nodes would have
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, *observers) as runners,
    ):
        raw = await nats.connect(nats_server.url)
        for _ in range(20):  # a flood of one bad message: twenty messages on the stream
            await raw.jetstream().publish(f"epi.{project}.finding.junk", b"not an event")
        await raw.jetstream().publish(f"epi.{project}.finding.junk", b"another bad message")
        await raw.close()
        await eventually(lambda: all(sum(r.stats.dead_lettered.values()) == 21 for r in runners))
        letters = await dead_letters(client.js)
    for journal in journals:
        journal.close()
    assert sorted(m.data for m in letters) == [b"another bad message"] + [b"not an event"] * 20  # not 63


class FailingObserver:
    """Stands in for a broken sink; the runner, not the sink, is under test."""

    def __init__(self, name: str, failures: int) -> None:
        self.name = name
        self.failures_left = failures
        self.calls = 0
        self.written: list[str] = []

    async def handle(self, batch: Sequence[Delivery]) -> None:
        self.calls += 1
        if self.failures_left > 0:
            self.failures_left -= 1
            raise ConnectionError("disk on fire")
        self.written.extend(str(d.event.event_id) for d in batch)


async def test_an_observer_that_always_fails_dead_letters_after_max_deliver(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    observer = FailingObserver("always-fails", failures=10**6)
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, observer, max_deliver=3, redelivery_delays_s=(0.05,), fetch_timeout_s=0.2) as (
            runner,
        ),
    ):
        event = client.event("finding", finding(), project=project)
        await client.publish(event)
        await eventually(lambda: runner.stats.dead_lettered.get("max_deliver") == 1)
        (letter,) = await dead_letters(client.js)
        figures = await stream_figures(client.js)
    assert observer.calls == 3
    assert headers_of(letter)[DLQ_REASON] == "max_deliver"
    assert "disk on fire" in headers_of(letter)[DLQ_ERROR]
    assert json.loads(letter.data)["event_id"] == str(event.event_id)
    consumer = figures["EPI"]["consumers"]["always-fails"]
    assert consumer["pending"] == 0
    assert consumer["ack_pending"] == 0


async def test_a_transient_observer_failure_is_redelivered_and_written_once(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    observer = FailingObserver("flaky", failures=2)
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, observer, max_deliver=5, redelivery_delays_s=(0.05,), fetch_timeout_s=0.2) as (
            runner,
        ),
    ):
        events = [client.event("finding", finding(i), project=project) for i in range(10)]
        await client.publish_many(events)
        await eventually(lambda: len(set(observer.written)) == 10)
    assert sorted(observer.written) == sorted(str(e.event_id) for e in events)
    assert runner.stats.handler_failures == 2
    assert runner.stats.dead_lettered == {}


async def test_wiring_the_journal_observer_twice_still_writes_each_event_once(
    nats_server: NatsServer, home: Path, project: str, journal: Journal
) -> None:
    first, second = JournalObserver(journal), JournalObserver(Journal(journal.url))
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, first, second, batch_size=50) as runners,
    ):
        events = [client.event("finding", finding(i), project=project) for i in range(1000)]
        await client.publish_many(events, timeout_s=60)
        await eventually(lambda: sum(r.stats.handled for r in runners) >= 1000, timeout_s=30)
    report = missing_and_extra({str(e.event_id) for e in events}, journal_event_ids(journal.url, project))
    assert report == {"missing": [], "extra": [], "doubled": []}
    assert first.inserted + second.inserted == 1000


async def test_an_empty_poll_resets_nothing(
    nats_server: NatsServer, home: Path, project: str, journal: Journal
) -> None:
    nc = await nats.connect(nats_server.url)
    runner = ConsumerRunner(nc, JournalObserver(journal), fetch_timeout_s=0.1)  # stepped by hand, no loop
    try:
        async with connect(nats_server.url, agent="alice", home=home) as client:
            await client.publish(client.event("finding", finding(), project=project))

        async def handled_one() -> bool:
            await runner.step()
            return runner.stats.handled == 1

        await eventually(handled_one)
        seen = (runner.stats.handled, runner.stats.last_stream_seq, runner.stats.fetch_errors)
        assert [await runner.step() for _ in range(3)] == [0, 0, 0]
        assert (runner.stats.handled, runner.stats.last_stream_seq, runner.stats.fetch_errors) == seen
    finally:
        await nc.close()


async def test_journaled_receipt_is_confirmed_by_the_lookup_service(
    nats_server: NatsServer, home: Path, project: str, journal: Journal
) -> None:
    observer = JournalObserver(journal)
    nc = await nats.connect(nats_server.url)
    await observer.serve_lookups(nc)
    try:
        async with connect(nats_server.url, agent="alice", home=home) as client, running(nats_server.url, observer):
            receipt = await client.publish(
                client.event("finding", finding(), project=project), wait_for=ReceiptLevel.journaled
            )
    finally:
        await nc.close()
    assert receipt.level is ReceiptLevel.journaled
    assert journal_event_ids(journal.url, project) == [str(receipt.event_id)]


class OutageObserver:
    """A sink whose store is down for the first `down_calls` calls (stands in for a database outage)."""

    def __init__(self, name: str, down_calls: int) -> None:
        self.name = name
        self.down_calls = down_calls
        self.written: list[str] = []

    async def handle(self, batch: Sequence[Delivery]) -> None:
        from bus.errors import Unavailable

        if self.down_calls > 0:
            self.down_calls -= 1
            raise Unavailable("journal", "connection refused")
        self.written.extend(str(d.event.event_id) for d in batch)


async def test_a_store_outage_holds_events_instead_of_dead_lettering_them(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    observer = OutageObserver("outage", down_calls=8)  # longer than max_deliver attempts would allow
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, observer, max_deliver=2, ack_wait_s=2.0, fetch_timeout_s=0.2) as (runner,),
    ):
        events = [client.event("finding", finding(i), project=project) for i in range(20)]
        await client.publish_many(events)
        await eventually(lambda: runner.stats.degraded, timeout_s=10)
        await eventually(lambda: len(observer.written) == 20, timeout_s=60)
        letters = await dead_letters(client.js)
    assert sorted(observer.written) == sorted(str(e.event_id) for e in events)
    assert letters == []
    assert runner.stats.dead_lettered == {}
    assert runner.stats.outage_retries == 8
    assert runner.stats.degraded is False


class PoisonObserver:
    """Fails on one specific event, writes the others (stands in for a sink that chokes on one row)."""

    def __init__(self, name: str, poison: str) -> None:
        self.name = name
        self.poison = poison
        self.written: list[str] = []

    async def handle(self, batch: Sequence[Delivery]) -> None:
        if any(str(d.event.event_id) == self.poison for d in batch):
            raise ValueError("cannot store this one")
        self.written.extend(str(d.event.event_id) for d in batch)


async def test_one_poison_event_does_not_take_its_batch_to_the_dlq(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=home) as client:
        events = [client.event("finding", finding(i), project=project) for i in range(10)]
        observer = PoisonObserver("poison", str(events[4].event_id))
        async with running(
            nats_server.url, observer, max_deliver=2, redelivery_delays_s=(0.05,), fetch_timeout_s=0.2
        ) as (runner,):
            await client.publish_many(events)
            await eventually(lambda: runner.stats.dead_lettered.get("max_deliver") == 1, timeout_s=20)
            (letter,) = await dead_letters(client.js)
    assert json.loads(letter.data)["event_id"] == observer.poison
    assert sorted(observer.written) == sorted(str(e.event_id) for e in events if str(e.event_id) != observer.poison)


async def test_a_deleted_consumer_is_recreated_and_consumption_resumes(
    nats_server: NatsServer, home: Path, project: str, journal: Journal
) -> None:
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, JournalObserver(journal), fetch_timeout_s=0.2) as (runner,),
    ):
        first = client.event("finding", finding(1), project=project)
        await client.publish(first)
        await eventually(lambda: runner.stats.handled == 1)
        await client.js.delete_consumer("EPI", runner.observer.name)
        second = client.event("finding", finding(2), project=project)
        await client.publish(second)
        await eventually(lambda: str(second.event_id) in journal_event_ids(journal.url, project), timeout_s=30)
    assert sorted(journal_event_ids(journal.url, project)) == sorted([str(first.event_id), str(second.event_id)])


async def test_the_server_never_gives_up_on_a_message_the_runner_enforces_max_deliver(
    nats_server: NatsServer, journal: Journal
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        runner = ConsumerRunner(nc, JournalObserver(journal), max_deliver=3)
        assert runner.consumer_config().max_deliver == -1
        assert runner.max_deliver == 3
    finally:
        await nc.close()


async def test_an_observer_that_stops_advancing_while_events_wait_is_reported_stalled(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    """A store that stays down is held as degraded; once nothing has been acked for the stall limit while
    events wait, the observer is stalled (stats, an ERROR line), and it recovers when the store does."""
    observer = OutageObserver("stalling", down_calls=10_000)
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, observer, ack_wait_s=2.0, fetch_timeout_s=0.2) as (runner,),
    ):
        watching = asyncio.create_task(runner.watch_progress(interval_s=0.2, stall_after_s=1.0))
        try:
            await asyncio.sleep(0.6)
            assert runner.stats.stalled is False  # idle, nothing waits: not stalled however long
            events = [client.event("finding", finding(i), project=project) for i in range(5)]
            await client.publish_many(events)
            await eventually(lambda: runner.stats.stalled, timeout_s=15)
            assert runner.stats.pending
            assert runner.stats.pending >= 1
            observer.down_calls = 0
            await eventually(lambda: len(observer.written) == 5, timeout_s=20)
            await eventually(lambda: not runner.stats.stalled, timeout_s=10)
        finally:
            watching.cancel()


def test_a_dead_letters_copy_leaves_the_callers_headers_as_they_were() -> None:
    headers = {"Epibus-Dlq-Reason": "bad_signature"}
    data, copied = dead_letter_copy(b"x" * 2_000_000, headers, max_payload=1_048_576)
    assert headers == {"Epibus-Dlq-Reason": "bad_signature"}
    assert copied[DLQ_SIZE] == "2000000"
    assert int(copied[DLQ_TRUNCATED]) == len(data) < 1_048_576
    assert copied[DLQ_DIGEST] == hashlib.sha256(b"x" * 2_000_000).hexdigest()
    small, kept = dead_letter_copy(b"ok", headers, max_payload=1_048_576)
    assert small == b"ok"
    assert DLQ_TRUNCATED not in kept
