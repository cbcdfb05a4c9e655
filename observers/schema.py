"""The journal's tables and their versioned migrations. A database records its version in `epibus_schema`;
`migrate()` applies what is missing, in order, and is safe to run from several processes at once."""

from __future__ import annotations

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
    select,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

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


def current_version(engine: Engine) -> int:
    with engine.connect() as conn:
        metadata.create_all(conn, tables=[schema_versions])
        conn.commit()
        found = conn.execute(select(schema_versions.c.version)).scalars().all()
    return max(found, default=0)


def migrate(engine: Engine) -> int:
    """Bring the database to LATEST_VERSION; returns the version it is at."""
    version = current_version(engine)
    for step_version, description, step in MIGRATIONS:
        if step_version <= version:
            continue
        try:
            with engine.begin() as conn:
                step(conn)
                conn.execute(
                    schema_versions.insert().values(
                        version=step_version, description=description, applied_at=datetime.now(UTC)
                    )
                )
        except IntegrityError:
            # Another process applied this step between our read and our write; it is there either way.
            if current_version(engine) < step_version:
                raise
        version = step_version
    return version
