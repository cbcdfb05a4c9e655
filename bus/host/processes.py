"""What /proc says of a process: whether it runs, and since when (a pid can be reused)."""

from __future__ import annotations

from pathlib import Path


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def alive(pid: int, started: int | None = None) -> bool:
    """True while pid runs (a zombie does not count) and, when given, started at `started` (not a reused pid)."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)
