"""The journal's tables and their versioned migrations. A database records its version in `epibus_schema`;
`migrate()` applies what is missing, in order, and is safe to run from several processes at once. The state
projection is built on these tables, so a step that must project the events again says so and `migrate()` runs
the projection's rebuild it is handed: this module never imports the projection."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    false,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.sql.elements import ColumnElement

from bus.model.event import event_digest, validate_event

metadata = MetaData()


def as_utc(value: datetime) -> datetime:
    """A datetime read back from the journal, in UTC: SQLite hands datetimes back naive, and everything the
    journal stores is UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


schema_versions = Table(
    "epibus_schema",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("description", String(200), nullable=False),
    Column("applied_at", DateTime(timezone=True), nullable=False),
)

events = Table(
    "events",
    metadata,
    Column("event_id", String(36), primary_key=True),
    Column("stream_seq", BigInteger, nullable=False),
    Column("subject", String(300), nullable=False),
    Column("project", String(63), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("artifact_id", String(128), nullable=False),
    Column("actor_id", String(64), nullable=False),
    Column("actor_key", String(56), nullable=False),
    Column("session_id", String(128), nullable=False),
    Column("goal_id", String(128), nullable=True),
    Column("source", String(16), nullable=True),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False),
    Column("signature_status", String(16), nullable=False),
    Column("envelope", Text, nullable=False),
    # v2: what the state projection made of the event (applied | rejected), why, and its flags.
    Column("status", String(16), nullable=False, server_default="applied"),
    Column("reason", Text, nullable=True),
    Column("flags", String(200), nullable=True),
    Column("stream_time", DateTime(timezone=True), nullable=True),  # v2: JetStream's clock; as-of reads cut on it
    # v3: sha256 of the whole signed event; kept when a forget redacts the row, so a later event reusing the id
    # with other content is still recognised as a conflict.
    Column("digest", String(64), nullable=True),
    # The indexes the journal's reads use: by project (and kind) over time, by actor, by artifact, by seq.
    Index("ix_events_project_kind_time", "project", "kind", "recorded_at"),
    Index("ix_events_project_time", "project", "recorded_at"),
    Index("ix_events_actor_time", "actor_id", "recorded_at"),
    Index("ix_events_artifact", "project", "artifact_id"),
    Index("ix_events_stream_seq", "stream_seq"),
)


def stored_at() -> ColumnElement[datetime]:
    """An event's place in time: when the stream had it (JetStream's clock, which no publisher sets). Every
    journal read that asks "when" cuts on it: as-of reads and events --since/--until. The publisher's
    recorded_at is its claim, admitted within bus.intake.admission.TimeBounds of this. Rows journaled before the
    stream's time was kept fall back to their recorded_at."""
    return func.coalesce(events.c.stream_time, events.c.recorded_at)


