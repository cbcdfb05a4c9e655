"""`epibus statusline`: one short line for a shell prompt or an assistant's status bar, e.g.
`epibus up · outbox 0 · inbox 2 · ack 1 · unknowns 3 (demo)`. It reads only files under the epibus home:
node.json (is a node running), the node's status snapshot `status.json` (written by `epibus.monitoring.status`
about once a second, at least every KEEP_ALIVE_S) and the outbox, read-only. No NATS connection, and none of the heavy
imports (this module loads before typer, nats, pydantic or SQLAlchemy would, see `epibus.cli.main`).

The node is `up` only when node.json names a live process and that process's snapshot is fresh (younger than
FRESH_S); a live process with no fresh snapshot is `stale`, anything else `down`. Mesh and journal figures come
only from a fresh snapshot: a figure it does not hold is shown as `?`, never as 0."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bus.errors import ConfigError
from bus.host.home import (
    NodeInfo,
    default_agent,
    epibus_home,
    outbox_path,
    person_key_path,
    person_refusal,
    read_node_info,
)
from bus.outbox.outbox_schema import Depth, read_depth

STATUS_FILE = "status.json"
STATUS_FORMAT = 1
WRITE_EVERY_S = 1.0  # the node looks for changes this often
KEEP_ALIVE_S = 5.0  # and rewrites an unchanged snapshot this often, so its age tells a live node from a dead one
FRESH_S = 10.0
CLOCK_SLACK_S = 1.0  # a snapshot from up to this far in the future still counts (clock steps)
UNKNOWN = "?"
SEP = " · "
COLOURS = {"up": "32", "stale": "33", "down": "31", UNKNOWN: "33"}  # green, yellow, red

STATUSLINE_HELP = (
    "One short line for a shell prompt or a status bar: node up/stale/down, outbox depth, this agent's inbox "
    "and pending acknowledgements, open unknowns. Reads only local files (no NATS); exits 0 whenever it prints."
)


class SnapshotUnreadable(Exception):
    """status.json exists but is not a snapshot this reader understands (reported in the line as `status ?`)."""


def read_snapshot(home: Path) -> dict[str, Any] | None:
    """The node's last snapshot, None when there is none. Raises SnapshotUnreadable naming what is wrong."""
    path = home / STATUS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise SnapshotUnreadable(f"{path} cannot be read ({e})") from e
    try:
        snapshot = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise SnapshotUnreadable(f"{path} is not JSON ({e}); the running node rewrites it every second") from e
    if not isinstance(snapshot, dict) or snapshot.get("format") != STATUS_FORMAT:
        raise SnapshotUnreadable(f"{path} is not a format-{STATUS_FORMAT} status snapshot")
    if type(snapshot.get("pid")) is not int or not isinstance(snapshot.get("written_at"), str):
        raise SnapshotUnreadable(f"{path} lacks its pid or written_at")
    try:
        snapshot["written_at"] = datetime.fromisoformat(snapshot["written_at"])
    except ValueError as e:
        raise SnapshotUnreadable(f"{path} has a written_at that is not a time ({e})") from e
    if snapshot["written_at"].tzinfo is None:
        raise SnapshotUnreadable(f"{path} has a written_at without a time zone")
    return snapshot


def count(table: Any, project: str | None, what: str) -> int | None:
    """A figure from a snapshot's {project: n} table: one project's, or the sum over all. None (unknown) when
    the table is missing or not such a table. A project the table leaves out has none."""
    if not isinstance(table, dict):
        return None
    raw = list(table.values()) if project is None else [table.get(project, 0)]
    values: list[int] = [v for v in raw if type(v) is int and v >= 0]
    if len(values) != len(raw):
        raise SnapshotUnreadable(f"status.json's {what} figures are not counts")
    return sum(values)


def _node(home: Path, problems: list[str]) -> NodeInfo | None:
    try:
        return read_node_info(home)
    except ConfigError as e:
        problems.append(str(e))
        return None
    except OSError as e:
        problems.append(f"{home} cannot be read ({e}); check its permissions")
        return None


def _outbox(home: Path, problems: list[str]) -> Depth | None:
    path = outbox_path(home)
    try:
        return read_depth(path)
    except (sqlite3.Error, OSError) as e:
        problems.append(f"outbox {path} cannot be read ({e}); check its permissions, or move it aside if corrupt")
        return None


