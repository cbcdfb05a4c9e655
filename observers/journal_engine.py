"""How the journal reaches its database: the engine for a URL (SQLite pragmas, PostgreSQL's driver) and the one
choke point from database errors to epibus errors (an outage, a failure, or a damaged file)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy.exc
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)

from bus.errors import ComponentFailed, ConfigError, StoreDamaged, Unavailable
from bus.host.home import private_sqlite

DIALECTS = ("sqlite", "postgresql")


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite journal URL; None for another database or an in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def make_engine(url: str) -> Engine:
    """An engine for a journal URL. Raises ConfigError for a malformed URL or an unsupported database."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise ConfigError(
            "journal", f"{url!r} is not a database URL; use sqlite:///PATH or postgresql://USER@HOST/DB"
        ) from e
    if parsed.get_backend_name() not in DIALECTS:
        raise ConfigError("journal", f"{parsed.get_backend_name()!r} is not supported", allowed=DIALECTS)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            private_sqlite(Path(parsed.database))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            # FULL: the runner acks after this commit, so the commit must survive power loss
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA secure_delete=ON")  # a forgotten row's bytes are zeroed, not left in free space
            cursor.close()

        return engine
    if parsed.drivername == "postgresql":
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, pool_pre_ping=True)


# Database errors that mean it did not answer (down, locked, connection lost): wait and retry. Any other
# (a statement it refuses, a bug) would fail again the same way.
DATABASE_OUTAGES = (OperationalError, InterfaceError, DisconnectionError, sqlalchemy.exc.TimeoutError)


# SQLite raises OperationalError for a missing table or a syntax error too; only these mean "not now".
SQLITE_OUTAGE = re.compile(r"locked|busy|disk i/o error|unable to open|disk is full|readonly|no space", re.I)


# SQLite's words for a file whose pages are not what it wrote: the journal must be rebuilt from the stream.
SQLITE_DAMAGE = re.compile(r"malformed|file is not a database|database corruption|disk image", re.I)
JOURNAL_REMEDY = "rebuild it from the stream with `epibus replay --rebuild` (the damaged file is kept aside)"


def journal_damage(error: BaseException, path: Path | None) -> StoreDamaged | None:
    """StoreDamaged when a SQLite journal's error says its file is damaged; None for any other error."""
    orig = error.orig if isinstance(error, DBAPIError) else error
    if path is None or not isinstance(orig, sqlite3.DatabaseError) or not SQLITE_DAMAGE.search(str(orig)):
        return None
    return StoreDamaged("journal", str(path), str(orig), JOURNAL_REMEDY)


def database_said(error: SQLAlchemyError) -> str:
    """What the database said, without SQLAlchemy's statement and parameters: an error names the failure,
    it does not print the query (nor the values of a row)."""
    if isinstance(error, DBAPIError) and error.orig is not None:
        return f"{type(error.orig).__name__}: {error.orig}"
    return f"{type(error).__name__}: {str(error).split(chr(10))[0]}"


def database_failure(error: SQLAlchemyError, message: str) -> Unavailable | ComponentFailed:
    """The one choke point from SQLAlchemy errors to epibus errors."""
    if isinstance(error, DBAPIError) and isinstance(error.orig, sqlite3.OperationalError):
        outage = bool(SQLITE_OUTAGE.search(str(error.orig)))
    else:
        outage = isinstance(error, DATABASE_OUTAGES) or (isinstance(error, DBAPIError) and error.connection_invalidated)
    return Unavailable("journal", message) if outage else ComponentFailed("journal", message)
