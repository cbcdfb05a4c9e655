"""`epibus health`'s lines from a node's report, without a node: what they say when the server did not
answer how far an observer got."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bus.host.home import NodeInfo
from epibus.cli.health import _rows
from epibus.monitoring.health import problems


def report_with(observer: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "n1",
        "pid": os.getpid(),
        "at": datetime.now(UTC).isoformat(),
        "nats": {"connected": True, "url": "nats://127.0.0.1:4222"},
        "observers": {"journal-1": observer},
    }


def test_a_stall_whose_pending_count_the_server_did_not_give_says_so_instead_of_none(tmp_path: Path) -> None:
    info = NodeInfo(os.getpid(), "nats://127.0.0.1:4222", None, "sqlite://", "outbox.db", True, "now", "n1")
    stalled = {"stalled": True, "pending": None, "stalled_for_s": 20.0, "last_error": "consumer info: TimeoutError"}
    (line,) = problems(tmp_path, info, report_with(stalled))
    assert line == (
        "observer journal-1 stalled: the server does not say what waits and nothing was acked for 20.0s "
        "(last error: consumer info: TimeoutError)"
    )
    assert _rows(report_with(stalled))[-1][1].startswith("STALLED; pending unknown, ")
    (counted,) = problems(tmp_path, info, report_with(stalled | {"pending": 3}))
    assert counted.startswith("observer journal-1 stalled: 3 messages wait and nothing was acked for 20.0s")
