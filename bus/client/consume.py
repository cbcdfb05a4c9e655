"""Consuming events from Python, with ack semantics:

    async with client.consume("demo", cursor=FileCursor(path)) as events:
        async for received in events:
            handle(received.event)
            received.ack()

At least once: each admitted event is handed over once per run, in stream order. The cursor keeps the highest
sequence at or below which every event was acknowledged (or skipped as refused), so a reader that stops, crashes
or forgets an ack gets every unacknowledged event again on its next run with the same cursor, and nothing at or
below the cursor. Acks may come in any order. Events the nodes' admission refuses (bad signature, unknown key,
wrong subject) are never handed over: they are counted, logged with the reason, and passed by the cursor.

An agent reads through a consumer a node opens in one of its slots (no ack state on the server: the cursor is the
ack state), so a reader needs no permission beyond its project's events."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bus.enrolment.registry import AgentRegistry
from bus.errors import ConfigError, LimitReached
from bus.intake.admission import Admission, Rejected
from bus.intake.cursor import Cursor, MemoryCursor
from bus.intake.follow import StreamFollower
from bus.intake.stream_read import last_matching
from bus.model.event import Envelope
from bus.subjects import STREAM, events_filter

log = logging.getLogger(__name__)
DEFAULT_MAX_UNACKED = 1000


@dataclass
class ConsumeStats:
    delivered: int = 0
    acked: int = 0
    rejected: int = 0  # refused by admission: never handed over, passed by the cursor
    last_rejection: str | None = None


@dataclass(eq=False)
class Received:
    """One admitted event and where it sits in the stream; `ack()` once it is handled."""

    event: Envelope
    seq: int  # its stream sequence
    subject: str
    stream_time: datetime
    _consumer: Consumer = field(repr=False)
    acked: bool = False

    def ack(self) -> None:
        """Mark the event handled: the cursor passes it once every earlier one is handled too. Idempotent."""
        if not self.acked:
            self.acked = True
            self._consumer._acked(self.seq)


class Consumer:
    """An async iterator of `Received` over one project's events (of one kind, if given), used as `async with`.

    Starts right after `cursor.load()` when the cursor holds a sequence; otherwise at the stream's first event
    with `from_start`, or at the next new one. Raises LimitReached when `max_unacked` events are handed over and
    not acknowledged (ack them, or raise the limit); Unavailable when the stream cannot be read (the cursor
    holds, so a new run resumes); Forbidden when the agent is not a member of the project."""

    def __init__(
        self,
        nc: NatsClient,
        project: str,
        *,
        kind: str | None = None,
        cursor: Cursor | None = None,
        from_start: bool = False,
        max_unacked: int = DEFAULT_MAX_UNACKED,
        registry: AgentRegistry | None = None,
    ) -> None:
        if max_unacked < 1:
            raise ConfigError("max_unacked", f"{max_unacked} must be at least 1")
        js = nc.jetstream()
        self.filter_subject = events_filter(project, kind)
        self.cursor = cursor or MemoryCursor()
        self.max_unacked = max_unacked
        self.stats = ConsumeStats()
        self._admission = Admission(registry or AgentRegistry(js))
        saved = self.cursor.load()
        start_seq = saved + 1 if saved else (1 if from_start else None)
        self._js = js
        self._follower = StreamFollower(
            js, STREAM, self.filter_subject, start_seq=start_seq, closed=lambda: nc.is_closed
        )
        self._messages: AsyncGenerator[Msg, None] | None = None
        self._saved = saved
        self._passed = saved  # the highest sequence handed over or skipped
        self._unacked: set[int] = set()

    @property
    def watermark(self) -> int:
        """The highest sequence at or below which every event was acknowledged or skipped."""
        return min(self._unacked) - 1 if self._unacked else self._passed

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def start(self) -> None:
        """Fix where reading begins: "the next new event" means after the last one in the stream now, not at
        the first `anext`. Called by `async with`; idempotent."""
        if self._follower.start_seq is None:
            self._follower.start_seq = await last_matching(self._js, STREAM, self.filter_subject) + 1

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop reading and drop the consumer (the cursor stays where the acks put it)."""
        messages, self._messages = self._messages, None
        if messages is not None:
            await messages.aclose()
        await self._follower._drop_subscription()

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Received:
        if len(self._unacked) >= self.max_unacked:
            raise LimitReached(
                "unacknowledged events",
                self.max_unacked,
                f"{len(self._unacked)} events on {self.filter_subject} handed over and not acknowledged "
                f"(the oldest is sequence {min(self._unacked)})",
                "call ack() on each event once it is handled, or pass a larger max_unacked",
            )
        if self._messages is None:
            await self.start()
            self._messages = self._follower.messages()
        while True:
            msg = await anext(self._messages)
            seq = msg.metadata.sequence.stream
            try:
                event = await self._admission.admit(msg.subject, msg.data, msg.metadata.timestamp, msg.headers)
            except Rejected as e:
                self.stats.rejected += 1
                self.stats.last_rejection = f"{seq}: {e.reason.value}: {e.error}"
                log.warning(
                    "not handing over stream sequence %d on %s: %s (%s)", seq, msg.subject, e.reason.value, e.error
                )
                self._pass(seq)
                continue
            self._unacked.add(seq)
            self._pass(seq)
            self.stats.delivered += 1
            return Received(event, seq, msg.subject, msg.metadata.timestamp, self)

    def _pass(self, seq: int) -> None:
        self._passed = max(self._passed, seq)
        self._save()

    def _acked(self, seq: int) -> None:
        self._unacked.discard(seq)
        self.stats.acked += 1
        self._save()

    def _save(self) -> None:
        watermark = self.watermark
        if watermark > self._saved:
            self.cursor.save(watermark)
            self._saved = watermark
