"""Operating a node: `epibus status`, `epibus doctor`, `epibus down`, `epibus version` (and `--version`),
`epibus completion`. The logic lives in epibus/monitoring/status_report.py, epibus/ops/doctor.py and
epibus/node/process.py."""

from __future__ import annotations

import importlib.metadata
import subprocess
from dataclasses import asdict
from enum import StrEnum
from typing import Annotated, Any

import typer
from typer._completion_shared import get_completion_script

from bus.errors import ConfigError
from bus.host.home import NODE_FILE, epibus_home
from bus.host.server import nats_server_binary, server_version
from epibus.cli.common import (
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    console,
    emit_json,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.monitoring.status_report import node_status
from epibus.node.process import find, stop

PROG = "epibus"
COMPLETE_VAR = "_EPIBUS_COMPLETE"


@handles_errors
def status(home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Is a node running for this home, and how is it: name, URLs, uptime, observers' lag, mirror, outbox,
    authentication. Exit 1 when no node runs, or when it runs but does not answer."""
    report = run(node_status(epibus_home(home)))
    if as_json:
        emit_json(report)
    elif not report["running"]:
        console.print(shown(("not running:", "bold red"), f" {report['reason']}; {report['hint']}"))
    else:
        console.print(table(f"epibus node {report['name']}", ["what", "state"], _status_rows(report)))
        for problem in report["problems"]:
            console.print(shown(("problem:", "bold red"), " ", problem))
    if not report["running"] or report["problems"]:
        raise typer.Exit(1)


def _status_rows(report: dict[str, Any]) -> list[list[Any]]:
    nats = report["nats"]
    reach = f"answers in {nats['rtt_ms']} ms (nats-server {nats['server_version']})" if nats["reachable"] else "DOWN"
    rows: list[list[Any]] = [
        ["pid", f"{report['pid']} (nats-server {', '.join(map(str, report['server_pids'])) or 'not embedded'})"],
        ["uptime", f"{report['uptime_s']}s since {report['started_at']}"],
        *([f"{name} url", url] for name, url in report["urls"].items()),
        ["nats", reach],
        ["authentication", "on" if report["authenticated"] else "off"],
    ]
    for name, stats in (report["observers"] or {}).items():
        state = "STALLED" if stats["stalled"] else "degraded" if stats["degraded"] else "ok"
        pending = "unknown" if stats["pending"] is None else stats["pending"]
        rows.append([f"observer {name}", f"{state}; pending {pending}, handled {stats['handled']}"])
    mirror = report["mirror"]
    if mirror is not None:
        model = f", {mirror['model']} ({mirror['dimension']}-d)" if mirror.get("model") else ""
        rows.append(["mirror", f"{mirror['backend']}{model}"])
        if mirror.get("shards"):
            shards, seals = mirror["shards"], mirror["seals"]
            failed = f"; {seals['failures']} seal(s) failed, last: {seals['last_error']}" if seals["failures"] else ""
            outdated = shards.get("outdated", 0)
            old = f" ({outdated} of an older layout, being rebuilt)" if outdated else ""
            rows.append(["mirror shards", f"{shards['sealed']} sealed{old}, {shards['frozen']} sealing, 1 hot{failed}"])
    rows.append(["outbox", f"{report['outbox']['depth']} waiting, {report['outbox']['parked']} parked"])
    for role, space in (report.get("disk") or {}).items():
        state = "FULL" if space["full"] else "ok"
        free = space["free_bytes"]
        shown_free = f"{free / (1 << 30):.1f} GiB" if free >= 1 << 30 else f"{free >> 20} MiB"
        rows.append([f"disk ({role})", f"{state}; {shown_free} free under {space['path']}"])
    for name, check in (report.get("stores") or {}).items():
        found = f"DAMAGED: {check['problem']}; {check['remedy']}" if check["state"] == "damaged" else check["state"]
        rows.append([f"{name} check", found])
    return rows


ReplicasOpt = Annotated[
    int | None,
    typer.Option(
        "--replicas",
        envvar="EPIBUS_REPLICAS",
        min=1,
        max=5,
        help="The stream replicas the nodes run with (`up --replicas`); compared when given.",
    ),
]


@handles_errors
def doctor(
    home: HomeOpt = None,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    replicas: ReplicasOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check everything epibus needs here, one line each (ok | warn | fail) with how to fix it: NATS and
    JetStream, the server version, the streams and buckets, the clock, the key registry, the journal's schema,
    the mirror's model, disk space and file modes. Exit 1 when a check fails."""
    # Loaded here: the checks import SQLAlchemy and the journal, a large part of any other command's start.
    from epibus.ops.doctor import diagnose
    from epibus.ops.doctor_local import FAIL

    checks = run(diagnose(home, nats, journal, replicas=replicas))
    if as_json:
        emit_json([asdict(check) for check in checks])
    else:
        rows = [[c.status, c.check, c.detail, c.hint] for c in checks]
        console.print(table("epibus doctor", ["status", "check", "found", "fix"], rows))
    if any(c.status == FAIL for c in checks):
        raise typer.Exit(1)


TimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=0.1, help="Seconds to wait for a clean stop before SIGKILL.")
]


