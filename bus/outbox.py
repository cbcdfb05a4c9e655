"""The local outbox: encoded events made durable in SQLite before they go to NATS (DESIGN §6).

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

T = TypeVar("T")
PARKED = 1e18  # a lease that never expires: refused rows wait here for a person

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    subject TEXT NOT NULL,
    payload BLOB NOT NULL,
    created_at REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT
)
"""


@dataclass(frozen=True)
class OutboxRow:
    event_id: str
    subject: str
    payload: bytes


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
        await self._run(self._open)
        return self

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # synchronous=FULL: WAL+NORMAL can drop the last commits on power loss (DESIGN §6)
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute(_SCHEMA)
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
                    done.set_exception(e)
                else:
                    done.set_result(None)
        await done

    def _insert(self, rows: list[OutboxRow]) -> None:
        now = time.time()
        with self.conn:  # one transaction, one fsync
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "INSERT OR IGNORE INTO outbox (event_id, subject, payload, created_at) VALUES (?, ?, ?, ?)",
                [(r.event_id, r.subject, r.payload, now) for r in rows],
            )

    async def claim(self, limit: int, lease_s: float) -> list[OutboxRow]:
        """Lease up to `limit` rows, oldest first, that no live lease holds."""
        rows: list[OutboxRow] = await self._run(self._claim, limit, lease_s)
        return rows

    def _claim(self, limit: int, lease_s: float) -> list[OutboxRow]:
        now = time.time()
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            found = self.conn.execute(
                "SELECT seq, event_id, subject, payload FROM outbox WHERE lease_until < ? ORDER BY seq LIMIT ?",
                (now, limit),
            ).fetchall()
            if found:
                self.conn.executemany(
                    "UPDATE outbox SET lease_owner = ?, lease_until = ? WHERE seq = ?",
                    [(self.owner, now + lease_s, seq) for seq, *_ in found],
                )
        return [OutboxRow(event_id, subject, bytes(payload)) for _, event_id, subject, payload in found]

    async def complete(self, event_ids: Sequence[str]) -> None:
        """Remove rows that JetStream acknowledged."""
        if event_ids:
            await self._run(self._complete, list(event_ids))

    def _complete(self, event_ids: list[str]) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany("DELETE FROM outbox WHERE event_id = ?", [(e,) for e in event_ids])

    async def release(self, failures: dict[str, str]) -> None:
        """Give leased rows back after a failed send, recording the error and the attempt."""
        if failures:
            await self._run(self._release, dict(failures))

    def _release(self, failures: dict[str, str]) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "UPDATE outbox SET lease_owner = NULL, lease_until = 0, attempts = attempts + 1, last_error = ?"
                " WHERE event_id = ?",
                [(error, event_id) for event_id, error in failures.items()],
            )

    async def park(self, refusals: dict[str, str]) -> None:
        """Keep rows JetStream refused outright out of the send loop, with the reason (never deleted)."""
        if refusals:
            await self._run(self._park, dict(refusals))

    def _park(self, refusals: dict[str, str]) -> None:
        with self.conn:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany(
                "UPDATE outbox SET lease_owner = 'parked', lease_until = ?, last_error = ? WHERE event_id = ?",
                [(PARKED, error, event_id) for event_id, error in refusals.items()],
            )

    async def depth(self) -> int:
        """Rows waiting to be sent (parked rows excluded)."""
        count: int = await self._run(
            lambda: self.conn.execute("SELECT count(*) FROM outbox WHERE lease_until < ?", (PARKED,)).fetchone()[0]
        )
        return count

    async def parked(self) -> dict[str, str]:
        rows = await self._run(
            lambda: self.conn.execute(
                "SELECT event_id, last_error FROM outbox WHERE lease_until >= ?", (PARKED,)
            ).fetchall()
        )
        return {event_id: error for event_id, error in rows}

    async def event_ids(self) -> set[str]:
        rows = await self._run(lambda: self.conn.execute("SELECT event_id FROM outbox").fetchall())
        return {row[0] for row in rows}