artifacts = Table(
    "artifacts",
    metadata,
    Column("project", String(63), primary_key=True),
    Column("artifact_id", String(128), primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("author", String(64), nullable=False),
    Column("created_event_id", String(36), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("content", Text, nullable=False),
    Column("content_hash", String(64), nullable=False),
    Column("impact", Float, nullable=True),
    Column("confidence", Float, nullable=True),
    Column("source", String(16), nullable=True),
    Column("goal_id", String(128), nullable=True),
    Column("revises", String(128), nullable=True),
    Column("supersedes", String(128), nullable=True),
    Column("superseded_by", String(128), nullable=True),
    Column("contradicted_by", String(128), nullable=True),
    Column("trust", String(16), nullable=False),
    Column("lifecycle", String(16), nullable=False),
    Column("resolution", String(16), nullable=True),
    Column("forgotten", Boolean, nullable=False),
    Column("flags", String(200), nullable=True),
    Column("last_seq", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=True),
    # v5: who vouched (JSON lists of identity names) and when a person last reviewed
    Column("verified_by", Text, nullable=True),
    Column("reviewed_by", Text, nullable=True),
    Column("reviewed_at", DateTime(timezone=True), nullable=True),
    Index("ix_artifacts_state", "project", "trust", "lifecycle"),
    Index("ix_artifacts_kind", "project", "kind"),
    Index("ix_artifacts_revises", "project", "revises"),
)

verifications = Table(
    "verifications",  # append-only: every verification, including re-verifications
    metadata,
    Column("event_id", String(36), primary_key=True),
    Column("project", String(63), nullable=False),
    Column("artifact_id", String(128), nullable=False),
    Column("verifier", String(64), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("stream_seq", BigInteger, nullable=False),
    Column("note", Text, nullable=True),
    # v4: the verifier held the reviewer role (a person's review)
    Column("human_review", Boolean, nullable=False, server_default=false()),
    Index("ix_verifications_artifact", "project", "artifact_id"),
)

enrolment_log = Table(
    "enrolment_log",  # v4: the stream's enrolment records the projection decided with (an input, never rebuilt)
    metadata,
    Column("stream_seq", BigInteger, primary_key=True),
    Column("agent_id", String(64), nullable=False),
    Column("enrolment", Text, nullable=False),
)

review_policies = Table(
    "review_policies",  # v5: projects' review policies as the stream recorded them (an input, never rebuilt)
    metadata,
    Column("stream_seq", BigInteger, primary_key=True),
    Column("project", String(63), nullable=False),
    Column("policy", Text, nullable=False),
)

tombstones = Table(
    "tombstones",
    metadata,
    Column("project", String(63), primary_key=True),
    Column("content_hash", String(64), primary_key=True),
    Column("artifact_id", String(128), nullable=False),
    Column("event_id", String(36), nullable=False),
    Column("reason", String(16), nullable=False),
)

journal_identity = Table(
    "journal_identity",  # one row: this journal's id, which names its durable consumer
    metadata,
    Column("id", String(36), primary_key=True),
)

projection_cursor = Table(
    "projection_cursor",  # the highest stream sequence the projection has applied
    metadata,
    Column("name", String(32), primary_key=True),
    Column("last_seq", BigInteger, nullable=False),
)


def _v1_events(conn: Connection) -> None:
    metadata.create_all(conn, tables=[events])


def _v2_state_projection(conn: Connection) -> None:
    present = {c["name"] for c in inspect(conn).get_columns("events")}
    for name, ddl in (
        ("status", "VARCHAR(16) NOT NULL DEFAULT 'applied'"),
        ("reason", "TEXT"),
        ("flags", "VARCHAR(200)"),
        ("stream_time", "TIMESTAMP WITH TIME ZONE" if conn.dialect.name == "postgresql" else "DATETIME"),
    ):
        if name not in present:  # a v1 database; a new one got these columns from the table definition
            conn.execute(text(f"ALTER TABLE events ADD COLUMN {name} {ddl}"))
    metadata.create_all(conn, tables=[artifacts, verifications, tombstones, projection_cursor, journal_identity])
    if conn.execute(select(journal_identity.c.id)).first() is None:
        conn.execute(journal_identity.insert().values(id=str(uuid.uuid4())))
    # A v1 journal already holds events: the step is marked to project them, or every old artifact would be
    # invisible.


def _v3_event_digests(conn: Connection) -> None:
    if "digest" not in {c["name"] for c in inspect(conn).get_columns("events")}:
        conn.execute(text("ALTER TABLE events ADD COLUMN digest VARCHAR(64)"))
    rows = conn.execute(select(events.c.event_id, events.c.envelope).where(events.c.status != "forgotten")).all()
    for row in rows:  # redacted rows have nothing left to digest; they stay NULL
        digest = event_digest(validate_event(json.loads(row.envelope)))
        conn.execute(events.update().where(events.c.event_id == row.event_id).values(digest=digest))


def _v4_authority(conn: Connection) -> None:
    if "human_review" not in {c["name"] for c in inspect(conn).get_columns("verifications")}:
        default = "FALSE" if conn.dialect.name == "postgresql" else "0"
        conn.execute(text(f"ALTER TABLE verifications ADD COLUMN human_review BOOLEAN NOT NULL DEFAULT {default}"))
    metadata.create_all(conn, tables=[enrolment_log])
    # Events are now decided with the authority policy too: the step is marked to decide them again, as a new
    # journal would.


def _v5_vouched(conn: Connection) -> None:
    present = {c["name"] for c in inspect(conn).get_columns("artifacts")}
    timestamp = "TIMESTAMP WITH TIME ZONE" if conn.dialect.name == "postgresql" else "DATETIME"
    for name, sql_type in (("verified_by", "TEXT"), ("reviewed_by", "TEXT"), ("reviewed_at", timestamp)):
        if name not in present:
            conn.execute(text(f"ALTER TABLE artifacts ADD COLUMN {name} {sql_type}"))
    metadata.create_all(conn, tables=[review_policies])
    # The projection is decided again to fill them from the verifications the stream holds.


# Recomputes the state projection from the events table, inside the migration's transaction.
Rebuild = Callable[[Connection], object]

# (version, description, step, then rebuild the projection in the same transaction). Append only: a shipped
# step is never edited.
MIGRATIONS: list[tuple[int, str, Callable[[Connection], None], bool]] = [
    (1, "events table with its query indexes", _v1_events, False),
    (2, "state projection: artifacts, verifications, tombstones, event status", _v2_state_projection, True),
    (3, "events.digest: the first event under an id is the only one kept", _v3_event_digests, False),
    (4, "authority: enrolment_log, verifications.human_review; projection decided again", _v4_authority, True),
    (5, "who vouched (agents, people, last review); review_policies; projection decided again", _v5_vouched, True),
]
LATEST_VERSION = MIGRATIONS[-1][0]


MIGRATION_LOCK_ID = 7_031_815  # pg advisory lock: one migrator at a time per database


def current_version(engine: Engine) -> int:
    with engine.connect() as conn:
        if not inspect(conn).has_table(schema_versions.name):
            return 0
        found = conn.execute(select(schema_versions.c.version)).scalars().all()
    return max(found, default=0)


def _migrate_once(engine: Engine, rebuild: Rebuild) -> int:
    with engine.begin() as conn:  # one transaction: a failed step leaves no half-applied version
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})"))
        metadata.create_all(conn, tables=[schema_versions])
        done = set(conn.execute(select(schema_versions.c.version)).scalars())
        for version, description, step, reproject in MIGRATIONS:
            if version in done:
                continue
            step(conn)
            if reproject:
                rebuild(conn)
            conn.execute(
                schema_versions.insert().values(version=version, description=description, applied_at=datetime.now(UTC))
            )
    return LATEST_VERSION


def migrate(engine: Engine, rebuild: Rebuild, attempts: int = 5) -> int:
    """Bring the database to LATEST_VERSION; returns it. `rebuild` recomputes the state projection after the
    steps that need it (the journal passes `observers.projection.rebuild`). Safe to run from several processes
    at once: PostgreSQL serialises migrators with an advisory lock; on SQLite a migrator that loses the race to
    create a table retries and finds the work done."""
    for attempt in range(1, attempts + 1):
        try:
            return _migrate_once(engine, rebuild)
        except (OperationalError, IntegrityError) as e:
            if attempt == attempts or not _lost_a_race(e):
                raise
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def _lost_a_race(error: Exception) -> bool:
    message = str(error).lower()
    return any(sign in message for sign in ("already exists", "unique constraint", "database is locked", "duplicate"))