@handles_errors
def down(home: HomeOpt = None, timeout: TimeoutOpt = 30.0, as_json: JsonOpt = False) -> None:
    """Stop this home's node: SIGTERM, then SIGKILL after --timeout (said so). Exit 0 with "nothing to stop" when
    no node runs (a stale node.json is removed); exit 1 only when the node could not be stopped."""
    where = epibus_home(home)
    raw, node = find(where)
    if node is None:
        if raw is not None:
            (where / NODE_FILE).unlink(missing_ok=True)
        why = "no node is recorded" if raw is None else f"node.json named pid {raw['pid']}, not running (removed)"
        if as_json:
            emit_json({"ok": True, "stopped": False, "home": str(where), "reason": why})
        else:
            console.print(shown(f"nothing to stop under {where}: {why}"))
        return
    stopped = stop(where, node, timeout)
    if as_json:
        emit_json({"ok": True, "stopped": True, "home": str(where), **asdict(stopped)})
        return
    how = f"killed (SIGKILL) after {timeout:g}s without stopping" if stopped.killed else "stopped"
    console.print(
        shown((how, "yellow" if stopped.killed else "green"), f" node pid {stopped.pid} in {stopped.seconds}s")
    )


def versions() -> dict[str, Any]:
    """This package's version and the bundled nats-server's (None, with the reason, when it cannot run)."""
    found: dict[str, Any] = {"epibus": importlib.metadata.version(PROG), "nats_server": None}
    try:
        found["nats_server"] = ".".join(map(str, server_version(nats_server_binary())))
    except (ConfigError, OSError, subprocess.SubprocessError) as e:
        found["nats_server_error"] = str(e)
    return found


def version(as_json: JsonOpt = False) -> None:
    """The epibus version and the version of the nats-server it runs."""
    found = versions()
    if as_json:
        emit_json(found)
        return
    server = found["nats_server"] or f"unknown ({found.get('nats_server_error')})"
    console.print(shown(f"epibus {found['epibus']} (nats-server {server})"))


def version_callback(value: bool) -> None:
    if value:
        version()
        raise typer.Exit(0)


class Shell(StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def completion(
    shell: Annotated[Shell, typer.Argument(help="The shell to complete in.")], as_json: JsonOpt = False
) -> None:
    """Print the shell completion script: `eval "$(epibus completion bash)"` in ~/.bashrc (zsh: ~/.zshrc;
    fish: `epibus completion fish > ~/.config/fish/completions/epibus.fish`)."""
    # What `--show-completion` prints, for a shell named here instead of guessed from the parent process.
    script = get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell.value)
    if as_json:
        emit_json({"shell": shell.value, "script": script})
    else:
        print(script)
