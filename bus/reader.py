"""Reading a stream from a sequence to its current end, without a durable consumer: replay, DLQ listing,
stream figures. Each read uses an ephemeral pull consumer that the server removes when idle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.errors import Unavailable
from bus.jetstream import NATS_OR_API_ERROR
from bus.runner import Delivery, Observer, Rejected, admit_event
from bus.subjects import DLQ_STREAM, STREAM

READ_TIMEOUT_S = 10.0


async def last_sequence(js: JetStreamContext, stream: str) -> int:
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            info = await js.stream_info(stream)
    except NATS_OR_API_ERROR as e:
        raise Unavailable("nats", f"stream {stream}: {type(e).__name__} {e}") from e
    return int(info.state.last_seq)


async def read_stream(
    js: JetStreamContext,
    stream: str,
    *,
    filter_subject: str | None = None,
    start_seq: int = 1,
    batch_size: int = 500,
    last_per_subject: bool = False,
) -> AsyncIterator[list[Msg]]:
    """Batches of messages from start_seq up to the stream's last sequence when the read began; with
    last_per_subject, only the newest message of each subject (a KV bucket's current values)."""
    end = await last_sequence(js, stream)
    if end < start_seq:
        return
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT if last_per_subject else DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=None if last_per_subject else start_seq,
        filter_subject=filter_subject,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    try:
        subscription = await js.pull_subscribe(filter_subject or ">", stream=stream, config=config)
    except NATS_OR_API_ERROR as e:
        raise Unavailable("nats", f"cannot read {stream}: {type(e).__name__} {e}") from e
    try:
        while True:
            try:
                messages = await subscription.fetch(batch_size, timeout=2.0)
            except TimeoutError:
                # Nothing more matched the filter up to now: with a filter the end may hold no match.
                info = await subscription.consumer_info()
                if info.num_pending == 0:
                    return
                continue
            yield messages
            last = messages[-1].metadata
            if last.sequence.stream >= end or last.num_pending == 0:
                return
    finally:
        await subscription.unsubscribe()


@dataclass
class ReplayReport:
    read: int = 0
    handled: int = 0
    rejected: list[tuple[int, str, str]] = field(default_factory=list)  # (stream seq, reason, error)
    last_seq: int = 0


async def replay(
    js: JetStreamContext,
    observer: Observer,
    *,
    start_seq: int = 1,
    batch_size: int = 500,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Feed the stream from start_seq through the observer (idempotent sinks make this safe to repeat).
    Messages the live runner would dead-letter are reported, not written."""
    report = ReplayReport()
    end = await last_sequence(js, STREAM)
    async for messages in read_stream(js, STREAM, start_seq=start_seq, batch_size=batch_size):
        deliveries: list[Delivery] = []
        for msg in messages:
            seq = msg.metadata.sequence.stream
            try:
                event = admit_event(msg.subject, msg.data)
            except Rejected as rejection:
                report.rejected.append((seq, rejection.reason.value, rejection.error))
                continue
            deliveries.append(Delivery(event, msg.subject, seq, msg.metadata.num_delivered, msg.metadata.timestamp))
        if deliveries:
            await observer.handle(deliveries)
        report.read += len(messages)
        report.handled += len(deliveries)
        report.last_seq = messages[-1].metadata.sequence.stream
        if progress is not None:
            progress(report.last_seq, end)
    return report


async def dead_letters(js: JetStreamContext, *, filter_subject: str | None = None) -> list[Msg]:
    found: list[Msg] = []
    async for messages in read_stream(js, DLQ_STREAM, filter_subject=filter_subject):
        found.extend(messages)
    return found


async def stream_figures(js: JetStreamContext, streams: Sequence[str] = (STREAM, DLQ_STREAM)) -> dict[str, Any]:
    """Messages, bytes, sequences and every durable consumer's pending and redelivered counts."""
    figures: dict[str, Any] = {}
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            for name in streams:
                try:
                    info = await js.stream_info(name)
                except nats.js.errors.NotFoundError:
                    figures[name] = None
                    continue
                consumers = await js.consumers_info(name)
                figures[name] = {
                    "messages": info.state.messages,
                    "bytes": info.state.bytes,
                    "first_seq": info.state.first_seq,
                    "last_seq": info.state.last_seq,
                    "consumers": {
                        c.name: {
                            "pending": c.num_pending,
                            "ack_pending": c.num_ack_pending,
                            "redelivered": c.num_redelivered,
                            "delivered_stream_seq": c.delivered.stream_seq if c.delivered else None,
                            "ack_floor_stream_seq": c.ack_floor.stream_seq if c.ack_floor else None,
                        }
                        for c in consumers
                        if c.config.durable_name
                    },
                }
    except NATS_OR_API_ERROR as e:
        raise Unavailable("nats", f"stream figures: {type(e).__name__} {e}") from e
    return figures
