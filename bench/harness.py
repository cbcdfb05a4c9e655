"""What every row of `python -m bench` shares: sizes, a fresh nats-server per row, waiting with stall
detection, the figures of a row, the machine it ran on, the table and bench/results.json."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from bus.host.server import NatsServer, nats_server_binary

STALL_S = 5.0  # no progress for this long while waiting counts as a stall, reported with the row


@dataclass(frozen=True)
class Sizes:
    events: int  # live publish -> journaled, drain, publish_many
    mirror_texts: int
    recall_events: int  # indexed on the node before recalls from a client
    recalls: int
    safe_points: int  # points in the store for the safe recall p99
    safe_queries: int
    state_small: int  # events in the small project for the state change
    state_large: int
    state_repeats: int
    cli_repeats: int
    mesh: tuple[tuple[int, int, int], ...]  # (peers, tasks per peer, in flight per peer)
    catch_up: int  # claims a first and then a second node catch up on
    scale_points: int = 0  # points for the safe recall row at scale (0: no such row)
    watches: int = 1_000  # standing questions the watch row's node holds
    watch_claims: int = 3_000  # claims published at 200/s against them, then in bursts for the ingest ratio


SIZES = {
    "quick": Sizes(
        events=3_000,
        mirror_texts=400,
        recall_events=300,
        recalls=30,
        safe_points=20_000,
        safe_queries=200,
        state_small=100,
        state_large=2_000,
        state_repeats=3,
        cli_repeats=2,
        mesh=((2, 5, 1), (8, 2, 1)),
        catch_up=1_000,
    ),
    "full": Sizes(
        events=20_000,
        mirror_texts=2_000,
        recall_events=20_000,
        recalls=200,
        safe_points=100_000,
        safe_queries=500,
        state_small=100,
        state_large=100_000,
        state_repeats=5,
        cli_repeats=3,
        mesh=((2, 25, 1), (8, 15, 2)),
        catch_up=5_000,
        scale_points=1_000_000,
        watch_claims=6_000,
    ),
    # For the smoke test: seconds, not minutes; the figures mean nothing at this size.
    "tiny": Sizes(
        events=200,
        mirror_texts=32,
        recall_events=20,
        recalls=5,
        safe_points=500,
        safe_queries=20,
        state_small=10,
        state_large=40,
        state_repeats=1,
        cli_repeats=1,
        mesh=((2, 2, 1),),
        catch_up=40,
        watches=40,
        watch_claims=100,
    ),
}


@dataclass
class Line:
    """One figure of a row against its baseline measured in the same run on the same server.

    ratio is defined per line by `ratio_is` (throughput: epibus / baseline, higher is better; latency:
    baseline / epibus; state change: large / small, 1.0 is flat); `met` is None where no target applies."""

    row: str
    what: str
    unit: str
    epibus: float | None
    baseline: float | None
    baseline_what: str
    ratio: float | None
    ratio_is: str
    target: str
    met: bool | None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def throughput(
    row: str,
    what: str,
    epibus_per_s: float,
    baseline_what: str,
    baseline_per_s: float,
    *,
    target: float | None,
    unit: str = "ev/s",
    details: dict[str, Any] | None = None,
) -> Line:
    ratio = epibus_per_s / baseline_per_s
    return Line(
        row,
        what,
        unit,
        epibus_per_s,
        baseline_per_s,
        baseline_what,
        ratio,
        "epibus / baseline",
        "—" if target is None else f"≥ {target}",
        None if target is None else ratio >= target,
        details or {},
    )


def latency(
    row: str,
    what: str,
    epibus_ms: float,
    baseline_what: str,
    baseline_ms: float | None,
    *,
    limit_ms: float | None,
    details: dict[str, Any] | None = None,
) -> Line:
    ratio = None if baseline_ms is None else baseline_ms / epibus_ms
    return Line(
        row,
        what,
        "ms",
        epibus_ms,
        baseline_ms,
        baseline_what,
        ratio,
        "baseline / epibus",
        "—" if limit_ms is None else f"≤ {limit_ms:g} ms",
        None if limit_ms is None else epibus_ms <= limit_ms,
        details or {},
    )


def failed(row: str, error: BaseException) -> Line:
    return Line(row, "failed", "", None, None, "", None, "", "", False, {}, f"{type(error).__name__}: {error}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        raise ValueError("no values to take a percentile of")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# The targets are stated with the server's default sync (fsync every 2 min); `--sync always` measures the
# deployed setting, where every row becomes fsync-bound and the ratios say more about the disk than the code.
SERVER_SYNC = {"mode": "default"}


@contextlib.contextmanager
def fresh_server(root: Path) -> Iterator[NatsServer]:
    """A nats-server of the row's own (JetStream, the sync `--sync` chose), stopped on any exit."""
    server = NatsServer(root / "nats", sync_always=SERVER_SYNC["mode"] == "always")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="epibus-bench-") as tmp:
        yield Path(tmp)


