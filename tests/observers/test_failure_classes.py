"""An outage and a bug take different paths. Only a component that did not answer is Unavailable (the runner
waits it out, spending no deliveries); a failure that would recur with the same request is ComponentFailed
(or InvalidEvent), which spends deliveries and ends in the dead-letter stream with its summary."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import nats.js.errors
import pytest
from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse
from sqlalchemy.exc import IntegrityError, InternalError, OperationalError, ProgrammingError

from bus.broker.loops import stop_all
from bus.broker.nats_errors import nats_call, translate_publish_error
from bus.client.client import connect
from bus.errors import ComponentFailed, Conflict, InvalidEvent, ModelMismatch, StoreDamaged, Unavailable
from bus.host.server import NatsServer
from bus.intake.reader import dead_letters
from bus.intake.runner import ConsumerRunner
from bus.model.ids import point_id
from bus.model.vocab import ReceiptLevel
from bus.subjects import DLQ_ERROR, DLQ_REASON
from observers.journal import Journal, JournalObserver
from observers.journal_engine import database_failure, database_said
from observers.mirror.backends import open_store
from observers.mirror.edge import EdgeVectorStore
from observers.mirror.embed import CachedEmbedder, FastEmbedder
from observers.mirror.observer import MirrorObserver
from observers.mirror.server import ServerVectorStore
from observers.mirror.store import Point
from tests.conftest import finding
from tests.support import eventually, headers_of


def api_error(code: int, err_code: int, description: str = "refused") -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=code, err_code=err_code, description=description)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (api_error(400, 10071, "wrong last sequence"), Conflict),
        (api_error(503, 10008), Unavailable),
        (api_error(408, 0), Unavailable),
        (api_error(400, 10054, "message size exceeds maximum allowed"), InvalidEvent),
        (nats.errors.TimeoutError(), Unavailable),
        (nats.errors.ConnectionClosedError(), Unavailable),
        (nats.errors.NoRespondersError(), Unavailable),
        (nats.errors.MaxPayloadError(), InvalidEvent),
        (RuntimeError("a bug"), ComponentFailed),
        (KeyError("x"), ComponentFailed),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_publish_errors_are_classed_by_what_the_caller_does_next(error: BaseException, expected: type) -> None:
    assert type(translate_publish_error(error, "epi.p.finding.a")) is expected


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.ConnectionClosedError(),
        nats.errors.NoServersError(),
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionReconnectingError(),
        nats.js.errors.ServiceUnavailableError(),
        api_error(500, 10077, "no leader"),
        TimeoutError(),
        ConnectionResetError(),
    ],
    ids=lambda v: type(v).__name__,
)
async def test_a_nats_call_that_gets_no_answer_is_unavailable_naming_what_was_asked(error: BaseException) -> None:
    with pytest.raises(Unavailable, match=r"^nats unavailable: agent key registry: ") as raised:
        async with nats_call("agent key registry"):
            raise error
    assert raised.value.__cause__ is error


async def test_a_nats_call_past_its_deadline_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="stream figures: TimeoutError"):
        async with nats_call("stream figures", timeout_s=0.01):
            await asyncio.sleep(5)


@pytest.mark.parametrize(
    "error",
    [Conflict("subject", "wrong last sequence"), ValueError("a bug"), KeyError("k")],
    ids=lambda v: type(v).__name__,
)
async def test_a_nats_call_lets_what_is_not_an_outage_through_unchanged(error: BaseException) -> None:
    with pytest.raises(type(error)) as raised:
        async with nats_call("anything"):
            raise error
    assert raised.value is error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OperationalError("SELECT 1", {}, Exception("could not connect to server")), Unavailable),
        (OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked")), Unavailable),
        (OperationalError("SELECT 1", {}, sqlite3.OperationalError("disk I/O error")), Unavailable),
        (OperationalError("SELECT x", {}, sqlite3.OperationalError("no such table: events")), ComponentFailed),
        (OperationalError("SELEC", {}, sqlite3.OperationalError('near "SELEC": syntax error')), ComponentFailed),
        (ProgrammingError("SELECT nope", {}, Exception("no such column")), ComponentFailed),
        (InternalError("INSERT", {}, Exception("internal")), ComponentFailed),
        (IntegrityError("INSERT", {}, Exception("check failed")), ComponentFailed),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_journal_errors_are_outages_only_when_the_database_did_not_answer(error: Any, expected: type) -> None:
    assert type(database_failure(error, "write failed")) is expected


def test_a_journal_error_says_what_the_database_said_and_never_the_statement() -> None:
    error = OperationalError("SELECT secret FROM t WHERE a = ?", ("a value",), sqlite3.OperationalError("locked"))
    said = database_said(error)
    assert said == "OperationalError: locked"


def test_a_real_sqlite_file_that_is_not_a_database_is_damage_named_with_its_rebuild(tmp_path: Path) -> None:
    """Not the events' fault, so never dead-lettered: StoreDamaged is an outage the observers wait out, and its
    one line says which file and how to rebuild it."""
    (tmp_path / "journal.db").write_bytes(b"this is not a database file, and waiting will not make it one" * 100)
    journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
    try:
        with pytest.raises(StoreDamaged, match=r"journal damaged: .*journal\.db: file is not a database; rebuild"):
            journal.migrate()
    finally:
        journal.close()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (UnexpectedResponse(400, "Bad Request", b'{"status":{"error":"bad"}}', httpx.Headers()), ComponentFailed),
        (UnexpectedResponse(404, "Not Found", b"{}", httpx.Headers()), ComponentFailed),
        (UnexpectedResponse(503, "Service Unavailable", b"{}", httpx.Headers()), Unavailable),
        (UnexpectedResponse(429, "Too Many Requests", b"{}", httpx.Headers()), Unavailable),
        (ResponseHandlingException(httpx.ConnectError("refused")), Unavailable),
        (ResponseHandlingException(ValueError("a 200 reply that does not parse as the model")), ComponentFailed),
        (httpx.ReadTimeout("slow"), Unavailable),
        (ValueError("a bug in a local-mode call"), ComponentFailed),
        (ValueError("shapes (3,) and (4,) not aligned"), ModelMismatch),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.__name__,
)
def test_qdrant_client_errors_are_outages_only_when_the_server_did_not_answer(error: Exception, expected: type) -> None:
    store = ServerVectorStore("http://127.0.0.1:1", "m", 4)
    assert type(store._translate(error)) is expected


async def test_a_qdrant_server_that_is_not_there_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens on it
    with pytest.raises(Unavailable, match="qdrant unavailable"):
        await ServerVectorStore.open(f"http://127.0.0.1:{port}", "m", 4)


async def test_the_edge_engine_refusing_a_call_is_a_failure_and_its_files_failing_an_outage(tmp_path: Path) -> None:
    store = await EdgeVectorStore.open(tmp_path / "edge", "m", 4)  # as its engine process runs it
    try:
        with pytest.raises(ComponentFailed, match="TypeError"):
            store._engine(store.shards.hot.engine.retrieve, "not a list of ids", None, None)  # the engine's own refusal

        def disk_full() -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(Unavailable, match="No space left"):
            store._engine(disk_full)
    finally:
        await store.close()


class RefusingStore:
    """A real edge store that refuses to take one point, as a Qdrant server answers 400 to a bad request;
    the store is not what is under test, the runner's answer to the refusal is."""

    def __init__(self, inner: Any, refused: set[Any]) -> None:
        self.inner = inner
        self.refused = refused

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def upsert(self, points: Sequence[Point]) -> None:
        if any(p.id in self.refused for p in points):
            raise ComponentFailed("qdrant", "HTTP 400: Bad Request: payload refused")
        await self.inner.upsert(points)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FastEmbedder:
    return FastEmbedder(tmp_path_factory.mktemp("models")).load_blocking()


