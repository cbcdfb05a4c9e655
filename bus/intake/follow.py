"""Following a stream live, across reconnects and server restarts: every matching message once, in stream order.

An ephemeral pull consumer reads from the last sequence handed out; when it errs or vanishes (a restarted server
drops it) a new one starts right after that sequence, and anything at or below it is skipped. nats-py's ordered
consumer is not used: it notices a restarted server only after two missed heartbeats (10 s), and when it had
delivered nothing yet it starts again from the stream's first message."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, broker_refusal, refused_at_once
from bus.broker.polling import Poller, fetch_batch
from bus.errors import Unavailable
from bus.intake.consumers import drop_consumer, pull_consumer
from bus.intake.stream_read import last_matching
from bus.subjects import js_api

log = logging.getLogger(__name__)
CONSUMER_CHECK_S = 3.0  # an idle follower confirms its consumer still exists this often
MAX_BACKOFF_S = 2.0


def resume_config(filter_subject: str, after_seq: int) -> ConsumerConfig:
    """An ephemeral pull consumer that starts right after `after_seq`: nothing to ack, gone when idle."""
    return ConsumerConfig(
        # Named, so nats-py puts the filter in the create request's subject, where the broker checks it.
        name=f"follow_{secrets.token_hex(8)}",
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after_seq + 1,
        filter_subject=filter_subject,
        inactive_threshold=60.0,
        mem_storage=True,
    )


class ResumingSubscription:
    """What every reader that resumes from a sequence on an ephemeral pull consumer shares: confirming now and
    then that the consumer still exists (a restarted server drops it while fetches just time out), and dropping
    it so the next poll starts a new one after the last sequence seen."""

    label: str = "follower"  # names the reader in log lines
    check_every_s: float = CONSUMER_CHECK_S

    def __init__(self) -> None:
        self._subscription: JetStreamContext.PullSubscription | None = None
        self._checked_at = time.monotonic()

    async def _confirm_consumer(self, subscription: JetStreamContext.PullSubscription) -> None:
        if time.monotonic() - self._checked_at < self.check_every_s:
            return
        self._checked_at = time.monotonic()
        async with asyncio.timeout(JS_TIMEOUT_S):
            await subscription.consumer_info()

    async def _drop_subscription(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await drop_consumer(subscription._js, subscription)  # nats-py keeps its context there


@dataclass
class FollowStats:
    delivered: int = 0
    skipped_seen: int = 0  # messages at or below the last sequence that a new consumer delivered again
    resubscribed: int = 0
    errors: int = 0
    last_error: str | None = None


class StreamFollower(ResumingSubscription):
    """`async for msg in StreamFollower(js, STREAM, subject).messages():` from `start_seq` (None: only messages
    newer than the stream's last one now). Raises Unavailable if the first subscription fails (no such stream,
    no server) or once the connection is closed for good; later errors are logged, counted and ridden out."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        filter_subject: str,
        *,
        start_seq: int | None = None,
        closed: Callable[[], bool],
        batch_size: int = 256,
        poll_timeout_s: float = 1.0,
    ) -> None:
        super().__init__()
        self.js = js
        self.stream = stream
        self.filter_subject = filter_subject
        self.start_seq = start_seq
        self.closed = closed  # True once the connection is closed for good (not merely reconnecting)
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.last_seq = 0  # the highest stream sequence handed out (or skipped as older than start_seq)
        self.stats = FollowStats()
        self.label = f"following {filter_subject}"

    async def messages(self) -> AsyncGenerator[Msg, None]:
        if self.start_seq is None:
            self.last_seq = await last_matching(self.js, self.stream, self.filter_subject)
        else:
            self.last_seq = max(0, self.start_seq - 1)
        create = js_api("CONSUMER.CREATE", self.stream, "")
        try:
            async with refused_at_once(self.js, f".{self.filter_subject}", prefix=create):
                await self._subscribe()
        except NATS_OR_API_ERROR as e:
            refusal = broker_refusal(self.js, f".{self.filter_subject}", prefix=create)
            raise refusal or Unavailable("nats", f"cannot follow {self.filter_subject} on {self.stream}: {e}") from e
        poller = Poller(
            self.label,
            recover=self._recover,
            closed=self.closed,
            max_backoff_s=MAX_BACKOFF_S,
            consequence="resuming after the last sequence handed out",
        )
        try:
            while True:
                for msg in await poller.next(self._poll):
                    seq = msg.metadata.sequence.stream
                    if seq <= self.last_seq:
                        self.stats.skipped_seen += 1
                        continue
                    self.last_seq = seq
                    self.stats.delivered += 1
                    yield msg
        finally:  # closed (aclosing) or cancelled: an agent's consumer slot is free at once, not when it idles out
            await self._drop_subscription()

    async def _recover(self, error: BaseException, failures_in_a_row: int) -> None:
        self.stats.errors += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        await self._drop_subscription()

    async def _poll(self) -> list[Msg]:
        subscription = await self._subscribe()
        messages = await fetch_batch(subscription, self.batch_size, self.poll_timeout_s)
        if not messages:
            await self._confirm_consumer(subscription)
            return []
        self._checked_at = time.monotonic()
        return messages

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        if self._subscription is None:
            config = resume_config(self.filter_subject, self.last_seq)
            self._subscription = await pull_consumer(self.js, self.stream, config)
            self.stats.resubscribed += 1
            self._checked_at = time.monotonic()
        return self._subscription
