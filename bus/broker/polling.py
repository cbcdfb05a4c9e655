"""The one pull loop: fetch a batch ("nothing yet" is an empty batch, never an error) and ride out what NATS
throws at a long-lived reader (a lost connection, a restarted server, a vanished consumer) with bounded
backoff, counted and logged. The observers' runner, the stream follower and the mesh watcher all poll
through it, so they agree on what "nothing yet" is and on when to give up (a connection closed for good)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.broker.nats_errors import RETRYABLE
from bus.errors import Unavailable, error_summary

log = logging.getLogger(__name__)
T = TypeVar("T")
FIRST_BACKOFF_S = 0.2
BUG_BACKOFF_S = 0.5  # a bug is retried too (a node must not stop), but no faster than this


async def fetch_batch(subscription: JetStreamContext.PullSubscription, batch_size: int, timeout_s: float) -> list[Msg]:
    """Up to batch_size messages; [] when none arrived within timeout_s. nats-py 2.16 raises its own
    TimeoutError or a plain asyncio.TimeoutError (in `_fetch_n`) for that: both mean "nothing yet"."""
    try:
        return await subscription.fetch(batch_size, timeout=timeout_s)
    except TimeoutError:
        return []


Recover = Callable[[BaseException, int], Awaitable[None]]


class Poller:
    """Runs one poll until it succeeds. A retryable NATS error is logged, handed to `recover` (with how many
    polls in a row failed: it counts the error and drops the subscription when it should) and retried after a
    backoff that doubles up to max_backoff_s. A connection closed for good raises Unavailable: retrying would
    spin. `bugs_too`: any other exception is logged at ERROR and retried the same way (a node's observers must
    not stop on one bad batch); otherwise it is raised."""

    def __init__(
        self,
        what: str,
        *,
        recover: Recover,
        closed: Callable[[], bool] = lambda: False,
        max_backoff_s: float = 5.0,
        bugs_too: bool = False,
        consequence: str = "retrying",
    ) -> None:
        self.what = what
        self.recover = recover
        self.closed = closed
        self.max_backoff_s = max_backoff_s
        self.bugs_too = bugs_too
        self.consequence = consequence
        self.backoff_s = 0.0
        self.failures_in_a_row = 0

    async def next(self, poll: Callable[[], Awaitable[T]]) -> T:
        while True:
            if self.backoff_s:
                await asyncio.sleep(self.backoff_s)
            try:
                result = await poll()
            except RETRYABLE as e:
                if self.closed():
                    raise Unavailable("nats", f"{self.what}: the connection was closed ({e})") from e
                log.warning("%s: %s: %s; %s", self.what, type(e).__name__, e, self.consequence)
                await self._failed(e, FIRST_BACKOFF_S)
                continue
            except Exception as e:
                if not self.bugs_too:
                    raise
                log.error("%s failed: %s; %s", self.what, error_summary(e), self.consequence)
                await self._failed(e, BUG_BACKOFF_S)
                continue
            self.backoff_s, self.failures_in_a_row = 0.0, 0
            return result

    async def forever(self, poll: Callable[[], Awaitable[object]]) -> None:
        """Poll until cancelled (or the connection is closed for good: Unavailable)."""
        while True:
            await self.next(poll)

    async def _failed(self, error: BaseException, first_s: float) -> None:
        self.failures_in_a_row += 1
        self.backoff_s = min(self.max_backoff_s, max(first_s, self.backoff_s * 2))
        await self.recover(error, self.failures_in_a_row)
