"""Stopping background loops for sure. In Python 3.11, asyncio.wait_for (used inside nats-py's fetch) can
swallow a cancellation that lands as its inner wait completes (CPython gh-86296), and nats-py's next_msg turns
one into ConnectionClosedError when the connection is closing; a loop that retries on those errors would then
run on, and a node asked to stop would never exit. So cancellation is repeated until the tasks are done."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
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
        log.error("background task %s did not stop within %.0fs", task.get_name(), timeout_s)
