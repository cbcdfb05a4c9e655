"""What the dashboard's pages are told, and how: the latest events with their artifacts' current state and the
event rate, read from the journal as it commits, plus a health snapshot every few seconds; each open page gets
them through a bounded queue of its own that drops its oldest message when the page does not keep up, so a slow
or gone browser never holds the node back (the drops are counted and shown)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, select

from bus.errors import EpibusError
from bus.model.state import vouched_text
from observers.journal import Journal
from observers.projection import VOUCHED_COLUMNS, row_vouched
from observers.schema import artifacts, as_utc, events

log = logging.getLogger(__name__)
LATEST = 50  # events shown
RATE_WINDOW_S = 60.0
POLL_S = 0.5
HEALTH_EVERY_S = 2.0
QUEUE_SIZE = 64  # messages a page may fall behind before its oldest are dropped
MAX_SUBSCRIBERS = 32
CONTENT_CHARS = 500  # of each event's artifact text, on the page
CLOSE = ("", "")  # the message that ends a page's stream


@dataclass(eq=False)  # each page's queue is its own: hashed by identity
class Subscriber:
    queue: asyncio.Queue[tuple[str, str]] = field(default_factory=lambda: asyncio.Queue(QUEUE_SIZE))
    dropped: int = 0

    def offer(self, message: tuple[str, str]) -> bool:
        """Queue a message; a full queue loses its oldest one. Returns False when one was dropped."""
        kept = True
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
            kept = False
        self.queue.put_nowait(message)
        return kept


def latest_events(journal: Journal, limit: int = LATEST) -> list[dict[str, Any]]:
    """The newest events in stream order (newest first), each with its artifact's current state. Blocking;
    raises Unavailable or ComponentFailed."""
    e, a = events.c, artifacts.c
    joined = events.outerjoin(artifacts, and_(a.project == e.project, a.artifact_id == e.artifact_id))
    columns = (e.stream_seq, e.event_id, e.kind, e.project, e.artifact_id, e.actor_id, e.received_at, e.status)
    state = (e.reason, a.trust, a.lifecycle, a.resolution, a.forgotten, a.content, *VOUCHED_COLUMNS)
    query = select(*columns, *state).select_from(joined).order_by(e.stream_seq.desc()).limit(limit)
    with journal.reading("reading the latest events for the dashboard") as conn:
        rows = conn.execute(query).all()
    return [
        {
            "seq": r.stream_seq,
            "event_id": r.event_id,
            "kind": r.kind,
            "project": r.project,
            "artifact_id": r.artifact_id,
            "actor": r.actor_id,
            "at": as_utc(r.received_at).isoformat(),
            "status": r.status,
            "reason": r.reason,
            "trust": r.trust,
            "lifecycle": "forgotten" if r.forgotten else r.lifecycle,
            "resolution": r.resolution,
            "text": (r.content or "")[:CONTENT_CHARS],
            "vouched": vouched_text(row_vouched(r._mapping)),
        }
        for r in rows
    ]


def arrivals_since(journal: Journal, after_seq: int, cutoff: datetime) -> list[tuple[int, datetime]]:
    """(stream seq, received at) of the events after `after_seq` received since `cutoff`. Blocking; raises
    Unavailable or ComponentFailed."""
    e = events.c
    query = select(e.stream_seq, e.received_at).where(e.stream_seq > after_seq, e.received_at >= cutoff)
    with journal.reading("reading arrivals for the dashboard") as conn:
        return [(int(seq), as_utc(at)) for seq, at in conn.execute(query)]


class Feed:
    """Reads the journal every POLL_S and a health snapshot every HEALTH_EVERY_S, and hands both to every page."""

    def __init__(self, journal: Callable[[], Journal | None], health: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._journal = journal
        self._health = health
        self.subscribers: set[Subscriber] = set()
        self.events: list[dict[str, Any]] = []
        self.health: dict[str, Any] = {}
        self.dropped = 0  # messages dropped for pages that fell behind, over all pages
        self.read_failures = 0
        self._arrived: deque[tuple[int, float]] = deque()  # (seq, received at in epoch s) within the rate window
        self._seen_seq = 0  # the first read counts what arrived in the last minute before the dashboard started
        self._health_at = float("-inf")

    @property
    def rate(self) -> float:
        """Events per second over the last minute, by the journal's receive time."""
        cutoff = time.time() - RATE_WINDOW_S
        while self._arrived and self._arrived[0][1] < cutoff:
            self._arrived.popleft()
        return round(len(self._arrived) / RATE_WINDOW_S, 3)

    def subscribe(self) -> Subscriber | None:
        """A new page's queue, None when MAX_SUBSCRIBERS pages are open already."""
        if len(self.subscribers) >= MAX_SUBSCRIBERS:
            return None
        subscriber = Subscriber()
        self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)

    def close(self) -> None:
        """End every page's stream: each gets the last message of its queue, an empty one (see app.py)."""
        for subscriber in list(self.subscribers):
            subscriber.offer(CLOSE)

    def _broadcast(self, kind: str, data: dict[str, Any]) -> None:
        message = (kind, json.dumps(data, default=str))
        for subscriber in list(self.subscribers):
            if not subscriber.offer(message):
                self.dropped += 1

    async def run(self) -> None:
        """Until cancelled. A journal read that fails is logged, counted and shown; the next poll tries again."""
        while True:
            try:
                await self.poll()
            except EpibusError as e:
                self.read_failures += 1
                log.warning("dashboard: reading the journal failed: %s", e)
            await asyncio.sleep(POLL_S)

    async def poll(self) -> None:
        journal = self._journal()
        if journal is not None:
            await self._read_events(journal)
        if time.monotonic() - self._health_at >= HEALTH_EVERY_S:
            self._health_at = time.monotonic()
            self.health = await self._health()
            self._broadcast("health", self.snapshot_health())

    async def _read_events(self, journal: Journal) -> None:
        cutoff = datetime.now(UTC) - timedelta(seconds=RATE_WINDOW_S)
        arrived = await asyncio.to_thread(arrivals_since, journal, self._seen_seq, cutoff)  # raises EpibusError
        latest = await asyncio.to_thread(latest_events, journal)
        for seq, at in sorted(arrived):
            self._arrived.append((seq, at.timestamp()))
        newest = max((seq for seq, _ in arrived), default=0)
        self._seen_seq = max(self._seen_seq, newest, latest[0]["seq"] if latest else 0)
        if latest != self.events or arrived:
            self.events = latest
            self._broadcast("events", {"events": latest, "rate": self.rate})

    async def current_health(self) -> dict[str, Any]:
        """The snapshot, taken now when none was taken yet (a page opened right after the start)."""
        if not self.health:
            self.health = await self._health()
        return self.snapshot_health()

    def snapshot_health(self) -> dict[str, Any]:
        pages = {"open": len(self.subscribers), "dropped": self.dropped, "read_failures": self.read_failures}
        return self.health | {"rate": self.rate, "pages": pages}