def gather(home: Path, agent: str, project: str | None, *, now: datetime | None = None) -> dict[str, Any]:
    """The facts behind the line, as `--json` prints them."""
    problems: list[str] = []
    info = _node(home, problems)
    depth = _outbox(home, problems)
    snapshot: dict[str, Any] | None = None
    status_ok = True
    try:
        snapshot = read_snapshot(home)
    except SnapshotUnreadable as e:
        problems.append(str(e))
        status_ok = False
    age_s = ((now or datetime.now(UTC)) - snapshot["written_at"]).total_seconds() if snapshot else None
    # Up: the live process named by node.json wrote the snapshot, recently.
    fresh = info is not None and snapshot is not None and snapshot["pid"] == info.pid
    fresh = fresh and age_s is not None and -CLOCK_SLACK_S < age_s < FRESH_S
    facts: dict[str, Any] = {
        "ok": True,
        "node": "up" if fresh else "stale" if info is not None else "down",
        "name": info.name if info is not None else None,
        "pid": info.pid if info is not None else None,
        "snapshot_age_s": round(age_s, 3) if age_s is not None else None,
        "status_readable": status_ok,
        "outbox": {"waiting": depth.waiting, "parked": depth.parked} if depth is not None else None,
        "agent": agent,
        "project": project,
        "inbox": None,
        "ack": None,
        "unknowns": None,
        "problems": problems,
    }
    if fresh and snapshot is not None:
        try:
            facts |= _figures(snapshot, agent, project)
        except SnapshotUnreadable as e:
            problems.append(str(e))
            facts["status_readable"] = False
    return facts


def _figures(snapshot: dict[str, Any], agent: str, project: str | None) -> dict[str, int | None]:
    agents = snapshot.get("agents")
    mine = agents.get(agent) if isinstance(agents, dict) else None  # an agent without a key here: unknown
    if mine is not None and not isinstance(mine, dict):
        raise SnapshotUnreadable(f"status.json's entry for agent {agent} is not a table")
    return {
        "inbox": count(mine.get("inbox"), project, "inbox") if mine else None,
        "ack": count(mine.get("ack"), project, "ack") if mine else None,
        "unknowns": count(snapshot.get("unknowns"), project, "unknowns"),
    }


def _plain(text: str) -> str:
    """A name as it may appear in a prompt: characters a terminal would act on become '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)[:64]


def _figure(value: int | None) -> str:
    return UNKNOWN if value is None else str(value)


def line(facts: dict[str, Any], *, colour: bool = False) -> str:
    """The one line: `epibus up · outbox 0 · inbox 2 · ack 1 · unknowns 3 (demo)`, or for a node that is
    not up `epibus down · outbox 12 waiting`."""

    def paint(text: str, key: str) -> str:
        return f"\033[{COLOURS[key]}m{text}\033[0m" if colour and key in COLOURS else text

    state = facts["node"]
    parts = [f"epibus {paint(state, state)}"]
    outbox = facts["outbox"]
    if outbox is None:
        parts.append(f"outbox {paint(UNKNOWN, UNKNOWN)}")
    else:
        parts.append(f"outbox {outbox['waiting']}" + (" waiting" if state != "up" else ""))
        if outbox["parked"]:
            parts.append(f"{outbox['parked']} parked")
    if state == "up":
        for name in ("inbox", "ack"):
            parts.append(f"{name} {paint(_figure(facts[name]), UNKNOWN if facts[name] is None else '')}")
        unknowns = f"unknowns {paint(_figure(facts['unknowns']), UNKNOWN if facts['unknowns'] is None else '')}"
        parts.append(unknowns + (f" ({_plain(facts['project'])})" if facts["project"] else ""))
    if not facts["status_readable"]:
        parts.append(f"status {paint(UNKNOWN, UNKNOWN)}")
    return SEP.join(parts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epibus statusline", description=STATUSLINE_HELP)
    p.add_argument(
        "-p",
        "--project",
        default=os.environ.get("EPIBUS_PROJECT") or None,
        help="count only this project's inbox, acknowledgements and unknowns [env EPIBUS_PROJECT; default: "
        "the sum over every project]",
    )
    p.add_argument("--agent", default=None, help="whose inbox and acknowledgements [env EPIBUS_AGENT; login name]")
    p.add_argument("--home", default=None, help="epibus state directory [env EPIBUS_HOME; default ~/.epibus]")
    p.add_argument("--json", action="store_true", dest="as_json", help="print the same facts as one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the line (or the JSON object); 0 whenever it printed, so a prompt never breaks on it. 1, with one
    line on stderr, when asked to run as a person."""
    args = parser().parse_args(argv)
    agent = args.agent or default_agent()
    try:
        home = epibus_home(args.home)
    except ConfigError as e:
        facts = {"ok": True, "node": UNKNOWN, "outbox": None, "status_readable": True, "problems": [str(e)]}
        facts |= {"agent": agent, "project": args.project, "inbox": None, "ack": None, "unknowns": None}
    else:
        if person_key_path(home, agent).exists():
            print(f"epibus statusline: {person_refusal(agent)}", file=sys.stderr)
            return 1
        facts = gather(home, agent, args.project)
    if args.as_json:
        print(json.dumps(facts | {"line": line(facts)}, sort_keys=True, default=str))
    else:
        colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print(line(facts, colour=colour))
    return 0
