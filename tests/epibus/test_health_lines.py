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


def test_a_full_disk_and_a_damaged_store_are_each_one_line_with_what_to_do(tmp_path: Path) -> None:
    info = NodeInfo(os.getpid(), "nats://127.0.0.1:4222", None, "sqlite://", "outbox.db", True, "now", "n1")
    report = report_with({"stalled": False, "degraded": False}) | {
        "disk": {
            "home": {"path": "/srv/h", "free_bytes": 40 << 20, "reserve_bytes": 256 << 20, "full": True},
            "journal": {"path": "/data", "free_bytes": 9 << 30, "reserve_bytes": 256 << 20, "full": False},
        },
        "stores": {
            "journal": {"state": "ok"},
            "mirror": {
                "state": "damaged",
                "problem": "/srv/h/mirror: vector 31 is not readable",
                "remedy": "rebuild it from the stream with `epibus reindex`",
            },
        },
    }
    assert problems(tmp_path, info, report) == [
        "disk full (home): /srv/h has 40 MiB free, below the reserve of 256 MiB: the node writes nothing there and "
        "refuses publishes; free space there and it resumes by itself",
        "mirror damaged: /srv/h/mirror: vector 31 is not readable; rebuild it from the stream with `epibus reindex`",
    ]
