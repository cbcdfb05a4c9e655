"""Stopping background loops for sure. In Python 3.11, asyncio.wait_for (used inside nats-py's fetch) can
swallow a cancellation that lands as its inner wait completes (CPython gh-86296), and nats-py's next_msg turns
one into ConnectionClosedError when the connection is closing; a loop that retries on those errors would then
run on, and a node asked to stop would never exit. So cancellation is repeated until the tasks are done."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(tasks: Sequence[asyncio.Task[Any]], *, timeout_s: float = 10.0) -> None:
    """Cancel the tasks and keep cancelling until every one has finished; log any still running after
    timeout_s (they are left to the event loop's own shutdown, which cancels them once more)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = [t for t in tasks if not t.done()]
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.2)
        pending = [t for t in pending if not t.done()]
    for task in pending:
        log.error(
            "background task %s did not stop within %.0fs; it is at:\n%s", task.get_name(), timeout_s, where(task)
        )


def where(task: asyncio.Task[Any]) -> str:
    """The task's stack, innermost frame last: what a task that will not stop is waiting on."""
    out = io.StringIO()
    task.print_stack(file=out)
    return out.getvalue()


async def run_together(loops: Mapping[str, Awaitable[None]]) -> None:
    """Run loops side by side until one fails (its error is raised) or this task is cancelled; either way every
    loop is stopped for sure before this returns. Not a TaskGroup: in 3.11 a group cancels its children once,
    and a child whose cancellation nats-py swallowed would run on, and the group would wait on it for ever."""
    tasks = [asyncio.ensure_future(loop) for loop in loops.values()]
    for name, task in zip(loops, tasks, strict=True):
        task.set_name(name)
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        await stop_all(tasks)


async def stop_all(tasks: Sequence[asyncio.Task[Any]], *, timeout_s: float = 10.0) -> None:
    """cancel_and_wait that a second cancellation of the caller cannot cut short: the caller's own
    cancellation is raised once the tasks have ended (or timeout_s has passed), so whoever awaited the caller
    never sees it done while its loops still run."""
    for task in tasks:  # at once: each loop gets one cancel even if the wait below is interrupted
        task.cancel()
    stopping = asyncio.ensure_future(cancel_and_wait(tasks, timeout_s=timeout_s))
    cancelled: asyncio.CancelledError | None = None
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError as e:
            cancelled = e  # kept and raised below; bounded by cancel_and_wait's own deadline
    if cancelled is not None:
        raise cancelled
