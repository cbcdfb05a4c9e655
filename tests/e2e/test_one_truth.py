"""The safe door is the same on every node however it got its data: catch-up, reindex, replay, repair.
One test per way it used to break: a claim and its change in one batch, a forged key admitted by the paths
that are not live, a reused event id rewriting the mirror, and event times nobody could have recorded."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.js import JetStreamContext

from bus.client.client import EpibusClient, connect
from bus.client.project_view import load_project
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey, wire_message
from bus.intake.admission import TimeBounds
from bus.intake.reader import dead_letters, replay
from bus.model.event import Envelope, draft_event
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel
from bus.subjects import STREAM, event_subject
from epibus.node.node import Node, NodeConfig
from observers.journal import EventQuery, Journal, JournalObserver
from observers.mirror.observer import payload_state
from observers.mirror.store import Point
from observers.recall import audit_recall, recall
from observers.verify import verify
from tests.conftest import finding
from tests.support import eventually, journal_event_ids

DLQ_REASON = "Epibus-Dlq-Reason"


@asynccontextmanager
async def mirrored_node(server: NatsServer, home: Path, agent: str) -> AsyncIterator[Node]:
    config = NodeConfig(home=home, nats_url=server.url, name=agent, journal_url=f"sqlite:///{home / 'journal.db'}")
    async with Node(config) as node:
        yield node


async def caught_up(node: Node) -> None:
    """Both of the node's consumers have every message of the stream acked (none pending, none in flight)."""
    assert node.js is not None
    assert node.runner is not None
    assert node.mirror is not None
    js = node.js

    async def settled() -> bool:
        assert node.runner is not None
        assert node.mirror is not None
        for name in (node.runner.observer.name, node.mirror.name):
            try:
                info = await js.consumer_info(STREAM, name)
            except nats.js.errors.NotFoundError:
                return False  # the runner has not made its durable consumer yet
            if info.num_pending or info.num_ack_pending:
                return False
        return True

    await eventually(settled, timeout_s=60)


async def publish_raw(js: JetStreamContext, event: Envelope, *, dedupe: bool = True) -> int:
    """Publish as a plain nats-py client would: no validation, no outbox."""
    wire = wire_message(event)
    headers = dict(wire.headers) | ({"Nats-Msg-Id": str(event.event_id)} if dedupe else {})
    ack = await js.publish(wire.subject, wire.data, headers=headers or None)
    return int(ack.seq)


def signed(key: AgentKey, kind: str, body: dict[str, object], project: str, **fields: object) -> Envelope:
    return key.sign(draft_event(kind, body, project=project, actor=key.actor, session_id="s", **fields))  # type: ignore[arg-type]


async def dlq_reasons(js: JetStreamContext) -> list[tuple[str, str]]:
    """(reason, original subject) of every dead letter, read back from the DLQ stream."""
    return [
        ((m.headers or {}).get(DLQ_REASON, ""), (m.headers or {}).get("Epibus-Dlq-Subject", ""))
        for m in await dead_letters(js)
    ]


async def claims_and_changes(alice: EpibusClient, bob: EpibusClient, project: str) -> dict[str, str]:
    """Four claims by alice and, right behind them, a contradiction by bob, and a rollback and a retraction by
    alice (only the author or an admin rolls a claim back)."""
    texts = {
        "kept": "the deploy script warms the cache",
        "contradicted": "the cache is cold after every deploy",
        "rolled_back": "cold caches double the p99 latency",
        "retracted": "the cache warms itself within a minute",
    }
    ids: dict[str, str] = {}
    for label, text in texts.items():
        event = alice.event("finding", finding(text=text), project=project)
        await alice.publish(event, wait_for=ReceiptLevel.published)
        ids[label] = event.artifact_id
    changes = [
        bob.event(
            "contradicted",
            {"contradicted_by": ids["kept"], "reason": "measured"},
            project=project,
            artifact_id=ids["contradicted"],
        ),
        alice.event("rolled_back", {"reason": "wrong benchmark"}, project=project, artifact_id=ids["rolled_back"]),
        alice.event("resolved", {"resolution": "retracted"}, project=project, artifact_id=ids["retracted"]),
    ]
    for change in changes:
        client = alice if change.actor.agent_id == "alice" else bob
        await client.publish(change, wait_for=ReceiptLevel.published)
    return ids


async def assert_mirror_holds_the_changes(node: Node, project: str, ids: dict[str, str]) -> None:
    assert node.store is not None
    assert node.embedder is not None
    points = {
        p.payload["artifact_id"]: payload_state(p.payload)
        for p in await node.store.retrieve([point_id(uuid.UUID(i)) for i in ids.values()])
    }
    assert {label: points[i].state_label for label, i in ids.items()} == {
        "kept": "unverified/active",
        "contradicted": "contradicted/active",
        "rolled_back": "rolled_back/active",
        "retracted": "unverified/resolved(retracted)",
    }
    safe = await recall(node.store, node.embedder, "cache deploy latency", project, k=10)
    assert {h.artifact_id for h in safe.hits} == {ids["kept"]}
    audit = await audit_recall(node.store, node.embedder, "cache deploy latency", project, k=10)
    assert {h.artifact_id for h in audit.hits} == set(ids.values())


