"""A node's service loops: each runs supervised (a failure is logged, counted and the loop restarted), all of
them in one task group, so one service never takes the others down and stopping the node stops them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from bus.broker.loops import cancel_and_wait
from bus.errors import EpibusError, error_summary

log = logging.getLogger(__name__)

# How often each supervised service failed since the process started (each failure is also logged).
service_failures: Counter[str] = Counter()


async def supervised(
    name: str, run: Callable[[], Awaitable[None]], *, restart_after_s: float = 5.0, max_backoff_s: float = 300.0
) -> None:
    """Run a service loop; if it fails, with an epibus error or a bug, log it loudly (where it was raised),
    count it in `service_failures` and start it again, so one service's failure never takes the node's other
    services (journal, forwarder, mirror) down with it. The wait doubles with each failure in a row, up to
    max_backoff_s; a run that lasted longer than that starts the count again. Cancellation is not caught."""
    loop = asyncio.get_running_loop()
    in_a_row = 0
    while True:
        started = loop.time()
        try:
            await run()
            return
        except EpibusError as e:
            failure = str(e)
        except Exception as e:  # noqa: BLE001 - a bug in one service must not stop the node: logged, counted, restarted
            failure = error_summary(e)
        in_a_row = 1 if loop.time() - started > max_backoff_s else in_a_row + 1
        delay_s = min(max_backoff_s, restart_after_s * 2 ** (in_a_row - 1))
        service_failures[name] += 1
        log.error("%s failed: %s; restarting in %gs", name, failure, delay_s)
        await asyncio.sleep(delay_s)


class Loops:
    """The task group a node's loops run in, and the tasks started in it (`tasks`: one list for the node's
    life, emptied in place when the loops stop, so a reference to it stays valid across restarts)."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []
        self._group: asyncio.TaskGroup | None = None

    async def open(self, stack: contextlib.AsyncExitStack) -> None:
        """Open the task group on `stack`: closing the stack waits for every loop started in it."""
        self._group = await stack.enter_async_context(asyncio.TaskGroup())

    def supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Start `run` as a loop of its own, restarted when it fails (see `supervised`)."""
        return self.start(name, supervised(name, run))

    def start(self, name: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start `work` (which supervises itself, or needs no supervision) in the group."""
        if self._group is None:
            work.close()
            raise RuntimeError(f"{name}: the node's loops are not open")
        task = self._group.create_task(work, name=name)
        self.tasks.append(task)
        return task

    async def stop(self) -> None:
        """Cancel every loop and wait for them; the group closes with the node's stack."""
        await cancel_and_wait(self.tasks)
        self.tasks.clear()
        self._group = None
