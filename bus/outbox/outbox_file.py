"""The outbox's SQLite file: its schema and migrations, durability (`synchronous=FULL`, so an `outboxed`
receipt survives power loss), group commit of concurrent adds, erasure of a forgotten artifact's rows, and the
one thread all of its SQLite work runs on. What the rows mean to a forwarder is `bus.outbox.outbox`'s."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bus.errors import DiskFull, Unavailable
from bus.host.disk import require_room
from bus.host.home import private_sqlite
from bus.identity.signing import PreparedEvent, event_headers, wire_message
from bus.model.event import Envelope
from bus.outbox.outbox_schema import TABLE
from bus.subjects import EVENT_KEY_HEADER, EVENT_SIGNATURE_HEADER, MSG_ID_HEADER, parse_event_subject

T = TypeVar("T")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    subject TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_at REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    sent_at REAL,
    stream_seq INTEGER,
    duplicate INTEGER,
    origin TEXT,
    signature TEXT,
    signer_key TEXT
)
"""
# Columns later versions added, with their types: an outbox file from before them gains them on open. A row
# without a signature holds a legacy event (signature inside its payload) and is sent without the headers.
_ADDED_COLUMNS = (("origin", "TEXT"), ("signature", "TEXT"), ("signer_key", "TEXT"))


@dataclass(frozen=True)
class OutboxRow:
    """An event to send: its body bytes and, for schema_version 2, the signature and key for its headers."""

    event_id: str
    subject: str
    payload: bytes
    signature: str | None = None
    signer_key: str | None = None

    @classmethod
    def of(cls, event: Envelope) -> OutboxRow:
        """The row of a signed event: the bytes it was signed over, the signature headers' values."""
        message = wire_message(event)
        return cls(
            str(event.event_id),
            message.subject,
            message.data,
            message.headers.get(EVENT_SIGNATURE_HEADER),
            message.headers.get(EVENT_KEY_HEADER),
        )

    @classmethod
    def prepared(cls, prepared: PreparedEvent, signature: str, signer_key: str) -> OutboxRow:
        """The row of a prepared event signed in bulk: what `of` gives for the event sealed with `signature`."""
        return cls(str(prepared.event.event_id), prepared.subject, prepared.data, signature, signer_key)

    def headers(self) -> dict[str, str]:
        """A fresh dict per publish (nats-py writes into it): the event id for JetStream's deduplication, and
        the signature headers when the event has them."""
        if self.signature is not None and self.signer_key is not None:
            return {MSG_ID_HEADER: self.event_id, **event_headers(self.signature, self.signer_key)}
        return {MSG_ID_HEADER: self.event_id}


class OutboxFile:
    """One outbox file, opened with `await OutboxFile(path).open()`. Methods are coroutines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-outbox")
        self._conn: sqlite3.Connection | None = None
        self._commit_lock = asyncio.Lock()
        self._pending: list[tuple[OutboxRow, str]] = []
        self._pending_done: asyncio.Future[None] | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the file's thread (give it `conn`, which lives there)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self) -> None:
        """Raises Unavailable("outbox", …) when the file cannot be opened or created."""
        try:
            await self.run(self._open)
        except (sqlite3.Error, OSError) as e:
            raise Unavailable("outbox", f"cannot open {self.path}: {e}; check the path and its permissions") from e

    def _open(self) -> None:
        private_sqlite(self.path)
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # synchronous=FULL: WAL+NORMAL can drop the last commits on power loss, and an outboxed receipt promises
        # the event survives it
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA secure_delete=ON")  # a deleted row's bytes are zeroed, not left in free space (forget)
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute(_SCHEMA)
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({TABLE})")}
        for column, kind in _ADDED_COLUMNS:
            if column not in present:
                conn.execute(f"ALTER TABLE {TABLE} ADD COLUMN {column} {kind}")
        self._conn = conn

    async def close(self) -> None:
        if self._conn is not None:
            await self.run(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=True)

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("outbox is not open; use `await Outbox(path).open()`")
        return self._conn

    async def add(self, rows: Sequence[OutboxRow], origin: str) -> None:
        """Make rows durable, added by `origin`. Adding an event id already present is a no-op. Returns after
        the fsync; concurrent calls share one commit."""
        if self._pending_done is None:
            self._pending_done = asyncio.get_running_loop().create_future()
        self._pending.extend((row, origin) for row in rows)
        done = self._pending_done
        async with self._commit_lock:
            if not done.done():
                # This call commits everything queued so far, its own rows and those of waiting callers.
                batch, self._pending, self._pending_done = self._pending, [], None
                try:
                    require_room(self.path, "outbox")
                    await self.run(self._insert, batch)
                except DiskFull as e:
                    done.set_exception(e)
                except (sqlite3.Error, OSError) as e:
                    done.set_exception(Unavailable("outbox", f"cannot write to {self.path}: {e}"))
                else:
                    done.set_result(None)
        await done

    def _insert(self, rows: list[tuple[OutboxRow, str]]) -> None:
        now = time.time()
        with self.conn:  # one transaction, one fsync
            self.conn.execute("BEGIN IMMEDIATE")
            # A pending or parked event stays as it is; one already sent is sent again (JetStream says duplicate),
            # with the bytes given now: a sent row keeps none.
            self.conn.executemany(
                f"INSERT INTO {TABLE} (event_id, subject, payload, signature, signer_key, created_at, origin)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(event_id) DO UPDATE SET sent_at = NULL, stream_seq = NULL, duplicate = NULL,"
                " lease_owner = NULL, lease_until = 0, subject = excluded.subject, payload = excluded.payload,"
                " signature = excluded.signature, signer_key = excluded.signer_key WHERE sent_at IS NOT NULL",
                [(r.event_id, r.subject, r.payload, r.signature, r.signer_key, now, origin) for r, origin in rows],
            )

    async def forget(self, project: str, artifact_id: str) -> int:
        """Delete every row of an artifact's events (sent or not: a forgotten artifact's events are not sent
        any more), except the `forgotten` event itself, then reset the WAL so no frame keeps their payload.
        Returns the rows deleted. Idempotent. Raises Unavailable."""
        try:
            return await self.run(self._forget, project, artifact_id)
        except sqlite3.Error as e:
            raise Unavailable("outbox", f"cannot delete forgotten rows from {self.path}: {e}") from e

    def _forget(self, project: str, artifact_id: str) -> int:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            doomed = []
            for seq, subject in self.conn.execute(f"SELECT seq, subject FROM {TABLE}"):
                address = parse_event_subject(subject)
                if address is None or address.kind == "forgotten":
                    continue
                if address.project == project and address.artifact_id == artifact_id:
                    doomed.append((seq,))
            self.conn.executemany(f"DELETE FROM {TABLE} WHERE seq = ?", doomed)
        checkpoint_wal(self.conn)
        return len(doomed)


def checkpoint_wal(conn: sqlite3.Connection) -> bool:
    """Copy a WAL-mode database's log into the file and truncate it to zero bytes, so frames holding deleted
    content are gone. False when another connection's open read kept part of the log (try again later)."""
    busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return int(busy) == 0