async def test_a_claim_and_its_changes_in_one_batch_reach_the_mirror_on_catch_up_and_reindex(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with (
        connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice,
        connect(nats_server.url, agent="bob", home=tmp_path / "bob", outbox=False) as bob,
    ):
        ids = await claims_and_changes(alice, bob, project)  # before any node runs: it catches up in one batch
    async with mirrored_node(nats_server, tmp_path / "node", "node-a") as node:
        await caught_up(node)
        await assert_mirror_holds_the_changes(node, project, ids)
        assert node.js is not None
        assert node.journal is not None
        report = await verify(node.js, node.journal, node.mirror, project=project)
        assert report.as_dict()["mirror"]["stale"] == 0
        assert report.clean
        await node.reindex_mirror()
        await assert_mirror_holds_the_changes(node, project, ids)
        assert (await verify(node.js, node.journal, node.mirror, project=project)).clean


async def test_a_forged_key_is_admitted_by_no_path(nats_server: NatsServer, tmp_path: Path, project: str) -> None:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        genuine = alice.event("finding", finding(text="alice's own finding"), project=project)
        await alice.publish(genuine, wait_for=ReceiptLevel.published)  # alice's key is now registered
    impostor = AgentKey.generate("alice")
    forged = signed(impostor, "finding", finding(text="mallory writing as alice"), project)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await publish_raw(js, forged)
        async with mirrored_node(nats_server, tmp_path / "node", "node-a") as node:
            await caught_up(node)
            assert node.journal is not None
            assert node.store is not None
            assert journal_event_ids(node.journal.url, project) == [str(genuine.event_id)]
            assert ("unknown_actor_key", event_subject(project, "finding", forged.artifact_id)) in await dlq_reasons(js)

            fresh = Journal(f"sqlite:///{tmp_path / 'replayed.db'}")
            fresh.migrate()
            replayed = await replay(js, JournalObserver(fresh, name="replayed"))
            assert "unknown_actor_key" in {reason for _, reason, _ in replayed.rejected}
            assert journal_event_ids(fresh.url, project) == [str(genuine.event_id)]

            repaired = Journal(f"sqlite:///{tmp_path / 'repaired.db'}")
            repaired.migrate()
            await verify(js, repaired, None, project=project, repair=True)
            assert journal_event_ids(repaired.url, project) == [str(genuine.event_id)]

            await node.reindex_mirror()
            assert await node.store.retrieve([point_id(forged.event_id)]) == []
            assert [p.id for p in await node.store.retrieve([point_id(genuine.event_id)])] == [
                point_id(genuine.event_id)
            ]

            view = await load_project(js, project)
            assert set(view.fold.artifacts) == {genuine.artifact_id}
            fresh.close()
            repaired.close()
        async with mirrored_node(nats_server, tmp_path / "second", "node-b") as second:
            await caught_up(second)
            assert second.journal is not None
            assert journal_event_ids(second.journal.url, project) == [str(genuine.event_id)]
    finally:
        await nc.close()


async def test_a_reused_event_id_keeps_the_first_event_in_every_store(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    key = AgentKey.load_or_create(tmp_path / "alice", "alice")
    first = signed(key, "finding", finding(text="the first words under this id"), project)
    second = signed(key, "finding", finding(text="other words under the same id"), project, event_id=first.event_id)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        async with mirrored_node(nats_server, tmp_path / "node", "node-a") as node:
            await publish_raw(js, first)
            await publish_raw(js, second, dedupe=False)  # outside JetStream's window, or from a raw client
            await caught_up(node)
            assert node.journal is not None
            assert node.store is not None
            assert node.mirror is not None
            (row,) = node.journal.query(EventQuery(project=project))
            assert row.envelope["body"]["text"] == "the first words under this id"
            (point,) = await node.store.retrieve([point_id(first.event_id)])
            assert point.payload["content"] == "the first words under this id"
            reasons = [
                r for r, s in await dlq_reasons(js) if s == event_subject(project, "finding", second.artifact_id)
            ]
            assert reasons == ["duplicate_id_conflict"]  # refused by the journal and the mirror; one copy kept
            assert (await verify(js, node.journal, node.mirror, project=project)).clean

            vectors = await node.mirror.embedder.embed([second.body.content_text()])
            await node.store.upsert(
                [
                    Point(
                        point_id(first.event_id),
                        vectors[0],
                        dict(point.payload) | {"content": second.body.content_text(), "event_digest": "0" * 64},
                    )
                ]
            )
            found = (await verify(js, node.journal, node.mirror, project=project)).as_dict()
            assert found["mirror"]["sample_mismatched"] == [str(first.event_id)]
            repaired = await verify(js, node.journal, node.mirror, project=project, repair=True)
            assert repaired.clean
            (point,) = await node.store.retrieve([point_id(first.event_id)])
            assert point.payload["content"] == "the first words under this id"
    finally:
        await nc.close()


@pytest.mark.parametrize("year", [1, 1900, 2999, 9999])
async def test_an_event_dated_far_from_the_stream_clock_is_dead_lettered_by_every_path(
    nats_server: NatsServer, node: Node, tmp_path: Path, project: str, year: int
) -> None:
    key = AgentKey.load_or_create(tmp_path / "alice", "alice")
    dated = signed(
        key, "finding", finding(text=f"written in {year}"), project, recorded_at=datetime(year, 6, 1, tzinfo=UTC)
    )
    skewed = signed(
        key,
        "finding",
        finding(text="a clock a minute fast"),
        project,
        recorded_at=datetime.now(UTC) + timedelta(minutes=1),
    )
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await publish_raw(js, dated)
        await publish_raw(js, skewed)
        assert node.journal is not None
        journal_url = node.journal.url
        await eventually(lambda: journal_event_ids(journal_url, project) == [str(skewed.event_id)])
        subject = event_subject(project, "finding", dated.artifact_id)
        await eventually(lambda: _has_dead_letter(js, ("implausible_time", subject)))
        fresh = Journal(f"sqlite:///{tmp_path / 'replayed.db'}")
        fresh.migrate()
        replayed = await replay(js, JournalObserver(fresh, name="replayed"))
        assert [reason for _, reason, _ in replayed.rejected] == ["implausible_time"]
        assert journal_event_ids(fresh.url, project) == [str(skewed.event_id)]
        assert set((await load_project(js, project)).fold.artifacts) == {skewed.artifact_id}
        fresh.close()
    finally:
        await nc.close()


async def _has_dead_letter(js: JetStreamContext, wanted: tuple[str, str]) -> bool:
    return wanted in await dlq_reasons(js)


def test_time_bounds_allow_clock_skew_ahead_and_a_publish_delay_behind() -> None:
    bounds = TimeBounds(future_skew_s=300, max_delay_s=86_400)
    stored = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    assert bounds.problem(stored + timedelta(seconds=300), stored) is None
    assert bounds.problem(stored - timedelta(seconds=86_400), stored) is None
    ahead = bounds.problem(stored + timedelta(seconds=301), stored)
    behind = bounds.problem(stored - timedelta(seconds=86_401), stored)
    assert ahead is not None
    assert "EPIBUS_MAX_CLOCK_SKEW_S" in ahead
    assert "after the stream stored it" in ahead
    assert behind is not None
    assert "EPIBUS_MAX_PUBLISH_DELAY_S" in behind
    assert "before the stream stored it" in behind


async def test_an_erased_event_id_stays_taken_on_every_path(
    nats_server: NatsServer, tmp_path: Path, project: str
) -> None:
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        claim = alice.event("finding", finding(text="the staging password is in the runbook"), project=project)
        await alice.publish(claim, wait_for=ReceiptLevel.published)
        async with mirrored_node(nats_server, tmp_path / "node", "node-a") as node:
            await caught_up(node)
            await alice.forget(project, claim.artifact_id, reason="a secret")
            key = AgentKey.load_or_create(tmp_path / "alice", "alice")
            reuse = signed(
                key, "finding", finding(text="new words under the erased id"), project, event_id=claim.event_id
            )
            await publish_raw(alice.js, reuse, dedupe=False)  # a raw client, or after the duplicate window
            await caught_up(node)
            assert node.journal is not None
            assert node.store is not None
            assert [r.status for r in node.journal.query(EventQuery(project=project, kind="finding"))] == ["forgotten"]
            assert await node.store.retrieve([point_id(claim.event_id)]) == []
        fresh = Journal(f"sqlite:///{tmp_path / 'replayed.db'}")
        fresh.migrate()
        replayed = await replay(alice.js, JournalObserver(fresh, name="replayed"))
        assert [reason for _, reason, _ in replayed.rejected] == ["duplicate_id_conflict"]
        assert fresh.query(EventQuery(project=project, kind="finding")) == []
        fresh.close()
        assert (await load_project(alice.js, project)).fold.artifacts == {}
        async with mirrored_node(nats_server, tmp_path / "second", "node-b") as second:
            await caught_up(second)
            assert second.journal is not None
            assert second.store is not None
            assert second.journal.query(EventQuery(project=project, kind="finding")) == []
            assert await second.store.retrieve([point_id(claim.event_id)]) == []
