"""The consumer runner every observer shares: a durable pull consumer on EPI that validates each message,
hands valid events to the observer in batches, acks only after the observer's durable write, and
dead-letters what it cannot use, with the reason."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.broker.nats_errors import NATS_OR_API_ERROR, RETRYABLE, translate_publish_error
from bus.broker.polling import Poller, fetch_batch
from bus.broker.streams import DLQ_MAX_MSG_BYTES
from bus.broker.tally import RunnerTally
from bus.enrolment.registry import AgentRegistry
from bus.errors import Unavailable, error_summary
from bus.intake.admission import Admission, Delivery, Refusal, Rejected, seconds_from_env
from bus.intake.batch_context import BatchContext
from bus.model.vocab import DeadLetterReason
from bus.subjects import (
    CONSUMER_PATTERN,
    DLQ_AT,
    DLQ_CONSUMER,
    DLQ_DIGEST,
    DLQ_ERROR,
    DLQ_REASON,
    DLQ_SIZE,
    DLQ_STREAM_SEQ,
    DLQ_SUBJECT,
    DLQ_TRUNCATED,
    EVENT_KEY_HEADER,
    EVENT_SIGNATURE_HEADER,
    MSG_ID_HEADER,
    STREAM,
    STREAM_SUBJECTS,
    dlq_subject,
)

log = logging.getLogger(__name__)
# Any failure to ask the server how far a consumer got: the progress is unknown, not stalled by itself.
PROGRESS_UNKNOWN: tuple[type[BaseException], ...] = (*NATS_OR_API_ERROR, nats.errors.Error)
STALL_AFTER_ENV = "EPIBUS_STALL_AFTER_S"
DEFAULT_STALL_AFTER_S = 120.0
# Fetch errors that mean the durable consumer no longer exists on the server.
CONSUMER_GONE: tuple[type[BaseException], ...] = (
    nats.js.errors.NotFoundError,
    nats.js.errors.ServiceUnavailableError,
)


class Observer(Protocol):
    """What the runner feeds. `name` is the durable consumer name: two runners of one observer share it."""

    name: str

    async def handle(self, batch: Sequence[Delivery]) -> Sequence[Refusal] | None:
        """Durably write the batch before returning. Idempotent by event_id (a redelivery writes nothing
        new). Raise to have the whole batch redelivered; never swallow a failed write. Returns the events the
        store refused for reusing a kept event id with other content (dead-lettered by the runner)."""


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
    degraded: bool = False  # the observer's store is down; events are held, not dead-lettered
    outage_retries: int = 0
    internal_errors: int = 0  # failures of the runner itself (bugs), each logged and retried
    # Progress as the server sees it (watch_progress): stalled = messages wait and the ack floor has not moved
    # for stall_after_s, whatever the cause (a stuck store, a closed connection, a bug).
    pending: int | None = None
    ack_floor_seq: int | None = None
    stalled: bool = False
    stalled_for_s: float = 0.0
    redelivered: int = 0  # messages fetched again after an earlier delivery (nak, ack wait, restart)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _header_safe(text: str, limit: int = 1024) -> str:
    return " ".join(text.split())[:limit]


def signature_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """A message's event signature headers, kept with its dead letter so `dlq replay` sends the event again as
    it came (any one a hostile publisher made too long is cut, and then refused again when replayed)."""
    kept = (EVENT_SIGNATURE_HEADER, EVENT_KEY_HEADER)
    return {name: _header_safe(value, 512) for name, value in (headers or {}).items() if name in kept}


def dead_letter_id(subject: str, data: bytes) -> str:
    """What names a bad message in the DLQ: its subject and bytes, hashed."""
    return hashlib.sha256(subject.encode("utf-8", "surrogateescape") + b"\0" + data).hexdigest()


def dead_letter_copy(data: bytes, headers: Mapping[str, str], *, max_payload: int) -> tuple[bytes, dict[str, str]]:
    """What of a message goes to the DLQ, and its headers: `headers` plus its digest and size; the whole message
    when it fits the DLQ's limits, else a prefix (marked truncated), so one huge message never makes the
    dead-lettering itself fail, or exceed the connection's max payload, which makes the server close it.
    `headers` is left as it was."""
    copied = {**headers, DLQ_DIGEST: hashlib.sha256(data).hexdigest(), DLQ_SIZE: str(len(data))}
    header_bytes = sum(len(k) + len(v) + 4 for k, v in copied.items()) + 64  # + "NATS/1.0" line, Nats-Expected-Stream
    room = min(max_payload, DLQ_MAX_MSG_BYTES) - header_bytes - len(DLQ_TRUNCATED) - 32
    if len(data) <= room:
        return data, copied
    return data[:room], {**copied, DLQ_TRUNCATED: str(room)}


class ConsumerRunner:
    """Runs one observer on one durable consumer. `run()` loops until cancelled; errors are counted,
    logged at WARNING or above and retried; an empty fetch changes nothing."""

    def __init__(
        self,
        nc: NatsClient,
        observer: Observer,
        *,
        filter_subject: str = STREAM_SUBJECTS[0],
        batch_size: int = 256,
        fetch_timeout_s: float = 1.0,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        redelivery_delays_s: Sequence[float] = (0.5, 2.0, 5.0, 15.0),
        registry: AgentRegistry | None = None,
        start_seq: int | None = None,
        tally: RunnerTally | None = None,
    ) -> None:
        if not CONSUMER_PATTERN.fullmatch(observer.name):
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
        self.admission = Admission(registry or AgentRegistry(self.js))
        self.context = BatchContext(self.js, self.admission)
        self.start_seq = start_seq  # a new durable starts here (a rebuilt mirror already holds what is before)
        self.stats = RunnerStats()
        self.tally = tally or RunnerTally()  # a runner that replaces another (a reindex) may keep counting on
        self._subscription: nats.js.JetStreamContext.PullSubscription | None = None
        self._stepping = asyncio.Lock()  # two fetches on one pull subscription would steal each other's replies

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.observer.name,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL if self.start_seq is None else DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.start_seq,
            filter_subject=self.filter_subject,
            # -1: the server never stops redelivering; the runner enforces max_deliver itself, so a message
            # whose last allowed attempt ends in a nak (say the DLQ did not answer) comes back, not vanishes.
            max_deliver=-1,
            ack_wait=self.ack_wait_s,
            # One batch in flight per durable: runners sharing it take turns, so events apply in stream order.
            max_ack_pending=self.batch_size,
        )

    async def _subscribe(self) -> nats.js.JetStreamContext.PullSubscription:
        if self._subscription is None:
            async with asyncio.timeout(10):
                self._subscription = await self.js.pull_subscribe(
                    self.filter_subject, durable=self.observer.name, stream=STREAM, config=self.consumer_config()
                )
        return self._subscription

    async def run(self) -> None:
        poller = Poller(
            f"runner {self.observer.name}", recover=self._recover, bugs_too=True, consequence="retrying (nothing acked)"
        )
        await poller.forever(self.step)

    async def _recover(self, error: BaseException, failures_in_a_row: int) -> None:
        """Count the failed poll; recreate the subscription after a bug, a consumer that is gone (a new server,
        deleted) or three retryable failures in a row."""
        self.stats.last_error = error_summary(error)
        if isinstance(error, RETRYABLE):
            self.stats.fetch_errors += 1
            if failures_in_a_row < 3 and not isinstance(error, CONSUMER_GONE):
                return
        else:
            self.stats.internal_errors += 1
        await self._drop_subscription()

    async def watch_progress(self, *, interval_s: float = 5.0, stall_after_s: float | None = None) -> None:
        """Loops until cancelled: asks the server how far this observer's consumer has acked, and reports the
        observer as stalled (stats, one ERROR log line) when messages wait and the ack floor has not moved
        for stall_after_s; recovered, one INFO line."""
        limit_s = seconds_from_env(STALL_AFTER_ENV, DEFAULT_STALL_AFTER_S) if stall_after_s is None else stall_after_s
        loop = asyncio.get_running_loop()
        last_moved = loop.time()
        while True:
            await asyncio.sleep(interval_s)
            moved = await self._check_progress()
            now = loop.time()
            if moved:
                last_moved = now
            self.stats.stalled_for_s = round(now - last_moved, 1)
            stalled = self.stats.stalled_for_s >= limit_s
            if stalled and not self.stats.stalled:
                log.error(
                    "observer %s stalled: %s messages wait and nothing was acked for %.0fs (last error: %s)",
                    self.observer.name,
                    self.stats.pending if self.stats.pending is not None else "unknown",
                    self.stats.stalled_for_s,
                    self.stats.last_error,
                )
            elif self.stats.stalled and not stalled:
                log.info("observer %s advances again", self.observer.name)
            self.stats.stalled = stalled

    async def _check_progress(self) -> bool:
        """True when the observer is not behind: the ack floor moved, or nothing waits. A consumer that
        cannot be asked about counts as not moving."""
        try:
            async with asyncio.timeout(5):
                info = await self.js.consumer_info(STREAM, self.observer.name)
        except PROGRESS_UNKNOWN as e:
            self.stats.pending = None
            self.stats.last_error = self.stats.last_error or f"consumer info: {type(e).__name__} {e}"
            return False
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        pending = (info.num_pending or 0) + (info.num_ack_pending or 0)
        moved = floor != self.stats.ack_floor_seq or pending == 0
        self.stats.pending, self.stats.ack_floor_seq = pending, floor
        return moved

    async def acked_through(self) -> int:
        """The stream sequence up to which this observer has acked every message (its consumer's ack floor).
        Raises Unavailable when the server does not say within 5 s."""
        try:
            async with asyncio.timeout(5):
                info = await self.js.consumer_info(STREAM, self.observer.name)
        except PROGRESS_UNKNOWN as e:
            raise Unavailable("nats", f"consumer {self.observer.name}: {type(e).__name__} {e}") from e
        return info.ack_floor.stream_seq if info.ack_floor else 0

    async def _drop_subscription(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except RETRYABLE as e:  # the old inbox may already be gone with the connection
                log.info("runner %s: dropping the old subscription: %s", self.observer.name, e)

    async def step(self) -> int:
        """Fetch one batch and process it. Returns how many messages were fetched (0 = nothing yet)."""
        async with self._stepping:
            subscription = await self._subscribe()
            messages = await fetch_batch(subscription, self.batch_size, self.fetch_timeout_s)
            if messages:  # an empty poll resets nothing
                await self.process(messages)
            return len(messages)

    async def process(self, messages: Sequence[Msg]) -> None:
        """Admit, hand over and ack in stream order. A message that must be retried holds everything after it
        in the batch too (nak'ed with the same delay): an observer never sees a change before its claim."""
        self.stats.fetched += len(messages)
        self.stats.redelivered += sum(1 for msg in messages if msg.metadata.num_delivered > 1)
        admitted: list[tuple[Msg, Delivery]] = []
        rejected: list[tuple[Msg, Rejected]] = []
        await self._admit_in_order(messages, admitted, rejected)
        # Dead letters change no state, so their order does not matter: publish them together.
        await asyncio.gather(*(self.dead_letter(msg, r.reason, r.error) for msg, r in rejected))
        if not admitted:
            return
        try:
            deliveries = await self.context.attach([delivery for _, delivery in admitted])
        except Unavailable as e:  # the stream did not say what was forgotten or who was enrolled: the batch waits
            self.stats.last_error = str(e)
            await self._hold([msg for msg, _ in admitted])
            return
        admitted = [(msg, delivery) for (msg, _), delivery in zip(admitted, deliveries, strict=True)]
        try:
            await self._handle_through_outages(admitted)
        except Exception as e:  # noqa: BLE001 - not an outage: find the poison event, redeliver the rest
            self.stats.handler_failures += 1
            self.stats.last_error = f"{type(e).__name__}: {e}"
            log.error("observer %s failed on a batch of %d: %s", self.observer.name, len(admitted), e)
            if len(admitted) == 1:
                await self._dead_letter_if_spent(admitted[0][0], e)
            else:
                await self._one_at_a_time(admitted)
            return
        self.stats.batches += 1

    async def _admit_in_order(
        self, messages: Sequence[Msg], admitted: list[tuple[Msg, Delivery]], rejected: list[tuple[Msg, Rejected]]
    ) -> None:
        # Checked together (signatures on threads), then admitted one by one in stream order.
        checks = await self.admission.check_msgs(messages)
        for index, (msg, checked) in enumerate(zip(messages, checks, strict=True)):
            try:
                admitted.append((msg, await self.admission.admit_checked(msg, checked)))
            except Rejected as rejection:
                rejected.append((msg, rejection))
            except Unavailable as e:  # the key registry did not answer: this one and the rest, later
                self.stats.last_error = str(e)
                await self._hold(messages[index:])
                return
            except Exception as e:  # noqa: BLE001 - not the message's fault alone: spend a delivery, keep order
                self.stats.handler_failures += 1
                self.stats.last_error = error_summary(e)
                log.error("admitting stream seq %d failed: %s", msg.metadata.sequence.stream, self.stats.last_error)
                if not await self._dead_letter_if_spent(msg, e):
                    await self._hold(messages[index + 1 :], delay_of=msg)
                    return

    async def _one_at_a_time(self, admitted: list[tuple[Msg, Delivery]]) -> None:
        """Only the event that fails on its own is held back, and with it everything after it; once it is
        dead-lettered (max_deliver), the rest go on without it, as on every other path."""
        for index, one in enumerate(admitted):
            try:
                await self._handle_through_outages([one])
            except Exception as single:  # noqa: BLE001 - counted, redelivered or dead-lettered
                self.stats.handler_failures += 1
                if not await self._dead_letter_if_spent(one[0], single):
                    await self._hold([msg for msg, _ in admitted[index + 1 :]], delay_of=one[0])
                    return

    async def _hold(self, messages: Sequence[Msg], *, delay_of: Msg | None = None) -> None:
        if not messages:
            return
        delay = self._delay(delay_of or messages[0])
        for msg in messages:
            await msg.nak(delay=delay)

    async def _handle_through_outages(self, admitted: list[tuple[Msg, Delivery]]) -> None:
        """Hand the batch to the observer and ack it after its durable write. While the observer reports
        Unavailable (its store is down) the batch is held and retried, and JetStream is told it is still in
        progress: an outage is waited out, reported as degraded, and never spends deliveries."""
        delay_s = 0.5
        while True:
            try:
                refusals = await self.observer.handle([delivery for _, delivery in admitted]) or ()
                break
            except Unavailable as e:
                self.stats.degraded = True
                self.stats.outage_retries += 1
                self.stats.last_error = str(e)
                log.warning("observer %s degraded, holding %d events: %s", self.observer.name, len(admitted), e)
                for msg, _ in admitted:
                    await msg.in_progress()
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, self.ack_wait_s / 3)
        self.stats.degraded = False
        refused = {r.stream_seq: r for r in refusals}
        self.tally.applied([delivery for _, delivery in admitted if delivery.stream_seq not in refused])
        for msg, delivery in admitted:
            refusal = refused.get(delivery.stream_seq)
            if refusal is not None:
                await self.dead_letter(msg, refusal.reason, refusal.error)
            else:
                await msg.ack()
            self.stats.last_stream_seq = max(self.stats.last_stream_seq, delivery.stream_seq)
        self.stats.handled += len(admitted) - len(refused)

    async def _dead_letter_if_spent(self, msg: Msg, error: Exception) -> bool:
        """True when the message was dead-lettered (it is out of the way), False when it will come back."""
        if msg.metadata.num_delivered >= self.max_deliver:
            return await self.dead_letter(msg, DeadLetterReason.max_deliver, error_summary(error))
        await msg.nak(delay=self._delay(msg))
        return False

    def _delay(self, msg: Msg) -> float:
        attempt = msg.metadata.num_delivered
        return self.redelivery_delays_s[min(attempt, len(self.redelivery_delays_s)) - 1]

    async def dead_letter(self, msg: Msg, reason: DeadLetterReason, error: str) -> bool:
        """Keep the message in EPI_DLQ with the reason, then ack it. If the DLQ does not answer, the message
        is not acked and comes back: a dead letter is never dropped."""
        seq = msg.metadata.sequence.stream
        headers = {
            # One copy per bad message (its stream sequence and bytes) and reason, whichever consumer on whichever
            # node refuses it first: not one per consumer. A replayed letter is a new message (a new sequence), so
            # its dead-lettering is kept, never deduplicated against the copy the replay removed.
            MSG_ID_HEADER: f"dlq:{reason.value}:{seq}:{dead_letter_id(msg.subject, msg.data)}",
            DLQ_REASON: reason.value,
            DLQ_ERROR: _header_safe(error),
            DLQ_SUBJECT: _header_safe(msg.subject, 512),
            DLQ_STREAM_SEQ: str(seq),
            DLQ_CONSUMER: self.observer.name,
            DLQ_AT: datetime.now(UTC).isoformat(),
        }
        headers |= signature_headers(msg.headers)
        data, headers = dead_letter_copy(msg.data, headers, max_payload=self.nc.max_payload)
        subject = dlq_subject(self.observer.name, reason.value)
        try:
            async with asyncio.timeout(10):
                await self.js.publish(subject, data, headers=headers)
        except NATS_OR_API_ERROR as e:
            failure = translate_publish_error(e, subject)
            log.error("dead-lettering stream seq %d failed (%s); it will be redelivered", seq, failure)
            await msg.nak(delay=self._delay(msg))
            return False
        await msg.ack()
        self.stats.dead_lettered[reason.value] = self.stats.dead_lettered.get(reason.value, 0) + 1
        self.tally.rejected(msg.subject, reason.value)
        log.warning("dead-lettered stream seq %d on %s: %s: %s", seq, msg.subject, reason.value, error)
        return True
