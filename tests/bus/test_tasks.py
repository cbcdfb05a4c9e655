"""Stopping background loops for sure, even a loop whose first cancellation is swallowed on the way (as
nats-py's fetch can in Python 3.11): the shape the node's mirror and the mesh coordinator run in."""

from __future__ import annotations

import asyncio

import pytest

from bus.broker.loops import cancel_and_wait, run_together
from tests.support import eventually


class Loop:
    """A polling loop that swallows `swallow` cancellations before it lets one through."""

    def __init__(self, swallow: int) -> None:
        self.swallow = swallow
        self.rounds = 0
        self.stopped = False

    async def run(self) -> None:
        try:
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if self.swallow == 0:
                        raise
                    self.swallow -= 1  # a library turned it into an error the loop retries on
                self.rounds += 1
        finally:
            self.stopped = True


async def test_a_cancelled_run_together_stops_a_loop_that_swallowed_its_first_cancellation() -> None:
    stubborn, plain = Loop(swallow=3), Loop(swallow=0)
    running = asyncio.create_task(run_together({"stubborn": stubborn.run(), "plain": plain.run()}))
    await eventually(lambda: stubborn.rounds >= 3, interval_s=0.01)
    await cancel_and_wait([running], timeout_s=5)
    assert running.cancelled()
    assert stubborn.stopped
    assert plain.stopped
    rounds = stubborn.rounds
    await asyncio.sleep(0.05)
    assert stubborn.rounds == rounds  # nothing runs on after the stop


async def test_a_task_group_would_have_waited_on_that_loop_for_ever() -> None:
    """Why run_together exists: the 3.11 TaskGroup cancels its children once, however often it is cancelled."""
    stubborn = Loop(swallow=1)

    async def grouped() -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(stubborn.run())

    running = asyncio.create_task(grouped())
    await eventually(lambda: stubborn.rounds >= 2, interval_s=0.01)
    await cancel_and_wait([running], timeout_s=0.5)
    assert not running.done()
    assert not stubborn.stopped
    stubborn.swallow = 0
    await cancel_and_wait([running], timeout_s=0.5)  # still stuck: the group never cancels its child again
    assert not running.done()
    for task in asyncio.all_tasks():
        if task.get_coro().__qualname__ == "Loop.run":  # type: ignore[union-attr]
            task.cancel()
    await cancel_and_wait([running], timeout_s=5)
    assert stubborn.stopped


async def test_a_failing_loop_stops_the_others_and_its_error_is_raised() -> None:
    plain = Loop(swallow=0)

    async def broken() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("the loop broke")

    with pytest.raises(RuntimeError, match="the loop broke"):
        await asyncio.wait_for(run_together({"plain": plain.run(), "broken": broken()}), timeout=5)
    assert plain.stopped


async def test_a_task_that_will_not_stop_is_reported_with_where_it_waits(caplog: pytest.LogCaptureFixture) -> None:
    stubborn = Loop(swallow=10_000)
    running = asyncio.create_task(stubborn.run(), name="stubborn loop")
    await asyncio.sleep(0.02)
    await cancel_and_wait([running], timeout_s=0.3)
    assert "background task stubborn loop did not stop" in caplog.text
    assert "in run" in caplog.text  # the stack names the frame it is stuck in
    stubborn.swallow = 0
    await cancel_and_wait([running], timeout_s=5)
    assert running.done()
