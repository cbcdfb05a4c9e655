"""Failpoints say when they fired: a chaos fault that held while nothing touched the failing store proved
nothing, so the run waits for the first refusal and the node logs it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bus.errors import Unavailable
from epibus.node import failpoints
from epibus.node.failpoints import UnavailableWhenArmed
from observers.mirror.backends import open_store


async def test_an_armed_mirror_failpoint_records_and_logs_its_first_refusal_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    home = tmp_path / "home"
    inner = await open_store("edge", tmp_path / "mirror", "m", 4)
    try:
        store = UnavailableWhenArmed(inner, home)
        assert await store.retrieve([uuid.uuid4()]) == []  # disarmed: the real store answers
        failpoints.arm(home, "mirror-unavailable")
        assert not failpoints.was_hit(home, "mirror-unavailable")
        for _ in range(3):
            with pytest.raises(Unavailable, match="failpoint mirror-unavailable is armed"):
                await store.retrieve([uuid.uuid4()])
        assert failpoints.was_hit(home, "mirror-unavailable")
        fired = [r for r in caplog.records if r.getMessage().startswith("failpoint mirror-unavailable is armed")]
        assert len(fired) == 1
        failpoints.disarm(home, "mirror-unavailable")
        assert await store.retrieve([uuid.uuid4()]) == []
        failpoints.arm(home, "mirror-unavailable")  # armed again: it has not fired yet
        assert not failpoints.was_hit(home, "mirror-unavailable")
    finally:
        await inner.close()
