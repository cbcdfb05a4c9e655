"""The journal's tables and their versioned migrations. A database records its version in `epibus_schema`;
`migrate()` applies what is missing, in order, and is safe to run from several processes at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError

metadata = MetaData()

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
    # The indexes the journal's reads use: by project (and kind) over time, by actor, by artifact, by seq.
    Index("ix_events_project_kind_time", "project", "kind", "recorded_at"),
    Index("ix_events_project_time", "project", "recorded_at"),
    Index("ix_events_actor_time", "actor_id", "recorded_at"),
    Index("ix_events_artifact", "project", "artifact_id"),
    Index("ix_events_stream_seq", "stream_seq"),
)


def _v1_events(conn: Connection) -> None:
    metadata.create_all(conn, tables=[events])


# (version, description, step). Append only: a shipped step is never edited.
MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "events table with its query indexes", _v1_events),
]
LATEST_VERSION = MIGRATIONS[-1][0]


MIGRATION_LOCK_ID = 7_031_815  # pg advisory lock: one migrator at a time per database


def current_version(engine: Engine) -> int:
    with engine.connect() as conn:
        if not inspect(conn).has_table(schema_versions.name):
            return 0
        found = conn.execute(select(schema_versions.c.version)).scalars().all()
    return max(found, default=0)


def _migrate_once(engine: Engine) -> int:
    with engine.begin() as conn:  # one transaction: a failed step leaves no half-applied version
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})"))
        metadata.create_all(conn, tables=[schema_versions])
        done = set(conn.execute(select(schema_versions.c.version)).scalars())
        for version, description, step in MIGRATIONS:
            if version in done:
                continue
            step(conn)
            conn.execute(
                schema_versions.insert().values(version=version, description=description, applied_at=datetime.now(UTC))
            )
    return LATEST_VERSION


def migrate(engine: Engine, attempts: int = 5) -> int:
    """Bring the database to LATEST_VERSION; returns it. Safe to run from several processes at once:
    PostgreSQL serialises migrators with an advisory lock; on SQLite a migrator that loses the race to
    create a table retries and finds the work done."""
    for attempt in range(1, attempts + 1):
        try:
            return _migrate_once(engine)
        except (OperationalError, IntegrityError) as e:
            if attempt == attempts or not _lost_a_race(e):
                raise
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def _lost_a_race(error: Exception) -> bool:
    message = str(error).lower()
    return any(sign in message for sign in ("already exists", "unique constraint", "database is locked", "duplicate"))
