"""The consumer runner every observer shares: a durable pull consumer on EPI that validates each message,
hands valid events to the observer in batches, acks only after the observer's durable write, and
dead-letters what it cannot use, with the reason (DESIGN §5, §6, §10.7, §10.10)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.errors import Conflict, InvalidEvent, Unavailable
from bus.event import Envelope, decode_event
from bus.jetstream import NATS_OR_API_ERROR, AgentRegistry, translate_publish_error
from bus.signing import verify_signature
from bus.subjects import CONSUMER_PATTERN, STREAM, dlq_subject, event_subject
from bus.vocab import DeadLetterReason

log = logging.getLogger(__name__)
RETRYABLE: tuple[type[BaseException], ...] = (Unavailable, *NATS_OR_API_ERROR)

# Dead-letter headers: the reason, the error and where the message came from.
DLQ_REASON = "Epibus-Dlq-Reason"
DLQ_ERROR = "Epibus-Dlq-Error"
DLQ_SUBJECT = "Epibus-Dlq-Subject"
DLQ_STREAM_SEQ = "Epibus-Dlq-Stream-Seq"
DLQ_CONSUMER = "Epibus-Dlq-Consumer"
DLQ_AT = "Epibus-Dlq-At"


@dataclass(frozen=True)
class Delivery:
    """A validated, signature-checked event as delivered from the stream."""

    event: Envelope
    subject: str
    stream_seq: int
    num_delivered: int


class Observer(Protocol):
    """What the runner feeds. `name` is the durable consumer name: two runners of one observer share it."""

    name: str

    async def handle(self, batch: Sequence[Delivery]) -> None:
        """Durably write the batch before returning. Idempotent by event_id (a redelivery writes nothing
        new). Raise to have the whole batch redelivered; never swallow a failed write."""


@dataclass
class RunnerStats:
    fetched: int = 0
    handled: int = 0
    batches: int = 0
    handler_failures: int = 0
    fetch_errors: int = 0
    dead_lettered: dict[str, int] = field(default_factory=dict)
    last_stream_seq: int = 0
    last_error: str | None = None


class Rejected(Exception):
    """A message the observer must never see, and why."""

    def __init__(self, reason: DeadLetterReason, error: str, event: Envelope | None = None) -> None:
        super().__init__(error)
        self.reason = reason
        self.error = error
        self.event = event


def _header_safe(text: str, limit: int = 1024) -> str:
    return " ".join(text.split())[:limit]


class ConsumerRunner:
    """Runs one observer on one durable consumer. `run()` loops until cancelled; errors are counted,
    logged at WARNING or above and retried; an empty fetch changes nothing."""

    def __init__(
        self,
        nc: NatsClient,
        observer: Observer,
        *,
        filter_subject: str = "epi.>",
        batch_size: int = 256,
        fetch_timeout_s: float = 1.0,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        redelivery_delays_s: Sequence[float] = (0.5, 2.0, 5.0, 15.0),
        registry: AgentRegistry | None = None,
    ) -> None:
        if not CONSUMER_PATTERN.match(observer.name):
            raise ValueError(f"observer name {observer.name!r} must match {CONSUMER_PATTERN.pattern}")
        self.nc = nc
        self.js = nc.jetstream()
        self.observer = observer
        self.filter_subject = filter_subject
        self.batch_size = batch_size
        self.fetch_timeout_s = fetch_timeout_s
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.redelivery_delays_s = tuple(redelivery_delays_s)
        self.registry = registry or AgentRegistry(self.js)
        self.stats = RunnerStats()
        self._subscription: nats.js.JetStreamContext.PullSubscription | None = None
        self._stepping = asyncio.Lock()  # two fetches on one pull subscription would steal each other's replies

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.observer.name,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=self.filter_subject,
            max_deliver=self.max_deliver,
            ack_wait=self.ack_wait_s,
            max_ack_pending=self.batch_size * 8,
        )

    async def _subscribe(self) -> nats.js.JetStreamContext.PullSubscription:
        if self._subscription is None:
            async with asyncio.timeout(10):
                self._subscription = await self.js.pull_subscribe(
                    self.filter_subject, durable=self.observer.name, stream=STREAM, config=self.consumer_config()
                )
        return self._subscription

    async def run(self) -> None:
        backoff_s = 0.0
        while True:
            if backoff_s:
                await asyncio.sleep(backoff_s)
            try:
                await self.step()
                backoff_s = 0.0
            except RETRYABLE as e:
                self.stats.fetch_errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                log.warning("runner %s: %s; retrying (nothing acked, nothing lost)", self.observer.name, e)
                if isinstance(e, nats.js.errors.NotFoundError):
                    self._subscription = None  # the consumer is gone (new server?): create it again
                backoff_s = min(5.0, max(0.2, backoff_s * 2))

    async def step(self) -> int:
        """Fetch one batch and process it. Returns how many messages were fetched (0 = nothing yet)."""
        async with self._stepping:
            subscription = await self._subscribe()
            try:
                messages = await subscription.fetch(self.batch_size, timeout=self.fetch_timeout_s)
            except TimeoutError:
                # nats.errors.TimeoutError and a plain asyncio.TimeoutError (nats-py 2.16 _fetch_n) both mean
                # "no messages yet" (DESIGN §6); it resets nothing.
                return 0
            await self.process(messages)
            return len(messages)

    async def process(self, messages: Sequence[Msg]) -> None:
        self.stats.fetched += len(messages)
        admitted: list[tuple[Msg, Delivery]] = []
        for msg in messages:
            try:
                admitted.append((msg, await self.admit(msg)))
            except Rejected as rejection:
                await self.dead_letter(msg, rejection.reason, rejection.error)
            except Unavailable as e:
                await msg.nak(delay=self._delay(msg))  # the key registry did not answer: try again later
                self.stats.last_error = str(e)
        if not admitted:
            return
        try:
            await self.observer.handle([delivery for _, delivery in admitted])
        except Exception as e:  # noqa: BLE001 - counted, logged, redelivered, dead-lettered at MaxDeliver
            self.stats.handler_failures += 1
            self.stats.last_error = f"{type(e).__name__}: {e}"
            log.error("observer %s failed on a batch of %d: %s", self.observer.name, len(admitted), e)
            for msg, delivery in admitted:
                if delivery.num_delivered >= self.max_deliver:
                    await self.dead_letter(msg, DeadLetterReason.max_deliver, f"{type(e).__name__}: {e}")
                else:
                    await msg.nak(delay=self._delay(msg))
            return
        for msg, delivery in admitted:
            await msg.ack()
            self.stats.last_stream_seq = max(self.stats.last_stream_seq, delivery.stream_seq)
        self.stats.handled += len(admitted)
        self.stats.batches += 1

    def _delay(self, msg: Msg) -> float:
        attempt = msg.metadata.num_delivered
        return self.redelivery_delays_s[min(attempt, len(self.redelivery_delays_s)) - 1]

    async def admit(self, msg: Msg) -> Delivery:
        """Validate one message. Raises Rejected (dead-letter it) or Unavailable (retry it)."""
        event = admit_event(msg.subject, msg.data)
        try:
            await self.registry.bind(event.actor)
        except Conflict as e:
            raise Rejected(DeadLetterReason.unknown_actor_key, str(e), event) from e
        metadata = msg.metadata
        return Delivery(event, msg.subject, metadata.sequence.stream, metadata.num_delivered)

    async def dead_letter(self, msg: Msg, reason: DeadLetterReason, error: str) -> None:
        """Keep the message in EPI_DLQ with the reason, then ack it. If the DLQ does not answer, the message
        is not acked and comes back: a dead letter is never dropped."""
        seq = msg.metadata.sequence.stream
        headers = {
            "Nats-Msg-Id": f"{self.observer.name}:{seq}",  # a retried dead-lettering is stored once
            DLQ_REASON: reason.value,
            DLQ_ERROR: _header_safe(error),
            DLQ_SUBJECT: msg.subject,
            DLQ_STREAM_SEQ: str(seq),
            DLQ_CONSUMER: self.observer.name,
            DLQ_AT: datetime.now(UTC).isoformat(),
        }
        subject = dlq_subject(self.observer.name, reason.value)
        try:
            async with asyncio.timeout(10):
                await self.js.publish(subject, msg.data, headers=headers)
        except NATS_OR_API_ERROR as e:
            failure = translate_publish_error(e, subject)
            log.error("dead-lettering stream seq %d failed (%s); it will be redelivered", seq, failure)
            await msg.nak(delay=self._delay(msg))
            return
        await msg.ack()
        self.stats.dead_lettered[reason.value] = self.stats.dead_lettered.get(reason.value, 0) + 1
        log.warning("dead-lettered stream seq %d on %s: %s: %s", seq, msg.subject, reason.value, error)


def admit_event(subject: str, data: bytes) -> Envelope:
    """Decode, check the subject and the signature. Raises Rejected with the reason."""
    try:
        event = decode_event(data)
    except InvalidEvent as e:
        raise Rejected(DeadLetterReason.invalid_event, str(e)) from e
    expected = event_subject(event.project, event.kind, event.artifact_id)
    if subject != expected:
        raise Rejected(DeadLetterReason.subject_mismatch, f"subject {subject} != {expected}", event)
    try:
        verify_signature(event)
    except InvalidEvent as e:
        raise Rejected(DeadLetterReason.bad_signature, str(e), event) from e
    return event
