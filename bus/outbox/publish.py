"""Sending encoded events to JetStream: receipts and the bounded, timed-out bulk sender.

nats-py never resolves the future of a publish the server rejected (upstream #985), so every future here
has a deadline, and compare-and-set publishes go through the awaited path instead."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from bus.broker.nats_errors import NATS_UNAVAILABLE, broker_refusal, refused_at_once, translate_publish_error
from bus.errors import EpibusError, Unavailable
from bus.model.vocab import ReceiptLevel
from bus.outbox.outbox_file import OutboxRow
from bus.subjects import MSG_ID_HEADER

MAX_PUBLISH_ATTEMPTS = 5
# Whatever nats-py raises while sending is classified per row, never raised out of a batch.
SEND_ERRORS: tuple[type[BaseException], ...] = (*NATS_UNAVAILABLE, nats.errors.Error)


@dataclass(frozen=True)
class Receipt:
    """How far one event is known to have got. `duplicate`: JetStream already had this event id."""

    event_id: uuid.UUID
    subject: str
    level: ReceiptLevel
    stream_seq: int | None = None
    duplicate: bool = False
    flags: tuple[str, ...] = ()  # e.g. previously_retracted, unearned_confidence
    rejected: str | None = None  # journaled, but the state projection refused it: why

    def as_dict(self) -> dict[str, Any]:
        return {
            "event_id": str(self.event_id),
            "subject": self.subject,
            "level": self.level.value,
            "stream_seq": self.stream_seq,
            "duplicate": self.duplicate,
            "flags": list(self.flags),
            "rejected": self.rejected,
        }


def message_headers(event_id: str) -> dict[str, str]:
    """A fresh headers dict per publish (nats-py writes into the dict it is given), for a message that is not
    an event row (a row's own are `OutboxRow.headers`)."""
    return {MSG_ID_HEADER: event_id}


SendResult = PubAck | EpibusError


async def send_batch(
    js: JetStreamContext, rows: Sequence[OutboxRow], *, max_in_flight: int = 512, timeout_s: float = 10.0
) -> dict[str, SendResult]:
    """Publish rows with at most `max_in_flight` unacknowledged; every row gets a PubAck or an error.

    No future outlives `timeout_s` after the last send: unanswered ones are cancelled and reported as
    Unavailable, so a caller can retry them with the same Nats-Msg-Id."""
    return await send_chunks(js, _one_chunk(rows), max_in_flight=max_in_flight, timeout_s=timeout_s)


async def _one_chunk(rows: Sequence[OutboxRow]) -> AsyncIterator[Sequence[OutboxRow]]:
    yield rows


async def send_chunks(
    js: JetStreamContext,
    chunks: AsyncIterable[Sequence[OutboxRow]],
    *,
    max_in_flight: int = 512,
    timeout_s: float = 10.0,
) -> dict[str, SendResult]:
    """`send_batch` of rows that arrive in chunks (e.g. signed on a worker thread meanwhile): each chunk is sent
    as soon as it comes, and every row of every chunk gets a result."""
    results: dict[str, SendResult] = {}
    slots = asyncio.Semaphore(max_in_flight)
    in_flight: dict[asyncio.Future[PubAck], OutboxRow] = {}
    starved = False
    async for chunk in chunks:
        for row in chunk:
            if starved:
                results[row.event_id] = Unavailable("nats", f"no PubAck freed a slot within {timeout_s}s")
                continue
            try:
                if slots.locked():  # only a wait needs a deadline (asyncio.timeout costs more than a publish)
                    async with asyncio.timeout(timeout_s):
                        await slots.acquire()
                else:
                    await slots.acquire()
            except TimeoutError:
                starved = True  # the rest, in this chunk and the next, is reported unsent
                results[row.event_id] = Unavailable("nats", f"no PubAck freed a slot within {timeout_s}s")
                continue
            try:
                future = await js.publish_async(row.subject, row.payload, headers=row.headers())
            except SEND_ERRORS as e:
                slots.release()
                results[row.event_id] = translate_publish_error(e, row.subject)
                continue
            future.add_done_callback(lambda _: slots.release())
            in_flight[future] = row
    if in_flight:
        done, late = await asyncio.wait(in_flight, timeout=timeout_s)
        for future in late:
            future.cancel()  # frees nats-py's own pending slot too
            subject = in_flight[future].subject
            refusal = broker_refusal(js, subject)
            results[in_flight[future].event_id] = refusal or Unavailable("nats", f"no PubAck within {timeout_s}s")
        for future in done:
            row = in_flight[future]
            error = future.exception()
            results[row.event_id] = future.result() if error is None else translate_publish_error(error, row.subject)
    return results


async def send_one(
    js: JetStreamContext, row: OutboxRow, *, timeout_s: float, extra_headers: dict[str, str] | None = None
) -> PubAck:
    """The awaited publish: the server's error (e.g. 10071 wrong last sequence) is raised, classified."""
    headers = row.headers() | (extra_headers or {})
    try:
        async with refused_at_once(js, row.subject):
            return await js.publish(row.subject, row.payload, timeout=timeout_s, headers=headers)
    except Exception as e:
        raise (broker_refusal(js, row.subject) or translate_publish_error(e, row.subject)) from e


def retrying_unavailable() -> AsyncRetrying:
    """Bounded retries of Unavailable only (never Conflict), backing off up to 2 s."""
    return AsyncRetrying(
        stop=stop_after_attempt(MAX_PUBLISH_ATTEMPTS),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        retry=retry_if_exception_type(Unavailable),
        reraise=True,
    )
