"""What is read from a stream without a durable consumer: replay through admission, DLQ listing, stream
figures (the reading itself is bus.intake.stream_read)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.broker.nats_errors import nats_call
from bus.enrolment.registry import AgentRegistry
from bus.intake.admission import Admission, Delivery, Rejected
from bus.intake.batch_context import BatchContext
from bus.intake.runner import Observer
from bus.intake.stream_read import READ_TIMEOUT_S, last_sequence, read_stream
from bus.subjects import DLQ_STREAM, STREAM

log = logging.getLogger(__name__)


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
    admission: Admission | None = None,
) -> ReplayReport:
    """Feed the stream from start_seq through the observer (idempotent sinks make this safe to repeat).
    Messages the live runner would dead-letter are reported, not written: the same admission decides."""
    report = ReplayReport()
    admission = admission or Admission(AgentRegistry(js))
    context = BatchContext(js, admission)
    end = await last_sequence(js, STREAM)
    async for messages in read_stream(js, STREAM, start_seq=start_seq, batch_size=batch_size):
        deliveries: list[Delivery] = []
        for msg, checked in zip(messages, await admission.check_msgs(messages), strict=True):
            try:
                deliveries.append(await admission.admit_checked(msg, checked))
            except Rejected as rejection:
                report.rejected.append((msg.metadata.sequence.stream, rejection.reason.value, rejection.error))
        if deliveries:
            deliveries = await context.attach(deliveries)
            for refusal in await observer.handle(deliveries) or ():
                report.rejected.append((refusal.stream_seq, refusal.reason.value, refusal.error))
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
    async with nats_call("stream figures", timeout_s=READ_TIMEOUT_S):
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
    return figures
