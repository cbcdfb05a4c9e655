"""One journal suite, every backend: each case runs on SQLite and on the machine's PostgreSQL.
Reads go back through plain SQL, not through the code that wrote."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from bus.errors import ConfigError, Unavailable
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.intake.admission import Delivery
from bus.model.event import draft_event
from bus.model.kinds import FindingBody
from bus.subjects import event_subject
from epibus.node.node import Node, NodeConfig
from observers.journal import EventQuery, Journal
from observers.journal_engine import make_engine
from observers.schema import LATEST_VERSION, events
from tests.conftest import finding
from tests.support import journal_event_ids, missing_and_extra


@pytest.fixture
def journal(journal_url: str) -> Iterator[Journal]:
    store = Journal(journal_url)
    store.migrate()
    yield store
    store.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AgentKey]:
    root = tmp_path_factory.mktemp("keys")
    return {name: AgentKey.load_or_create(root, name) for name in ("alice", "bob")}


def deliveries(key: AgentKey, project: str, n: int, *, kind: str = "finding", start_seq: int = 1) -> list[Delivery]:
    out = []
    for i in range(n):
        body = finding(i) if kind == "finding" else {"question": f"q{i}", "impact": 0.0}
        event = key.sign(draft_event(kind, body, project=project, actor=key.actor, session_id="s"))
        out.append(Delivery(event, event_subject(project, kind, event.artifact_id), start_seq + i, 1))
    return out


def test_written_events_are_read_back_by_sql(journal: Journal, keys: dict[str, AgentKey], project: str) -> None:
    batch = deliveries(keys["alice"], project, 25)
    assert sorted(journal.write(batch).inserted) == sorted(str(d.event.event_id) for d in batch)
    report = missing_and_extra({str(d.event.event_id) for d in batch}, journal_event_ids(journal.url, project))
    assert report == {"missing": [], "extra": [], "doubled": []}


def test_writing_the_same_events_again_adds_no_row(journal: Journal, keys: dict[str, AgentKey], project: str) -> None:
    batch = deliveries(keys["alice"], project, 10)
    journal.write(batch)
    assert journal.write(batch).inserted == []
    assert journal.write(batch[:3] + deliveries(keys["alice"], project, 2, start_seq=100)).inserted != []
    assert len(journal_event_ids(journal.url, project)) == 12


def test_a_different_event_under_a_journaled_id_is_refused_and_the_first_is_kept(
    journal: Journal, keys: dict[str, AgentKey], project: str
) -> None:
    (first,) = deliveries(keys["alice"], project, 1)
    journal.write([first])
    forged = keys["alice"].sign(
        first.event.model_copy(update={"body": first.event.body.model_copy(update={"text": "rewritten"})})
    )
    again = Delivery(forged, first.subject, 900, 1)
    written = journal.write([again])
    assert written.inserted == []
    assert [(r.stream_seq, r.reason.value) for r in written.refused] == [(900, "duplicate_id_conflict")]
    (row,) = journal.query(EventQuery(project=project))
    assert isinstance(first.event.body, FindingBody)
    assert row.envelope["body"]["text"] == first.event.body.text
    assert row.stream_seq == first.stream_seq


def test_an_exact_resend_of_a_journaled_event_is_neither_written_nor_refused(
    journal: Journal, keys: dict[str, AgentKey], project: str
) -> None:
    (first,) = deliveries(keys["alice"], project, 1)
    journal.write([first])
    written = journal.write([Delivery(first.event, first.subject, 700, 1)])
    assert (written.inserted, written.refused) == ([], [])
    assert journal_event_ids(journal.url, project) == [str(first.event.event_id)]


def test_within_one_batch_the_first_event_in_stream_order_under_an_id_wins(
    journal: Journal, keys: dict[str, AgentKey], project: str
) -> None:
    (first,) = deliveries(keys["alice"], project, 1, start_seq=50)
    other = keys["alice"].sign(
        first.event.model_copy(update={"body": first.event.body.model_copy(update={"text": "other"})})
    )
    written = journal.write([Delivery(other, first.subject, 60, 1), first])
    assert written.inserted == [str(first.event.event_id)]
    assert [r.stream_seq for r in written.refused] == [60]
    (row,) = journal.query(EventQuery(project=project))
    assert row.stream_seq == 50
    assert isinstance(first.event.body, FindingBody)
    assert row.envelope["body"]["text"] == first.event.body.text


@pytest.mark.parametrize("one_snapshot", [True, False])
def test_a_snapshot_read_never_straddles_a_write(
    journal: Journal, keys: dict[str, AgentKey], project: str, one_snapshot: bool
) -> None:
    """Two statements of one snapshot read see the same committed state, on every backend (a read of the
    artifacts and then of their verifications must not see a verification its artifact does not show yet);
    without it, the second statement sees the write: the test would fail if the snapshot did nothing."""
    journal.write(deliveries(keys["alice"], project, 2))
    with journal.reading("a snapshot read", one_snapshot=one_snapshot) as conn:
        counted = select(func.count()).select_from(events).where(events.c.project == project)
        before = conn.execute(counted).scalar_one()
        journal.write(deliveries(keys["alice"], project, 3, start_seq=3))  # another connection commits
        after = conn.execute(counted).scalar_one()
    assert before == 2
    assert after == (2 if one_snapshot else 5)


def test_zero_and_empty_values_are_stored_as_values(journal: Journal, keys: dict[str, AgentKey], project: str) -> None:
    (delivery,) = deliveries(keys["alice"], project, 1, kind="unknown")
    journal.write([delivery])
    (row,) = journal.query(EventQuery(project=project))
    assert row.envelope["body"]["impact"] == 0.0
    assert row.event() == delivery.event


def test_queries_filter_by_project_kind_actor_artifact_and_time(
    journal: Journal, keys: dict[str, AgentKey], project: str
) -> None:
    alice = deliveries(keys["alice"], project, 3)
    bob = deliveries(keys["bob"], project, 2, kind="unknown", start_seq=10)
    other = deliveries(keys["alice"], f"{project}-x", 4, start_seq=20)
    journal.write(alice + bob + other)
    assert {r.event_id for r in journal.query(EventQuery(project=project))} == {
        str(d.event.event_id) for d in alice + bob
    }
    assert len(journal.query(EventQuery(project=project, kind="unknown"))) == 2
    assert {r.actor_id for r in journal.query(EventQuery(project=project, actor="bob"))} == {"bob"}
    target = alice[1].event.artifact_id
    assert [r.artifact_id for r in journal.query(EventQuery(artifact_id=target))] == [target]
    now = datetime.now(UTC)
    assert len(journal.query(EventQuery(project=project, since=now - timedelta(minutes=5)))) == 5
    assert journal.query(EventQuery(project=project, until=now - timedelta(minutes=5))) == []
    newest = journal.query(EventQuery(project=project, limit=2))
    assert [r.stream_seq for r in newest] == [11, 10]
    oldest = journal.query(EventQuery(project=project, limit=2, newest_first=False))
    assert [r.stream_seq for r in oldest] == [1, 2]


def test_migrations_are_recorded_and_idempotent_even_when_concurrent(journal_url: str) -> None:
    errors: list[BaseException] = []

    def migrate() -> None:
        store = Journal(journal_url)
        try:
            assert store.migrate() == LATEST_VERSION
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=migrate) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    engine = make_engine(journal_url)
    with engine.connect() as conn:
        versions = conn.execute(text("SELECT version FROM epibus_schema")).scalars().all()
    engine.dispose()
    assert sorted(versions) == list(range(1, LATEST_VERSION + 1))


def test_query_indexes_exist(journal: Journal) -> None:
    engine = make_engine(journal.url)
    from sqlalchemy import inspect

    names = {ix["name"] for ix in inspect(engine).get_indexes("events")}
    engine.dispose()
    assert {
        "ix_events_project_kind_time",
        "ix_events_actor_time",
        "ix_events_artifact",
        "ix_events_stream_seq",
    } <= names


def test_an_unreachable_database_raises_unavailable_not_empty(
    keys: dict[str, AgentKey], project: str, tmp_path: Path
) -> None:
    store = Journal("postgresql+psycopg://postgres@127.0.0.1:1/nothing?connect_timeout=2")
    with pytest.raises(Unavailable, match="journal"):
        store.write(deliveries(keys["alice"], project, 1))
    with pytest.raises(Unavailable, match="journal"):
        store.query(EventQuery(project=project))


def test_an_unsupported_database_is_a_config_error_listing_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="sqlite, postgresql"):
        Journal("mysql://root@127.0.0.1/test")


async def test_a_node_journals_published_events_on_this_backend(
    nats_server: NatsServer, home: Path, project: str, journal_url: str
) -> None:
    from bus.client.client import connect
    from bus.model.vocab import ReceiptLevel

    async with (
        Node(NodeConfig(home=home, nats_url=nats_server.url, journal_url=journal_url, mirror="off")),
        connect(nats_server.url, agent="alice", home=home) as client,
    ):
        events = [client.event("finding", finding(i), project=project) for i in range(50)]
        await client.publish_many(events, wait_for=ReceiptLevel.journaled, timeout_s=30)
    report = missing_and_extra({str(e.event_id) for e in events}, journal_event_ids(journal_url, project))
    assert report == {"missing": [], "extra": [], "doubled": []}
