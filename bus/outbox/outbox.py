"""The local outbox: encoded events made durable before they go to NATS, and what sending them means: rows
leased to one forwarder at a time, failures retried and counted, refusals parked, acknowledgements recorded.
It is also where a receipt is read when another process's forwarder sent the event.

Several processes may share one outbox file: rows are leased, so two forwarders do not send the same row at once
(and if a lease expires mid-send, Nats-Msg-Id dedupe keeps it single). The file itself (schema, durability,
group commit, erasure) is `bus.outbox.outbox_file`'s."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bus.broker.streams import DUPLICATE_WINDOW_S
from bus.outbox.outbox_file import OutboxFile, OutboxRow
from bus.outbox.outbox_schema import PARKED, PARKED_SQL, TABLE, WAITING_SQL

ORPHAN_AFTER_S = 30.0  # a row its adder has not sent by then may be sent by any forwarder
# A sent row keeps only its receipt (its payload is dropped), for as long as JetStream's duplicate window, so any
# process sharing the outbox can read it; at most MAX_SENT_ROWS of them, the newest.
KEEP_SENT_S = DUPLICATE_WINDOW_S
MAX_SENT_ROWS = 50_000


class Outbox:
    """One process's handle on an outbox file (`owner` names its rows and leases). Methods are coroutines."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.owner = uuid.uuid4().hex
        self.file = OutboxFile(path)

    async def open(self) -> Outbox:
        """Raises Unavailable("outbox", …) when the file cannot be opened or created."""
        await self.file.open()
        return self

    async def close(self) -> None:
        await self.file.close()

    async def add(self, rows: Sequence[OutboxRow]) -> None:
        """Make rows durable. Adding an event id already present is a no-op. Returns after the fsync."""
        await self.file.add(rows, self.owner)

    async def claim(self, limit: int, lease_s: float, *, only_own: bool = False) -> list[OutboxRow]:
        """Lease up to `limit` rows, oldest first, that no live lease holds. `only_own`: rows this outbox
        object added, and orphans older than ORPHAN_AFTER_S (a short-lived publisher does not take over
        a node's backlog)."""
        return await self.file.run(_claim, self.file.conn, self.owner, limit, lease_s, only_own)

    async def complete(self, acks: dict[str, tuple[int, bool]]) -> None:
        """Record JetStream's acknowledgements (event id → stream seq, duplicate); prune old sent rows."""
        if acks:
            await self.file.run(_complete, self.file.conn, dict(acks))

    async def sent(self, event_ids: Sequence[str]) -> dict[str, tuple[int, bool]]:
        """The acknowledgements recorded for these events, by whichever forwarder sent them."""
        ids = list(event_ids)
        found: dict[str, tuple[int, bool]] = {}
        for start in range(0, len(ids), 500):  # stay far below SQLite's bound-parameter limit
            rows = await self.file.run(_sent, self.file.conn, ids[start : start + 500])
            found |= {event_id: (seq, bool(duplicate)) for event_id, seq, duplicate in rows}
        return found

    async def release(self, failures: dict[str, str]) -> None:
        """Give leased rows back after a failed send, recording the error and the attempt."""
        if failures:
            await self.file.run(_release, self.file.conn, dict(failures))

    async def release_leases(self) -> None:
        """Give back every unsent row this outbox object holds (on close: others need not wait out the lease)."""
        await self.file.run(_release_leases, self.file.conn, self.owner)

    async def park(self, refusals: dict[str, str]) -> None:
        """Keep rows JetStream refused outright out of the send loop, with the reason (never deleted)."""
        if refusals:
            await self.file.run(_park, self.file.conn, dict(refusals))

    async def depth(self) -> int:
        """Rows waiting to be sent (parked rows excluded)."""
        conn = self.file.conn
        count: int = await self.file.run(lambda: conn.execute(WAITING_SQL, (PARKED,)).fetchone()[0])
        return count

    async def parked(self) -> dict[str, str]:
        conn = self.file.conn
        rows = await self.file.run(lambda: conn.execute(PARKED_SQL, (PARKED,)).fetchall())
        return {event_id: error for event_id, error in rows}

    async def forget(self, project: str, artifact_id: str) -> int:
        """See OutboxFile.forget: an artifact's rows deleted (but its `forgotten` event's), the WAL reset."""
        return await self.file.forget(project, artifact_id)


# What the methods above run on the file's thread, each one transaction.


def _claim(conn: sqlite3.Connection, owner: str, limit: int, lease_s: float, only_own: bool) -> list[OutboxRow]:
    now = time.time()
    mine = "AND (origin = ? OR created_at < ?)" if only_own else ""
    params = (now, owner, now - ORPHAN_AFTER_S, limit) if only_own else (now, limit)
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        found = conn.execute(
            f"SELECT seq, event_id, subject, payload, signature, signer_key FROM {TABLE}"
            f" WHERE sent_at IS NULL AND lease_until < ? {mine}"
            " ORDER BY seq LIMIT ?",
            params,
        ).fetchall()
        if found:
            conn.executemany(
                f"UPDATE {TABLE} SET lease_owner = ?, lease_until = ? WHERE seq = ?",
                [(owner, now + lease_s, seq) for seq, *_ in found],
            )
    return [
        OutboxRow(event_id, subject, bytes(payload), signature, signer_key)
        for _, event_id, subject, payload, signature, signer_key in found
    ]


def _complete(conn: sqlite3.Connection, acks: dict[str, tuple[int, bool]]) -> None:
    now = time.time()
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            f"UPDATE {TABLE} SET sent_at = ?, stream_seq = ?, duplicate = ?, lease_owner = NULL, lease_until = 0,"
            " payload = x'', signature = NULL WHERE event_id = ?",
            [(now, seq, int(duplicate), event_id) for event_id, (seq, duplicate) in acks.items()],
        )
        conn.execute(f"DELETE FROM {TABLE} WHERE sent_at < ?", (now - KEEP_SENT_S,))
        conn.execute(
            f"DELETE FROM {TABLE} WHERE sent_at IS NOT NULL AND seq <= (SELECT seq FROM {TABLE}"
            " WHERE sent_at IS NOT NULL ORDER BY seq DESC LIMIT 1 OFFSET ?)",
            (MAX_SENT_ROWS,),
        )


def _sent(conn: sqlite3.Connection, event_ids: list[str]) -> list[tuple[str, int, int]]:
    marks = ",".join("?" * len(event_ids))
    query = f"SELECT event_id, stream_seq, duplicate FROM {TABLE} WHERE sent_at IS NOT NULL AND event_id IN ({marks})"
    return conn.execute(query, event_ids).fetchall()


def _release(conn: sqlite3.Connection, failures: dict[str, str]) -> None:
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            f"UPDATE {TABLE} SET lease_owner = NULL, lease_until = 0, attempts = attempts + 1, last_error = ?"
            " WHERE event_id = ?",
            [(error, event_id) for event_id, error in failures.items()],
        )


def _release_leases(conn: sqlite3.Connection, owner: str) -> None:
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            f"UPDATE {TABLE} SET lease_owner = NULL, lease_until = 0"
            " WHERE lease_owner = ? AND sent_at IS NULL AND lease_until < ?",
            (owner, PARKED),
        )


def _park(conn: sqlite3.Connection, refusals: dict[str, str]) -> None:
    with conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            f"UPDATE {TABLE} SET lease_owner = 'parked', lease_until = ?, last_error = ? WHERE event_id = ?",
            [(PARKED, error, event_id) for event_id, error in refusals.items()],
        )
