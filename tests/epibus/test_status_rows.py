"""`epibus status`'s lines from a node's report, without a node: the mirror's shards, old layout included."""

from __future__ import annotations

from typing import Any

from epibus.cli.ops import _status_rows


def report_with(shards: dict[str, int]) -> dict[str, Any]:
    return {
        "nats": {"reachable": True, "rtt_ms": 0.4, "server_version": "2.15.1"},
        "pid": 1,
        "server_pids": [2],
        "uptime_s": 5,
        "started_at": "now",
        "urls": {},
        "authenticated": True,
        "observers": {},
        "mirror": {
            "backend": "edge",
            "model": "m",
            "dimension": 384,
            "shards": shards,
            "seals": {"sealed": 4, "failures": 0, "last_error": None},
        },
        "outbox": {"depth": 0, "parked": 0},
    }


def shards_line(shards: dict[str, int]) -> str:
    (line,) = [value for name, value in _status_rows(report_with(shards)) if name == "mirror shards"]
    return str(line)


def test_sealed_shards_of_an_older_layout_are_said_never_silently_mixed() -> None:
    line = shards_line({"hot": 1, "frozen": 0, "sealed": 4, "outdated": 3})
    assert line == "4 sealed (3 of an older layout, being rebuilt), 0 sealing, 1 hot"


def test_a_mirror_all_in_the_current_layout_says_nothing_of_layouts() -> None:
    assert shards_line({"hot": 1, "frozen": 1, "sealed": 2, "outdated": 0}) == "2 sealed, 1 sealing, 1 hot"
