"""The outbox's table and what counts as waiting in it, kept apart from `bus.outbox.outbox` so a reader that only
counts (the statusline, on every shell prompt) opens the file read-only with `sqlite3` alone, without the
outbox's event loop machinery."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

TABLE = "outbox"
PARKED = 1e18  # a lease that never expires: refused rows wait here for a person
# Rows waiting to be sent, parked ones excluded; the parked ones; how many are parked. Parameter: PARKED.
WAITING_SQL = f"SELECT count(*) FROM {TABLE} WHERE sent_at IS NULL AND lease_until < ?"
PARKED_SQL = f"SELECT event_id, last_error FROM {TABLE} WHERE lease_until >= ?"
PARKED_COUNT_SQL = f"SELECT count(*) FROM {TABLE} WHERE lease_until >= ?"
READ_TIMEOUT_S = 0.2  # a reader in WAL mode waits only for a checkpoint restarting the log


@dataclass(frozen=True)
class Depth:
    waiting: int
    parked: int


def read_depth(path: Path) -> Depth:
    """How many events wait in the outbox file and how many are parked, through a read-only connection (SQLite
    may still create the -wal and -shm files, with the database file's mode, when no writer holds them). A
    missing file or table holds none. Raises sqlite3.Error for a file that is not an outbox (the caller says so
    in its own terms)."""
    if not path.exists():
        return Depth(0, 0)
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=READ_TIMEOUT_S)
    try:
        found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
        if found is None:
            return Depth(0, 0)  # created, not yet set up by its first opener
        (waiting,) = conn.execute(WAITING_SQL, (PARKED,)).fetchone()
        (parked,) = conn.execute(PARKED_COUNT_SQL, (PARKED,)).fetchone()
        return Depth(int(waiting), int(parked))
    finally:
        conn.close()
