"""The local outbox: encoded events made durable in SQLite before they go to NATS.
It is also where a receipt is read when another process's forwarder sent the event.

`synchronous=FULL` so an `outboxed` receipt survives power loss; concurrent `add` calls share one commit
(group commit). Several processes may share one outbox file: rows are leased, so two forwarders do not send
the same row at once (and if a lease expires mid-send, Nats-Msg-Id dedupe keeps it single)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bus.errors import Unavailable
from bus.event import Envelope
from bus.home import private_sqlite
from bus.outbox_schema import PARKED, PARKED_SQL, TABLE, WAITING_SQL
from bus.signing import PreparedEvent, event_headers, wire_message
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

ORPHAN_AFTER_S = 30.0  # a row its adder has not sent by then may be sent by any forwarder
KEEP_SENT_S = 600.0  # sent rows stay this long so any process sharing the outbox can read their receipt


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


class Outbox:
    """A SQLite outbox. All SQLite work runs on one owned thread; methods are coroutines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.owner = uuid.uuid4().hex
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-outbox")
        self._conn: sqlite3.Connection | None = None
        self._commit_lock = asyncio.Lock()
        self._pending: list[OutboxRow] = []
        self._pending_done: asyncio.Future[None] | None = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self) -> Outbox:
        """Raises Unavailable("outbox", …) when the file cannot be opened or created."""
        try:
            await self._run(self._open)
        except (sqlite3.Error, OSError) as e:
            raise Unavailable("outbox", f"cannot open {self.path}: {e}; check the path and its permissions") from e
        return self

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
            await self._run(self._conn.close)
            self._conn = None
        self._executor.shutdown(wait=True)

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("outbox is not open; use `await Outbox(path).open()`")
        return self._conn

    async def add(self, rows: Sequence[OutboxRow]) -> None:
        """Make rows durable. Adding an event id already present is a no-op. Returns after the fsync."""
        if self._pending_done is None:
            self._pending_done = asyncio.get_running_loop().create_future()
        self._pending.extend(rows)
        done = self._pending_done
        async with self._commit_lock:
            if not done.done():
                # This call commits everything queued so far, its own rows and those of waiting callers.
                batch, self._pending, self._pending_done = self._pending, [], None
                try:
                    await self._run(self._insert, batch)
                except (sqlite3.Error, OSError) as e:
                    done.set_exception(Unavailable("outbox", f"cannot write to {self.path}: {e}"))
                else:
                    done.set_result(None)
        await done

    def _insert(self, rows: list[OutboxRow]) -> None:
        now = time.time()
        with self.conn:  # one transaction, one fsync
            self.conn.execute("BEGIN IMMEDIATE")
            # A pending or parked event stays as it is; one already sent is sent again (JetStream says duplicate).
            self.conn.executemany(
                f"INSERT INTO {TABLE} (event_id, subject, payload, signature, signer_key, created_at, origin)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(event_id) DO UPDATE SET sent_at = NULL, stream_seq = NULL, duplicate = NULL,"
                " lease_owner = NULL, lease_until = 0 WHERE sent_at IS NOT NULL",
                [(r.event_id, r.subject, r.payload, r.signature, r.signer_key, now, self.owner) for r in rows],
            )

    async def claim(self, limit: int, lease_s: float, *, only_own: bool = False) -> list[OutboxRow]:
        """Lease up to `limit` rows, oldest first, that no live lease holds. `only_own`: rows this outbox
        object added, and orphans older than ORPHAN_AFTER_S (a short-lived publisher does not take over
        a node's backlog)."""
        rows: list[OutboxRow] = await self._run(self._claim, limit, lease_s, only_own)
        return rows

    def _claim(self, limit: int, lease_s: float, only_own: bool) -> list[OutboxRow]:
        now = time.time()
        mine = "AND (origin = ? OR created_at < ?)" if only_own else ""
        params = (now, self.owner, now - ORPHAN_AFTER_S, limit) if only_own else (now, limit)
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            found = self.conn.execute(
                f"SELECT seq, event_id, subject, payload, signature, signer_key FROM {TABLE}"
                f" WHERE sent_at IS NULL AND lease_until < ? {mine}"
                " ORDER BY seq LIMIT ?",
                params,
            ).fetchall()
            if found:
                self.conn.executemany(
                    f"UPDATE {TABLE} SET lease_owner = ?, lease_until = ? WHERE seq = ?",
                    [(self.owner, now + lease_s, seq) for seq, *_ in found],
                )
        return [
            OutboxRow(event_id, subject, bytes(payload), signature, signer_key)
            for _, event_id, subject, payload, signature, signer_key in found
        ]

    async def complete(self, acks: dict[str, tuple[int, bool]]) -> None:
        """Record JetStream's acknowledgements (event id → stream seq, duplicate); prune old sent rows."""
        if acks:
            await self._run(self._complete, dict(acks))

    def _complete(self, acks: dict[str, tuple[int, bool]]) -> None:
        now = time.time()
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                f"UPDATE {TABLE} SET sent_at = ?, stream_seq = ?, duplicate = ?, lease_owner = NULL, lease_until = 0"
                " WHERE event_id = ?",
                [(now, seq, int(duplicate), event_id) for event_id, (seq, duplicate) in acks.items()],
            )
            self.conn.execute(f"DELETE FROM {TABLE} WHERE sent_at < ?", (now - KEEP_SENT_S,))

    async def sent(self, event_ids: Sequence[str]) -> dict[str, tuple[int, bool]]:
        """The acknowledgements recorded for these events, by whichever forwarder sent them."""
        if not event_ids:
            return {}
        ids = list(event_ids)
        found: dict[str, tuple[int, bool]] = {}
        for start in range(0, len(ids), 500):  # stay far below SQLite's bound-parameter limit
            rows = await self._run(self._sent, ids[start : start + 500])
            found |= {event_id: (seq, bool(duplicate)) for event_id, seq, duplicate in rows}
        return found

    def _sent(self, event_ids: list[str]) -> list[tuple[str, int, int]]:
        marks = ",".join("?" * len(event_ids))
        query = (
            f"SELECT event_id, stream_seq, duplicate FROM {TABLE} WHERE sent_at IS NOT NULL AND event_id IN ({marks})"
        )
        return self.conn.execute(query, event_ids).fetchall()

    async def release(self, failures: dict[str, str]) -> None:
        """Give leased rows back after a failed send, recording the error and the attempt."""
        if failures:
            await self._run(self._release, dict(failures))

    def _release(self, failures: dict[str, str]) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                f"UPDATE {TABLE} SET lease_owner = NULL, lease_until = 0, attempts = attempts + 1, last_error = ?"
                " WHERE event_id = ?",
                [(error, event_id) for event_id, error in failures.items()],
            )

    async def release_leases(self) -> None:
        """Give back every unsent row this outbox object holds (on close: others need not wait out the lease)."""
        await self._run(self._release_leases)

    def _release_leases(self) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.execute(
                f"UPDATE {TABLE} SET lease_owner = NULL, lease_until = 0"
                " WHERE lease_owner = ? AND sent_at IS NULL AND lease_until < ?",
                (self.owner, PARKED),
            )

    async def park(self, refusals: dict[str, str]) -> None:
        """Keep rows JetStream refused outright out of the send loop, with the reason (never deleted)."""
        if refusals:
            await self._run(self._park, dict(refusals))

    def _park(self, refusals: dict[str, str]) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                f"UPDATE {TABLE} SET lease_owner = 'parked', lease_until = ?, last_error = ? WHERE event_id = ?",
                [(PARKED, error, event_id) for event_id, error in refusals.items()],
            )

    async def depth(self) -> int:
        """Rows waiting to be sent (parked rows excluded)."""
        count: int = await self._run(lambda: self.conn.execute(WAITING_SQL, (PARKED,)).fetchone()[0])
        return count

    async def parked(self) -> dict[str, str]:
        rows = await self._run(lambda: self.conn.execute(PARKED_SQL, (PARKED,)).fetchall())
        return {event_id: error for event_id, error in rows}

    async def forget(self, project: str, artifact_id: str) -> int:
        """Delete every row of an artifact's events (sent or not: a forgotten artifact's events are not sent
        any more), except the `forgotten` event itself, then reset the WAL so no frame keeps their payload.
        Returns the rows deleted. Idempotent. Raises Unavailable."""
        try:
            deleted: int = await self._run(self._forget, project, artifact_id)
        except sqlite3.Error as e:
            raise Unavailable("outbox", f"cannot delete forgotten rows from {self.path}: {e}") from e
        return deleted

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
