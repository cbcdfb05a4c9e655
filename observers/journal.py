"""The SQL journal: an append-only `events` table keyed by event_id (SQLite by default, PostgreSQL by URL),
written with ON CONFLICT DO NOTHING so a redelivered or replayed event lands once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from sqlalchemy import func, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import (
    DataError,
    IntegrityError,
    SQLAlchemyError,
)

from bus.enrolment.service_rules import Authorizer
from bus.errors import ConfigError, InvalidEvent, StoreDamaged, Unavailable
from bus.host.disk import require_room
from bus.host.home import fsync_directory
from bus.intake.admission import Delivery, Refusal, first_of_each_id
from bus.intake.batch_context import batch_erased
from bus.model.erasure import erased_digests
from bus.model.event import Envelope, validate_event
from bus.model.requests import LookupOutcome, LookupReply, LookupRequest
from bus.model.tombstones import Tombstone
from bus.services.responder import Responder, serve
from bus.services.tombstone_registry import TombstoneRegistry
from bus.subjects import JOURNAL_LOOKUP
from observers.journal_engine import (
    JOURNAL_REMEDY,
    database_failure,
    database_said,
    journal_damage,
    make_engine,
    sqlite_file,
)
from observers.projection import project_deliveries, rebuild
from observers.schema import artifacts, as_utc, events, journal_identity, migrate, stored_at, tombstones

log = logging.getLogger(__name__)
PROJECTION_LOCK_ID = 7_031_816
SCRUBBED_TABLES = ("events", "artifacts", "verifications")  # the tables that held a forgotten artifact's content


@dataclass(frozen=True)
class Written:
    inserted: list[str]
    refused: list[Refusal]


def _row(d: Delivery, received_at: datetime) -> dict[str, Any]:
    return {
        "event_id": str(d.event.event_id),
        "stream_seq": d.stream_seq,
        "subject": d.subject,
        "project": d.event.project,
        "kind": d.event.kind,
        "artifact_id": d.event.artifact_id,
        "actor_id": d.event.actor.agent_id,
        "actor_key": d.event.actor.public_key,
        "session_id": d.event.session_id,
        "goal_id": d.event.goal_id,
        "source": d.event.source.value if d.event.source is not None else None,
        "recorded_at": d.event.recorded_at,
        "received_at": received_at,
        "stream_time": d.stream_time,
        "signature_status": "verified",  # admission dead-letters everything else
        "envelope": d.canonical.decode(),  # the bytes its digest covers: serialised once
        "digest": d.digest,
    }


@dataclass(frozen=True)
class KeptEvent:
    digest: str | None  # None: a row redacted before digests were kept
    stream_seq: int


def _kept(conn: Connection, event_ids: Sequence[str]) -> dict[str, KeptEvent]:
    found: dict[str, KeptEvent] = {}
    ids = list(event_ids)
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        rows = conn.execute(
            select(events.c.event_id, events.c.digest, events.c.stream_seq).where(events.c.event_id.in_(chunk))
        )
        found.update({row.event_id: KeptEvent(row.digest, row.stream_seq) for row in rows})
    return found


@dataclass(frozen=True)
class JournalRow:
    event_id: str
    stream_seq: int
    subject: str
    project: str
    kind: str
    artifact_id: str
    actor_id: str
    recorded_at: datetime
    received_at: datetime
    signature_status: str
    envelope: dict[str, Any]
    status: str = "applied"  # applied | rejected | forgotten (content erased, this row is its audit trail)
    stored_at: datetime | None = None  # when the stream had it (its place in time: bus.intake.admission.TimeBounds)

    def event(self) -> Envelope:
        return validate_event(self.envelope)

    def as_dict(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "stream_seq": self.stream_seq,
            "subject": self.subject,
            "project": self.project,
            "kind": self.kind,
            "artifact_id": self.artifact_id,
            "actor": self.actor_id,
            "recorded_at": self.recorded_at.isoformat(),
            "stored_at": self.stored_at.isoformat() if self.stored_at is not None else None,
            "received_at": self.received_at.isoformat(),
            "signature_status": self.signature_status,
            "status": self.status,
            "body": self.envelope.get("body"),
        }


@dataclass(frozen=True)
class EventQuery:
    project: str | None = None
    kind: str | None = None
    actor: str | None = None
    artifact_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 100
    newest_first: bool = True


class Journal:
    """Blocking journal access; async callers go through JournalObserver or asyncio.to_thread.
    Database errors surface as Unavailable("journal", …) when it did not answer, ComponentFailed otherwise:
    every method reaches the database through `_connect` (or `_translated`), the one place they are translated.
    Code outside this class reads through `reading`, never through the engine."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.dialect = self.engine.dialect.name
        self.file = sqlite_file(url)  # None for PostgreSQL and an in-memory SQLite

    @contextlib.contextmanager
    def _translated(self, doing: str, *, batch: bool = False) -> Iterator[None]:
        """The choke point: a SQLAlchemy error raised inside becomes Unavailable or ComponentFailed
        (`database_failure` decides which). With `batch`, a row the database refuses for what it holds
        (DataError, IntegrityError) is the event's fault: InvalidEvent, which the runner isolates."""
        try:
            yield
        except SQLAlchemyError as e:
            if (damage := journal_damage(e, self.file)) is not None:
                raise damage from e
            if batch and isinstance(e, (DataError, IntegrityError)):
                # The database refuses these rows, and would every time: not an outage to wait out. The runner
                # isolates the event that causes it and dead-letters it after its deliveries.
                raise InvalidEvent("event", f"{self.safe_url} refuses a row of this batch: {database_said(e)}") from e
            raise database_failure(e, f"{doing} on {self.safe_url} failed: {database_said(e)}") from e

    @contextlib.contextmanager
    def _connect(self, doing: str, *, transaction: bool = False, batch: bool = False) -> Iterator[Connection]:
        """A connection (in a transaction that commits on leaving, with `transaction`) whose errors, from
        connecting to committing, are translated by `_translated`."""
        with self._translated(doing, batch=batch):
            if transaction and self.file is not None:
                require_room(self.file, "journal")
            if transaction:
                with self.engine.begin() as conn:
                    yield conn
            else:
                with self.engine.connect() as conn:
                    yield conn

    @contextlib.contextmanager
    def reading(self, doing: str, *, one_snapshot: bool = False) -> Iterator[Connection]:
        """A connection for the reads this package makes of the journal's tables (reads, verify) and the
        node's dashboard: database errors leave it as Unavailable or ComponentFailed, like every method's.
        `doing` says what the read was for, in the error. `one_snapshot`: every statement on it sees the same
        committed state (a read of artifacts and then of their verifications never straddles a write)."""
        with self._connect(doing) as conn:
            if not one_snapshot:
                yield conn
                return
            if self.dialect == "sqlite":
                conn.exec_driver_sql("BEGIN")  # the driver begins no transaction for reads; one read transaction
            else:
                conn.execution_options(isolation_level="REPEATABLE READ")
            try:
                yield conn
            finally:
                conn.rollback()

    def identity(self) -> str:
        """This journal's id (made by the migration). Journals sharing one database share it, and so share
        one durable consumer; separate journals get separate consumers and each sees every event."""
        with self._connect("reading the journal identity") as conn:
            return str(conn.execute(select(journal_identity.c.id)).scalar_one())

    def check(self) -> None:
        """Raise StoreDamaged when SQLite's quick check finds the journal's pages damaged (a few seconds per GB,
        reading only). PostgreSQL checks its own pages: it only has to answer."""
        if self.file is None:
            with self._connect("checking the journal") as conn:
                conn.execute(select(1))
            return
        # Its own read-only connection: a pooled one may answer from pages it cached before the damage.
        try:
            with contextlib.closing(sqlite3.connect(f"file:{self.file}?mode=ro", uri=True, timeout=30)) as conn:
                found = [str(row[0]) for row in conn.execute("PRAGMA quick_check(5)")]
        except sqlite3.Error as e:
            if (damage := journal_damage(e, self.file)) is not None:
                raise damage from e
            raise Unavailable("journal", f"checking {self.safe_url} failed: {type(e).__name__}: {e}") from e
        if found != ["ok"]:
            raise StoreDamaged("journal", str(self.file), "; ".join(found)[:300], JOURNAL_REMEDY)

    def adopt_identity(self, identity: str) -> None:
        """Take another journal's id (a rebuilt file continues the durable consumer of the one it replaces)."""
        with self._connect("adopting a journal identity", transaction=True) as conn:
            conn.execute(journal_identity.update().values(id=identity))

    def replace_file(self, fresh: Path | None, aside: Path) -> None:
        """Swap a rebuilt SQLite file in for this journal's (which is kept as `aside`, with its WAL): the engine
        is made again on the same URL, so every holder of this Journal reads the new file from now on. `fresh`
        None: nothing takes its place (the next connection makes an empty file)."""
        if self.file is None:
            raise ConfigError("journal", f"{self.safe_url} is not a SQLite file; only a SQLite journal is swapped")
        self.engine.dispose()
        for suffix in ("", "-wal", "-shm"):
            current = Path(f"{self.file}{suffix}")
            if current.exists():
                os.replace(current, Path(f"{aside}{suffix}"))
            rebuilt = Path(f"{fresh}{suffix}")
            if fresh is not None and rebuilt.exists():
                os.replace(rebuilt, current)
        fsync_directory(self.file.parent)
        self.engine = make_engine(self.url)

    def migrate(self) -> int:
        with self._translated("migrating"):
            return migrate(self.engine, rebuild)

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def close(self) -> None:
        self.engine.dispose()

    def write(self, deliveries: Sequence[Delivery]) -> Written:
        """Insert in one transaction, the first event under each event id only. Returns the ids that were new
        and refusals for events that reuse a journaled id with other content (the runner dead-letters them)."""
        if not deliveries:
            return Written([], [])
        ids = sorted({str(d.event.event_id) for d in deliveries})
        # The events and what they did to the state commit together.
        with self._connect("writing", transaction=True, batch=True) as conn:
            if self.dialect == "postgresql":
                # Writers sharing a database take turns, or one could decide from states another has
                # not committed yet (SQLite serialises writers by itself at the first INSERT).
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PROJECTION_LOCK_ID})
            kept: dict[str, str | None] = {event_id: k.digest for event_id, k in _kept(conn, ids).items()}
            for event_id, digest in erased_digests(batch_erased(deliveries)).items():
                kept.setdefault(event_id, digest)  # erased from the stream by a forget: the id stays taken
            fresh, refused = first_of_each_id(deliveries, kept)
            if fresh:
                insert = (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(events)
                statement = insert.on_conflict_do_nothing(index_elements=["event_id"])
                conn.execute(statement, [_row(d, datetime.now(UTC)) for d in fresh])
                project_deliveries(conn, fresh)
        return Written([str(d.event.event_id) for d in fresh], refused)

    def kept_events(self, event_ids: Sequence[str]) -> dict[str, KeptEvent]:
        """Which event the journal keeps under each of these ids (absent: not journaled yet)."""
        with self._connect("reading event digests") as conn:
            return _kept(conn, event_ids)

    def rebuild_projection(self) -> int:
        """Recompute the state projection from the journal's events in stream order."""
        with self._connect("rebuilding the projection", transaction=True) as conn:
            return rebuild(conn)

    def tombstones_of(self, event_ids: Sequence[str]) -> list[tuple[str, Tombstone]]:
        """The tombstones (project, tombstone) that these events left, if any."""
        found: list[tuple[str, Tombstone]] = []
        ids = list(event_ids)
        with self._connect("reading tombstones") as conn:
            for start in range(0, len(ids), 500):
                rows = conn.execute(select(tombstones).where(tombstones.c.event_id.in_(ids[start : start + 500])))
                found += [(r.project, Tombstone(r.content_hash, r.artifact_id, r.event_id, r.reason)) for r in rows]
        return found

    def forgotten_check(self, project: str, artifact_id: str, event_ids: Sequence[str]) -> dict[str, int]:
        """Read back a forget: the artifact's event rows, how many still hold content, and whether the
        projection still has the artifact."""
        with self._connect("checking a forget") as conn:
            rows = conn.execute(
                select(events.c.status, events.c.envelope).where(events.c.event_id.in_(list(event_ids)))
            ).all()
            projection = conn.execute(
                select(func.count())
                .select_from(artifacts)
                .where(artifacts.c.project == project, artifacts.c.artifact_id == artifact_id)
            ).scalar_one()
        left = sum(1 for r in rows if r.status != "forgotten" or "body" in json.loads(r.envelope))
        return {"journal_rows": len(rows), "journal_content_left": left, "projection_rows": int(projection)}

    def scrub(self) -> bool:
        """After a forget: reset a SQLite journal's WAL (its frames hold the rows as they were before the
        redaction); vacuum a PostgreSQL journal's tables. True when the WAL was reset."""
        with self._translated("scrubbing after a forget"):
            if self.dialect == "sqlite":
                with self.engine.connect() as conn:
                    busy = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()[0]
                return int(busy) == 0
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                for table in SCRUBBED_TABLES:
                    conn.exec_driver_sql(f"VACUUM {table}")
            return False

    def has(self, event_ids: Sequence[str]) -> set[str]:
        return set(self.outcomes(event_ids))

    def outcomes(self, event_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """For each journaled event id: what the projection made of it (status, reason, flags)."""
        if not event_ids:
            return {}
        found: dict[str, dict[str, Any]] = {}
        ids = list(event_ids)
        with self._connect("reading outcomes") as conn:
            for start in range(0, len(ids), 500):
                rows = conn.execute(
                    select(events.c.event_id, events.c.status, events.c.reason, events.c.flags).where(
                        events.c.event_id.in_(ids[start : start + 500])
                    )
                )
                for row in rows:
                    flags = row.flags.split(",") if row.flags else []
                    found[row.event_id] = {"status": row.status, "reason": row.reason, "flags": flags}
        return found

    def projects(self) -> list[str]:
        """Every project with an event in this journal, in order (an index on project answers it)."""
        with self._connect("listing projects") as conn:
            return [row.project for row in conn.execute(select(events.c.project).distinct().order_by(events.c.project))]

    def query(self, q: EventQuery) -> list[JournalRow]:
        statement = select(events)
        for column, value in (
            (events.c.project, q.project),
            (events.c.kind, q.kind),
            (events.c.actor_id, q.actor),
            (events.c.artifact_id, q.artifact_id),
        ):
            if value is not None:
                statement = statement.where(column == value)
        if q.since is not None:  # when the stream had it: a backdated recorded_at hides nothing from --since
            statement = statement.where(stored_at() >= q.since)
        if q.until is not None:
            statement = statement.where(stored_at() < q.until)
        order = events.c.stream_seq.desc() if q.newest_first else events.c.stream_seq.asc()
        statement = statement.order_by(order).limit(q.limit)
        with self._connect("querying events") as conn:
            return [self._row(r._mapping) for r in conn.execute(statement)]

    def count(self, project: str | None = None) -> int:
        statement = select(func.count()).select_from(events)
        if project is not None:
            statement = statement.where(events.c.project == project)
        with self._connect("counting events") as conn:
            return int(conn.execute(statement).scalar_one())

    def event_ids(self, project: str | None = None) -> list[str]:
        """Every journaled event id (with repeats, if the store ever had any), in stream order."""
        statement = select(events.c.event_id).order_by(events.c.stream_seq)
        if project is not None:
            statement = statement.where(events.c.project == project)
        with self._connect("listing event ids") as conn:
            return list(conn.execute(statement).scalars())

    @staticmethod
    def _row(m: Any) -> JournalRow:
        return JournalRow(
            event_id=m["event_id"],
            stream_seq=m["stream_seq"],
            subject=m["subject"],
            project=m["project"],
            kind=m["kind"],
            artifact_id=m["artifact_id"],
            actor_id=m["actor_id"],
            recorded_at=as_utc(m["recorded_at"]),
            received_at=as_utc(m["received_at"]),
            signature_status=m["signature_status"],
            envelope=json.loads(m["envelope"]),
            status=m["status"],
            stored_at=as_utc(m["stream_time"] if m["stream_time"] is not None else m["recorded_at"]),
        )


class JournalObserver:
    """The runner's journal sink; also answers "which of these ids are journaled?" on JOURNAL_LOOKUP, and
    publishes the tombstones its projection records to the KV registry clients check before publishing."""

    def __init__(
        self, journal: Journal, *, name: str | None = None, tombstones: TombstoneRegistry | None = None
    ) -> None:
        self.journal = journal
        self.name = name or f"journal-{journal.identity()[:8]}"
        self.tombstones = tombstones
        self.inserted = 0
        self.already_present = 0
        self.tombstone_sync_failures = 0
        self._writing = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No batch is written while inside (a rebuild swaps the journal's file); batches wait, then go on."""
        async with self._writing:
            yield

    async def handle(self, batch: Sequence[Delivery]) -> list[Refusal]:
        async with self._writing:
            written = await asyncio.to_thread(self.journal.write, batch)
        self.inserted += len(written.inserted)
        self.already_present += len(batch) - len(written.inserted) - len(written.refused)
        if self.tombstones is not None:
            await self._sync_tombstones([str(d.event.event_id) for d in batch if d.event.body.transition])
        return written.refused

    async def _sync_tombstones(self, transition_ids: list[str]) -> None:
        """Idempotent: a redelivered batch puts the same keys again. The journal stays the authority (its
        projection flags repeats itself); a failed put is counted and logged, and the next one retries it."""
        if not transition_ids:
            return
        for project, tombstone in await asyncio.to_thread(self.journal.tombstones_of, transition_ids):
            assert self.tombstones is not None
            try:
                await self.tombstones.record(project, tombstone)
            except Unavailable as e:
                self.tombstone_sync_failures += 1
                log.error("tombstone %s not published to the KV registry: %s", tombstone.content_hash[:12], e)

    async def serve_lookups(
        self, nc: NatsClient, *, authorize: Authorizer[LookupRequest] | None = None
    ) -> Responder[LookupRequest, LookupReply]:
        """Answer JOURNAL_LOOKUP from now on: every request gets the outcomes of the ids it asks, or an error
        (`authorize`: who may ask, see bus/enrolment/service_rules.py)."""
        return await serve(
            nc, JOURNAL_LOOKUP, LookupRequest, LookupReply, self._lookup, node=self.name, authorize=authorize
        )

    async def _lookup(self, request: LookupRequest) -> LookupReply:
        found = await asyncio.to_thread(self.journal.outcomes, request.root)  # raises Unavailable, ComponentFailed
        outcomes = {event_id: LookupOutcome.model_validate(outcome) for event_id, outcome in found.items()}
        return LookupReply(node=self.name, journaled=sorted(found), outcomes=outcomes)
