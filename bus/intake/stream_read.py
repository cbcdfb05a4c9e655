"""Reading a stream from a sequence to its current end without a durable consumer: an ephemeral pull
consumer that the server removes when idle, recreated when it goes quiet while the stream still owes a message."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RawStreamMsg

from bus.broker.nats_errors import NATS_OR_API_ERROR, broker_refusal, refused_at_once
from bus.broker.polling import fetch_batch
from bus.errors import Unavailable
from bus.intake.consumers import drop_consumer, pull_consumer
from bus.subjects import js_api

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
STREAM_NOT_FOUND = 10059  # JetStream's err_code for "stream not found"; 10037 is "no message found"


async def last_sequence(js: JetStreamContext, stream: str) -> int:
    """The stream's last sequence. Raises Forbidden when the broker refused to tell (an agent reads whole
    streams never: only its projects), Unavailable when nobody answered."""
    return (await stream_bounds(js, stream))[1]


async def stream_bounds(js: JetStreamContext, stream: str) -> tuple[int, int]:
    """The stream's first and last sequence (limits and erasures move the first on). Raises as last_sequence."""
    try:
        async with refused_at_once(js, js_api("STREAM.INFO", stream)), asyncio.timeout(READ_TIMEOUT_S):
            info = await js.stream_info(stream)
    except NATS_OR_API_ERROR as e:
        refusal = broker_refusal(js, js_api("STREAM.INFO", stream))
        raise refusal or Unavailable("nats", f"stream {stream}: {type(e).__name__} {e}") from e
    return int(info.state.first_seq), int(info.state.last_seq)


async def last_matching(js: JetStreamContext, stream: str, filter_subject: str) -> int:
    """The sequence of the newest message matching `filter_subject` (0 when none): a direct get with the filter
    in the request subject, the one form of stream lookup the broker can confine to an agent's projects."""
    try:
        async with refused_at_once(js, js_api("DIRECT.GET", stream, filter_subject)), asyncio.timeout(READ_TIMEOUT_S):
            msg = await js.get_msg(stream, subject=filter_subject, direct=True)
    except nats.js.errors.NotFoundError as e:
        if e.err_code == STREAM_NOT_FOUND:
            raise Unavailable("nats", f"stream {stream} is gone") from e
        return 0  # no message matches: the answer, not a failure
    except NATS_OR_API_ERROR as e:
        refusal = broker_refusal(js, js_api("DIRECT.GET", stream, filter_subject))
        raise refusal or Unavailable("nats", f"stream {stream} ({filter_subject}): {type(e).__name__} {e}") from e
    return int(msg.seq or 0)


async def read_stream(
    js: JetStreamContext,
    stream: str,
    *,
    filter_subject: str | None = None,
    start_seq: int = 1,
    batch_size: int = 500,
    last_per_subject: bool = False,
) -> AsyncIterator[list[Msg]]:
    """Batches of every message matching the filter from start_seq up to `end`, the stream's last sequence
    when the read began; with last_per_subject, only the newest message of each subject (a KV bucket's
    current values, which may include values written during the read).

    Done is decided by stream sequences, never by pending counts: a filtered consumer on a recovered store
    has reported nothing pending with thousands of messages unread. Raises Unavailable when the read cannot
    make progress for READ_STALL_S, instead of returning short."""
    if filter_subject is not None:  # read last per subject too, the newest match is the last of its subject
        end = await last_matching(js, stream, filter_subject)
    else:
        end = await last_sequence(js, stream)
    if end < start_seq:
        return
    read = _Read(js, stream, filter_subject, end, start_seq - 1, batch_size, last_per_subject)
    try:
        while not read.done:
            messages = await read.next_batch()
            if messages:
                yield messages
    finally:
        await read.close()


FETCH_WAIT_S = 2.0
READ_STALL_S = 30.0  # covers a server restart and the client's reconnect
RETRY_PAUSE_S = 0.5