@dataclass
class Waited:
    seconds: float
    reached: int
    stalls: list[float]  # each gap without progress longer than STALL_S, in seconds
    finished: bool


async def wait_for_count(count: Callable[[], Awaitable[int]], n: int, *, start: float, deadline_s: float) -> Waited:
    """Poll count() until it reaches n or deadline_s passes since start; gaps without progress over STALL_S are
    recorded, never hidden. A run that misses the deadline returns finished=False with what it reached."""
    import asyncio

    reached, last_progress, stalls = 0, time.perf_counter(), []
    while True:
        now_count = await count()
        now = time.perf_counter()
        if now_count > reached:
            if now - last_progress > STALL_S:
                stalls.append(round(now - last_progress, 2))
            reached, last_progress = now_count, now
        if reached >= n:
            return Waited(now - start, reached, stalls, True)
        if now - start > deadline_s:
            stalls.append(round(now - last_progress, 2))
            return Waited(now - start, reached, stalls, False)
        await asyncio.sleep(0.02)


def machine() -> dict[str, Any]:
    binary = nats_server_binary()
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10, check=True)
    return {
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "nats_server": version.stdout.strip(),
        "server_sync": SERVER_SYNC["mode"],
    }


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "ms" or unit == "s":
        return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:,.1f} {unit}"


def _without_stalls(line: Line) -> str:
    busy = line.details.get("faststream_per_s_without_stalls")
    if not line.details.get("stalls", {}) or "FastStream" not in line.details["stalls"] or busy is None:
        return ""
    return f" ({_figure(busy, line.unit)} less its stalls)"


def table(lines: list[Line], title: str) -> Table:
    caption = "ratio: throughput epibus/baseline; latency baseline/epibus; state change large/small (1.0 = flat)"
    t = Table(title=title, caption=caption, show_lines=False)
    for column in ("row", "epibus", "figure", "baseline (same run)", "figure", "ratio", "target", "met"):
        t.add_column(column, overflow="fold")
    for line in lines:
        if line.error is not None:
            t.add_row(line.row, f"[red]{line.error}[/red]", "", "", "", "", "", "[red]error[/red]")
            continue
        met = "—" if line.met is None else ("[green]yes[/green]" if line.met else "[red]no[/red]")
        stalls = line.details.get("stalls")
        what = line.what
        for side, gaps in (stalls or {}).items():
            what += f" [red]({side} stalled >{STALL_S:g} s: {', '.join(f'{g:g} s' for g in gaps)})[/red]"
        t.add_row(
            line.row,
            what,
            _figure(line.epibus, line.unit),
            line.baseline_what,
            _figure(line.baseline, line.unit) + _without_stalls(line),
            "—" if line.ratio is None else f"{line.ratio:.2f}",
            line.target,
            met,
        )
    return t


def markdown(lines: list[Line], info: dict[str, Any], mode: str) -> str:
    """The table as the README shows it, with the machine it ran on."""
    load = ", ".join(f"{x:.2f}" for x in info["load_average"])
    out = [
        f"`python -m bench --{mode}` on {info['cpu_count']} CPUs ({info['processor']}), load average {load} at start, "
        f"{info['nats_server']} (sync: {info.get('server_sync', 'always')}), Python {info['python']}.",
        "",
        "| row | epibus | figure | baseline (same run) | figure | ratio | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        if line.error is not None:
            out.append(f"| {line.row} | failed: {line.error} | | | | | | error |")
            continue
        met = "—" if line.met is None else ("yes" if line.met else "no")
        stalls = "".join(
            f" ({side} stalled >{STALL_S:g} s: {', '.join(f'{g:g} s' for g in gaps)})"
            for side, gaps in (line.details.get("stalls") or {}).items()
        )
        ratio = "—" if line.ratio is None else f"{line.ratio:.2f}"
        out.append(
            f"| {line.row} | {line.what}{stalls} | {_figure(line.epibus, line.unit)} | {line.baseline_what} | "
            f"{_figure(line.baseline, line.unit)}{_without_stalls(line)} | {ratio} | {line.target} | {met} |"
        )
    return "\n".join(out) + "\n"


def results(mode: str, started: float, info: dict[str, Any], lines: list[Line]) -> dict[str, Any]:
    return {
        "mode": mode,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": info,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "rows": [asdict(line) for line in lines],
    }
