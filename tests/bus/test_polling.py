"""The one pull loop: "nothing yet" is an empty batch from a real server, a retryable error is ridden out and
counted, a connection closed for good ends the loop, and a bug is raised unless the caller asked to ride it out."""

from __future__ import annotations

from collections.abc import Iterator

import nats
import nats.errors
import pytest

from bus.broker.polling import Poller, fetch_batch
from bus.errors import Unavailable
from bus.host.server import NatsServer


async def test_an_empty_fetch_from_a_real_server_is_an_empty_batch(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="POLL", subjects=["poll.>"])
        subscription = await js.pull_subscribe("poll.>", durable="reader", stream="POLL")
        assert await fetch_batch(subscription, 10, 0.2) == []
        await js.publish("poll.one", b"x")
        assert [m.data for m in await fetch_batch(subscription, 10, 2.0)] == [b"x"]
    finally:
        await nc.close()


async def test_a_retryable_error_is_handed_to_recover_and_the_poll_retried() -> None:
    seen: list[tuple[str, int]] = []
    attempts: Iterator[Exception | str] = iter([nats.errors.NoServersError(), nats.errors.NoServersError(), "batch"])

    async def poll() -> str:
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def recover(error: BaseException, failures_in_a_row: int) -> None:
        seen.append((type(error).__name__, failures_in_a_row))

    poller = Poller("test", recover=recover, max_backoff_s=0.01)
    assert await poller.next(poll) == "batch"
    assert seen == [("NoServersError", 1), ("NoServersError", 2)]
    assert (poller.failures_in_a_row, poller.backoff_s) == (0, 0.0)


async def test_a_connection_closed_for_good_ends_the_loop_with_unavailable() -> None:
    async def poll() -> None:
        raise nats.errors.ConnectionClosedError

    async def recover(error: BaseException, failures_in_a_row: int) -> None:
        raise AssertionError("a closed connection is not retried")

    with pytest.raises(Unavailable, match="the connection was closed"):
        await Poller("test", recover=recover, closed=lambda: True).forever(poll)


async def test_a_bug_is_raised_unless_the_caller_rides_bugs_out() -> None:
    calls: list[int] = []

    async def poll() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("bug")
        return len(calls)

    async def recover(error: BaseException, failures_in_a_row: int) -> None:
        calls.append(0)

    with pytest.raises(KeyError):
        await Poller("test", recover=recover).next(poll)
    calls.clear()
    riding = Poller("test", recover=recover, bugs_too=True, max_backoff_s=0.01)
    assert await riding.next(poll) == 3  # the failed poll, its recovery, the poll that answered