class _Read:
    """One read in progress: an ephemeral pull consumer from the last sequence delivered, recreated when it
    goes quiet while the stream still owes a matching message (e.g. a server restart lost it)."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        filter_subject: str | None,
        end: int,
        delivered: int,
        batch_size: int,
        last_per_subject: bool,
    ) -> None:
        self.js, self.stream, self.filter_subject, self.end = js, stream, filter_subject, end
        self.delivered = delivered  # the highest stream sequence handed out
        self.batch_size, self.last_per_subject = batch_size, last_per_subject
        self.done = False
        self._sub: JetStreamContext.PullSubscription | None = None
        self._progress_at = time.monotonic()
        self._last_error = "none"

    async def next_batch(self) -> list[Msg]:
        """The next messages owed (possibly none yet); sets `done` once nothing more is owed."""
        try:
            return await self._attempt()
        except nats.errors.ConnectionClosedError as e:
            raise Unavailable("nats", f"reading {self._what()}: the connection is closed") from e
        except nats.js.errors.NotFoundError as e:
            if e.err_code == STREAM_NOT_FOUND:
                raise Unavailable("nats", f"reading {self._what()}: the stream is gone") from e
            self._stalled(f"{type(e).__name__} {e}")
        except NATS_OR_API_ERROR as e:
            self._stalled(f"{type(e).__name__} {e}")
        await asyncio.sleep(RETRY_PAUSE_S)  # the server is restarting or the client reconnecting
        return []

    async def _attempt(self) -> list[Msg]:
        if self._sub is None:
            self._sub = await self._subscribe()
        messages = await fetch_batch(self._sub, self.batch_size, FETCH_WAIT_S)
        fresh = [m for m in messages if m.metadata.sequence.stream > self.delivered]
        if fresh:
            self.delivered = fresh[-1].metadata.sequence.stream
            self._progress_at = time.monotonic()
            self.done = self.delivered >= self.end
            if self.last_per_subject:
                return fresh
            return [m for m in fresh if m.metadata.sequence.stream <= self.end]
        owed = await self._next_owed()
        if owed is None:
            self.done = True
            return []
        # The consumer is quiet yet the stream holds a message it should deliver: start a new one there.
        self._stalled(f"message {owed} matches but the consumer did not deliver it")
        await self._unsubscribe()
        return []

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            # Named, so nats-py puts the filter in the create request's subject, where the broker checks it.
            name=f"read_{secrets.token_hex(8)}" if self.filter_subject else None,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT if self.last_per_subject else DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=None if self.last_per_subject else self.delivered + 1,
            filter_subject=self.filter_subject,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        return await pull_consumer(self.js, self.stream, config)

    async def _next_owed(self) -> int | None:
        """The first sequence in (delivered, end] the read still owes, or None when there is none. Asked of
        the stream itself (answered by the leader), not of the consumer. A filtered read asks for the newest
        matching message only (the lookup an agent may make): any after `delivered` is owed (read last per
        subject too, the newest matching message is the last of its subject)."""
        if self.filter_subject is not None:
            newest = await last_matching(self.js, self.stream, self.filter_subject)
            return newest if newest > self.delivered else None
        seq = self.delivered + 1
        while seq <= self.end:
            found = await self._get(seq=seq, next_by_subject=self.filter_subject or ">")
            if found is None or found.seq is None or found.seq > self.end:
                return None
            if not self.last_per_subject or await self._is_newest(found):
                return int(found.seq)
            seq = found.seq + 1  # superseded: a last-per-subject read does not owe it
        return None

    async def _is_newest(self, msg: RawStreamMsg) -> bool:
        assert msg.subject is not None
        newest = await self._get(last_of_subject=msg.subject)
        return newest is None or newest.seq is None or newest.seq <= (msg.seq or 0)

    async def _get(
        self, *, seq: int | None = None, next_by_subject: str | None = None, last_of_subject: str | None = None
    ) -> RawStreamMsg | None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                if last_of_subject is not None:
                    return await self.js.get_msg(self.stream, subject=last_of_subject)
                return await self.js.get_msg(self.stream, seq=seq, subject=next_by_subject, next=True)
        except nats.js.errors.NotFoundError as e:
            if e.err_code == STREAM_NOT_FOUND:
                raise
            return None  # no such message: the answer, not a failure

    def _stalled(self, why: str) -> None:
        self._last_error = why
        if time.monotonic() - self._progress_at > READ_STALL_S:
            raise Unavailable(
                "nats",
                f"reading {self._what()} made no progress for {READ_STALL_S:.0f}s after sequence "
                f"{self.delivered} of {self.end}: {why}",
            )

    def _what(self) -> str:
        return f"{self.stream} ({self.filter_subject or 'all subjects'})"

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        await drop_consumer(self.js, sub)  # the server drops the ephemeral consumer once idle anyway

    async def close(self) -> None:
        await self._unsubscribe()
