"""`epibus health`: the local node's own report on itself, with an exit code for scripts and supervisors."""

from __future__ import annotations

from typing import Any

import typer

from bus.host.home import epibus_home, read_node_info
from epibus.cli.common import HomeOpt, JsonOpt, console, emit_json, fail, handles_errors, table
from epibus.cli.display import shown
from epibus.monitoring.health import problems, read_health


@handles_errors
def health(home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Is the local node well? Exit 0 when it is; exit 1 with one line per problem when its NATS connection is
    down, an observer is stalled or degraded, a stream drifted, it stopped reporting, or no node runs."""
    where = epibus_home(home)
    info = read_node_info(where)
    report = read_health(where) if info is not None else None
    found = problems(where, info, report)
    if as_json:
        emit_json({"ok": not found, "problems": found, "report": report})
    elif report is not None:
        console.print(table(f"epibus node {report.get('name')}", ["what", "state"], _rows(report)))
    if found and as_json:
        raise typer.Exit(1)
    if found:
        for problem in found[:-1]:
            console.print(shown(("unhealthy:", "bold red"), " ", problem))
        raise fail(found[-1], as_json=False)
    if not as_json:
        console.print(shown(("healthy", "green")))


def _rows(report: dict[str, Any]) -> list[list[Any]]:
    nats = report.get("nats") or {}
    rows: list[list[Any]] = [
        ["nats", f"{'connected' if nats.get('connected') else 'DOWN'} {nats.get('url')}"],
        ["connection restarts", nats.get("connection_restarts")],
        ["server restarts", nats.get("server_restarts")],
        ["streams", (report.get("streams") or {}).get("drift") or "ok"],
    ]
    for name, stats in sorted((report.get("observers") or {}).items()):
        state = "STALLED" if stats.get("stalled") else "degraded" if stats.get("degraded") else "ok"
        pending = "unknown" if stats.get("pending") is None else stats.get("pending")
        rows.append(
            [
                f"observer {name}",
                f"{state}; pending {pending}, handled {stats.get('handled')}, "
                f"dead-lettered {sum((stats.get('dead_lettered') or {}).values())}, "
                f"internal errors {stats.get('internal_errors')}",
            ]
        )
    for name, count in sorted((report.get("service_failures") or {}).items()):
        rows.append([f"{name} failures", count])
    return rows
