"""A node's service loops under `supervised`: an unexpected error in one is logged with where it came from,
counted and restarted with backoff, never fatal to the node; a cancelled loop is not restarted."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from epibus.node.node import service_failures, supervised


async def test_a_service_that_raises_an_unexpected_error_is_logged_counted_and_restarted_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = f"flaky-{uuid.uuid4().hex[:8]}"
    calls = 0

    async def flaky() -> None:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise IndexError("tuple index out of range")

    caplog.set_level(logging.ERROR)
    await asyncio.wait_for(supervised(name, flaky, restart_after_s=0.01), timeout=10)
    assert calls == 4
    assert service_failures[name] == 3
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(name)]
    assert len(logged) == 3
    assert all("IndexError: tuple index out of range" in line and "in flaky" in line for line in logged)
    assert [line.split("restarting in ")[1].split("s")[0] for line in logged] == ["0.01", "0.02", "0.04"]


async def test_a_cancelled_service_propagates_its_cancellation_and_is_not_restarted() -> None:
    name = f"forever-{uuid.uuid4().hex[:8]}"
    started = asyncio.Event()
    calls = 0

    async def forever() -> None:
        nonlocal calls
        calls += 1
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(supervised(name, forever, restart_after_s=0.01))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1
    assert service_failures[name] == 0
