"""The forwarder: drains the outbox to JetStream with the events' own Nats-Msg-Id, so a drain after an outage
neither loses nor doubles an event. Publishers await `sent(event_id)` for their receipt."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from bus.errors import Conflict, EpibusError, InvalidEvent, Unavailable
from bus.intake.admission import TimeBounds
from bus.outbox.outbox import Outbox
from bus.outbox.outbox_file import OutboxRow
from bus.outbox.publish import send_batch

log = logging.getLogger(__name__)


@dataclass
class ForwarderStats:
    sent: int = 0
    duplicates: int = 0
    failed_attempts: int = 0
    rejected: int = 0
    last_error: str | None = None
    errors_by_kind: dict[str, int] = field(default_factory=dict)


class Forwarder:
    """Moves outbox rows to JetStream in batches. `run()` is the loop; it returns only when cancelled."""

    def __init__(
        self,
        outbox: Outbox,
        jetstream: Callable[[], JetStreamContext | None],
        *,
        before_send: Callable[[], Awaitable[None]] | None = None,
        batch_size: int = 1000,
        max_in_flight: int = 512,
        timeout_s: float = 10.0,
        idle_poll_s: float = 1.0,
        max_backoff_s: float = 5.0,
        only_own_rows: bool = False,
        bounds: TimeBounds | None = None,
    ) -> None:
        self.outbox = outbox
        self._jetstream = jetstream
        self._before_send = before_send
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.idle_poll_s = idle_poll_s
        self.max_backoff_s = max_backoff_s
        self.only_own_rows = only_own_rows
        self.bounds = bounds or TimeBounds.from_env()
        self.stats = ForwarderStats()
        self._wake = asyncio.Event()
        self._waiters: dict[str, list[asyncio.Future[PubAck]]] = {}

    def wake(self) -> None:
        self._wake.set()

    def sent(self, event_id: str) -> asyncio.Future[PubAck]:
        """A future resolved with the PubAck once this event is in JetStream, or failed with InvalidEvent or
        Conflict if JetStream refused it. Unavailability does not fail it: the row stays and is retried."""
        future: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(event_id, []).append(future)
        return future

    def _settle(self, event_id: str, result: PubAck | EpibusError) -> None:
        for future in self._waiters.pop(event_id, []):
            if future.done():
                continue
            if isinstance(result, PubAck):
                future.set_result(result)
            else:
                future.set_exception(result)

    async def run(self) -> None:
        backoff_s = 0.0
        while True:
            if backoff_s:
                await asyncio.sleep(backoff_s)
            else:
                try:
                    async with asyncio.timeout(self.idle_poll_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass  # poll anyway: another process may have written to a shared outbox
            self._wake.clear()
            try:
                moved_all = await self.drain_once()
            except Unavailable as e:
                moved_all = False
                self._count_error(e)
            except (EpibusError, sqlite3.Error, nats.errors.Error, OSError) as e:
                # Not an outage (a key conflict, a broken outbox file): say so loudly and keep the loop,
                # and the rows, alive; a dead forwarder would take its owner's task group down with it.
                moved_all = False
                self._count_error(e)
                log.error("forwarder: %s: %s (rows stay in the outbox)", type(e).__name__, e)
            backoff_s = 0.0 if moved_all else min(self.max_backoff_s, max(0.1, backoff_s * 2))

    async def drain_once(self) -> bool:
        """Send every row currently in the outbox. True when all of them reached JetStream."""
        js = self._jetstream()
        if js is None:
            return False
        if self._before_send is not None:
            await self._before_send()
        while True:
            rows = await self.outbox.claim(self.batch_size, lease_s=self.timeout_s * 3, only_own=self.only_own_rows)
            if not rows:
                return True
            rows = await self._park_too_old(rows)
            if not rows:
                continue
            results = await send_batch(js, rows, max_in_flight=self.max_in_flight, timeout_s=self.timeout_s)
            acked: dict[str, tuple[int, bool]] = {}
            retry: dict[str, str] = {}
            refused: dict[str, str] = {}
            for row in rows:
                result = results[row.event_id]
                if isinstance(result, PubAck):
                    acked[row.event_id] = (result.seq, bool(result.duplicate))
                    self.stats.sent += 1
                    self.stats.duplicates += int(bool(result.duplicate))
                elif isinstance(result, InvalidEvent | Conflict):
                    # Refused for what it is, not for an outage: retrying cannot help. Keep it, loudly.
                    self.stats.rejected += 1
                    log.error("outbox event %s refused by JetStream, parked in the outbox: %s", row.event_id, result)
                    refused[row.event_id] = str(result)
                else:
                    retry[row.event_id] = str(result)
                    self._count_error(result)
            await self.outbox.complete(acked)
            await self.outbox.release(retry)
            await self.outbox.park(refused)
            for row in rows:
                result = results[row.event_id]
                if not isinstance(result, Unavailable):
                    self._settle(row.event_id, result)
            if retry:
                return False

    async def _park_too_old(self, rows: list[OutboxRow]) -> list[OutboxRow]:
        """Rows held longer than every node admits (they would all dead-letter them as implausible_time) are
        parked with the reason, so the publisher learns it now; the rest are returned to be sent."""
        now = datetime.now(UTC)
        too_old: dict[str, str] = {}
        for row in rows:
            recorded_at = _recorded_at(row.payload)
            problem = self.bounds.problem(recorded_at, now) if recorded_at is not None else None
            if problem is not None:
                too_old[row.event_id] = problem
        if not too_old:
            return rows
        await self.outbox.park(too_old)
        for event_id, problem in too_old.items():
            self.stats.rejected += 1
            log.error("outbox event %s not sent, parked in the outbox: %s", event_id, problem)
            self._settle(event_id, InvalidEvent(f"event {event_id}", problem))
        return [row for row in rows if row.event_id not in too_old]

    def _count_error(self, error: Exception) -> None:
        self.stats.failed_attempts += 1
        self.stats.last_error = str(error)
        name = type(error).__name__
        self.stats.errors_by_kind[name] = self.stats.errors_by_kind.get(name, 0) + 1
        log.warning("forwarder: %s (events stay in the outbox and are retried)", error)


def _recorded_at(payload: bytes) -> datetime | None:
    """The event's recorded_at, or None when the row is not a readable event (JetStream and every node's
    admission judge those; the outbox only holds what the client encoded)."""
    try:
        value = json.loads(payload).get("recorded_at")
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except (ValueError, AttributeError):
        return None