async def test_a_store_that_refuses_one_event_dead_letters_it_and_indexes_the_rest(
    nats_server: NatsServer, model: FastEmbedder, tmp_path: Path, project: str
) -> None:
    """It once retried such a refusal forever as an outage: the mirror stayed degraded for good."""
    async with connect(nats_server.url, agent="alice", home=tmp_path / "alice", outbox=False) as alice:
        events = [alice.event("finding", finding(i), project=project) for i in range(12)]
        poison = events[5]
        inner = await open_store("edge", tmp_path / "mirror", model.model_id, model.dimension)
        embedder = CachedEmbedder(model, tmp_path / "cache.db")
        journal = Journal(f"sqlite:///{tmp_path / 'journal.db'}")
        journal.migrate()
        mirror = MirrorObserver(
            RefusingStore(inner, {point_id(poison.event_id)}), embedder, name="mirror-refusing", journal=journal
        )
        nc = await nats.connect(nats_server.url)
        options: dict[str, Any] = {"fetch_timeout_s": 0.2, "max_deliver": 2, "redelivery_delays_s": (0.1,)}
        runner = ConsumerRunner(nc, mirror, batch_size=16, **options)
        journaling = ConsumerRunner(nc, JournalObserver(journal), **options)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(journaling.run()), group.create_task(runner.run())]
                await alice.publish_many(events, wait_for=ReceiptLevel.published)
                await eventually(lambda: runner.stats.dead_lettered.get("max_deliver") == 1, timeout_s=30)
                await eventually(lambda: runner.stats.handled == 11, timeout_s=30)
                await stop_all(tasks)
            assert runner.stats.degraded is False
            assert runner.stats.outage_retries == 0
            kept = sorted(point_id(e.event_id) for e in events if e is not poison)
            assert sorted(await inner.point_ids()) == kept
            (letter,) = [m for m in await dead_letters(alice.js) if headers_of(m)[DLQ_REASON] == "max_deliver"]
            assert "ComponentFailed" in headers_of(letter)[DLQ_ERROR]
            assert "HTTP 400" in headers_of(letter)[DLQ_ERROR]
        finally:
            await nc.close()
            embedder.close()
            await inner.close()
            journal.close()
