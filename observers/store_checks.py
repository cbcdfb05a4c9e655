"""Cheap checks that a node's stores can still be read: SQLite's quick check of the journal, and a sample of
mirror points read back (vector and payload) against the journal's digests. Run at start and now and then
while the node runs; a damaged store is named with the command that rebuilds it from the stream.

A point the mirror does not have yet is not damage (the mirror may be behind the journal); a point that
cannot be read, or holds another event's digest or a vector of the wrong length, is."""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import and_, select

from bus.errors import StoreDamaged, Unavailable
from bus.model.ids import point_id
from bus.model.kinds import artifact_kind_names
from observers.journal import Journal
from observers.mirror.store import MIRROR_REMEDY, VectorStore
from observers.schema import events

MIRROR_SAMPLE = 64
SAMPLE_RUNS = 8  # the sample is this many short runs of events from random places in the stream


@dataclass
class StoreCheck:
    """The last check of one store: `ok`, `damaged` (with the damage and its remedy), or `unchecked` (the
    store did not answer, which is an outage, reported as such elsewhere)."""

    store: str
    state: str = "unchecked"
    problem: str | None = None
    remedy: str | None = None
    sampled: int = 0
    checked_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def damaged(self) -> bool:
        return self.state == "damaged"

    def line(self) -> str:
        """One line for `health` and `status`."""
        if self.damaged:
            return f"{self.store} damaged: {self.problem}; {self.remedy}"
        return f"{self.store} {self.state}"


def _outcome(store: str, error: Unavailable) -> StoreCheck:
    if isinstance(error, StoreDamaged):
        return StoreCheck(store, "damaged", f"{error.path}: {error.damage}", error.remedy)
    return StoreCheck(store, "unchecked", str(error))


async def check_journal(journal: Journal) -> StoreCheck:
    try:
        await asyncio.to_thread(journal.check)
    except Unavailable as e:
        return _outcome("journal", e)
    return StoreCheck("journal", "ok")


def _sample(journal: Journal, size: int) -> dict[uuid.UUID, str | None]:
    """Up to `size` applied claims (event id → digest) from SAMPLE_RUNS random places in the stream."""
    kinds = artifact_kind_names()
    found: dict[uuid.UUID, str | None] = {}  # None: a row older than digests
    with journal.reading("sampling events for the mirror check") as conn:
        last = conn.execute(select(events.c.stream_seq).order_by(events.c.stream_seq.desc()).limit(1)).scalar()
        if last is None:
            return found
        for start in sorted(random.randint(1, int(last)) for _ in range(SAMPLE_RUNS)):
            rows = conn.execute(
                select(events.c.event_id, events.c.digest)
                .where(and_(events.c.stream_seq >= start, events.c.status == "applied", events.c.kind.in_(kinds)))
                .order_by(events.c.stream_seq)
                .limit(max(1, size // SAMPLE_RUNS))
            )
            found.update({uuid.UUID(row.event_id): row.digest for row in rows})
    return found


async def check_mirror(
    store: VectorStore, journal: Journal, *, dimension: int, size: int = MIRROR_SAMPLE
) -> StoreCheck:
    """Read back a sample of points, vectors included, and compare each with the journal's event."""
    try:
        sample = await asyncio.to_thread(_sample, journal, size)
    except Unavailable as e:
        return StoreCheck("mirror", "unchecked", f"the journal did not give a sample: {e}")
    by_point = {point_id(event_id): (event_id, digest) for event_id, digest in sample.items()}
    try:
        points = await store.retrieve(list(by_point))
    except Unavailable as e:
        return _outcome("mirror", e)
    for point in points:
        event_id, digest = by_point[point.id]
        if len(point.vector) != dimension:
            problem = f"point of event {event_id} holds a {len(point.vector)}-d vector, not {dimension}-d"
            return StoreCheck("mirror", "damaged", problem, MIRROR_REMEDY, len(points))
        held = point.payload.get("event_digest")
        if held is not None and digest is not None and held != digest:
            problem = f"point of event {event_id} holds digest {held}, the journal {digest}"
            return StoreCheck("mirror", "damaged", problem, MIRROR_REMEDY, len(points))
    return StoreCheck("mirror", "ok", sampled=len(points))
