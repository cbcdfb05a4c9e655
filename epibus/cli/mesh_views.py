"""`epibus mesh show|outbox|pending|inbox`: reading the mesh and watching an inbox; nothing here writes.
(`coordinators` is in mesh_roster, `coordinate` and `advertise` in mesh_agents.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bus.errors import ConfigError
from bus.host.home import default_agent, epibus_home
from bus.model.records import QuarantinedRecord
from epibus.cli import inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    WideOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    table,
)
from epibus.cli.display import shown
from epibus.cli.mesh import (
    ProjectOpt,
    TaskArg,
    mesh_app,
    run_mesh,
    run_task,
    show_tasks,
    until_stopped,
)

# The mesh's models load when a mesh command runs, not at every CLI start (`epibus --help` included).
if TYPE_CHECKING:
    from bus.intake.cursor import Cursor
    from mesh.agent import MeshAgent
    from mesh.inbox import Notification, NotificationLog
    from mesh.store import TaskEntry

# -- reading ----------------------------------------------------------------------------------------------


@mesh_app.command()
@handles_errors
def show(
    task: TaskArg,
    project: ProjectOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """One task: its proposal, where it stands, and every step with who took it."""
    entry = run_task(nats, agent, home, task, project, lambda m, t: m.locate(t, project))
    record = entry.record
    if as_json:
        emit_json({"ok": True, "revision": entry.revision, **record.model_dump(mode="json")})
        return
    from mesh.protocol import TERMINAL

    p = record.proposal
    rows: list[list[Any]] = [
        ["task", record.task_id],
        ["project", p.project],
        ["state", f"{record.state}{' (terminal)' if record.state in TERMINAL else ''}"],
        ["title", p.title],
        ["summary", p.summary],
        ["category", p.category],
        ["proposer", p.proposer],
        ["targets", ", ".join([*p.targets.agents, *(f"cap:{c}" for c in p.targets.capabilities)]) or "-"],
        ["assignee", record.assignee],
        ["decided by", f"{record.decided_by} ({record.decided_policy})" if record.decided_by else None],
        ["deadline", p.deadline.isoformat() if p.deadline else None],
        ["parent", p.parent_id],
        ["counter-proposal", record.child_id],
        ["commit", record.completion.sha if record.completion else None],
        ["reason", record.reason],
        ["revision", entry.revision],
    ]
    console.print(table("task", ["field", "value"], [r for r in rows if r[1] is not None]))
    steps: list[list[Any]] = [
        [
            i + 1,
            s.at.isoformat(timespec="seconds"),
            s.action,
            s.actor,
            ",".join(s.roles),
            f"{s.from_state or '-'} -> {s.to_state}",
            s.reason or (s.completion.sha if s.completion else ""),
        ]
        for i, s in enumerate(record.steps)
    ]
    console.print(table("steps", ["#", "at", "action", "actor", "as", "move", "detail"], steps))


@mesh_app.command()
@handles_errors
def outbox(
    project: ProjectOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Tasks this agent proposed, wherever they stand."""
    entries, quarantined = run_mesh(nats, agent, home, lambda m: _listed(m, m.outbox(project)))
    show_tasks("outbox", [e.summary() for e in entries], as_json, quarantined)


@mesh_app.command()
@handles_errors
def pending(
    project: ProjectOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Completed tasks their proposer has not acknowledged yet (open handshakes)."""
    entries, quarantined = run_mesh(nats, agent, home, lambda m: _listed(m, m.pending(project)))
    show_tasks("pending acknowledgement", [e.summary() for e in entries], as_json, quarantined)


async def _listed(
    mesh: MeshAgent, entries: Awaitable[list[TaskEntry]]
) -> tuple[list[TaskEntry], list[QuarantinedRecord]]:
    """The listed tasks, and the records the listing skipped because it could not read them."""
    found = await entries
    return found, mesh.store.quarantine.records


@mesh_app.command()
@handles_errors
def inbox(
    project: ProjectOpt = None,
    watch: Annotated[bool, typer.Option("--watch", help="Follow new notifications until stopped.")] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="With --watch: append notifications to this JSON-lines file, which is also the cursor."
        ),
    ] = None,
    reset: Annotated[bool, typer.Option("--reset", help="With --watch: forget the saved cursor, start over.")] = False,
    count: Annotated[
        int | None,
        typer.Option("--count", "-n", help="With --watch: stop after N notifications.", callback=inputs.at_least_one),
    ] = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Proposals for this agent, work assigned to it, decisions on its proposals. With --watch, follows new
    ones, resuming after the last one it showed (a saved cursor, or --out's last line)."""
    if not watch:
        rows, quarantined = run_mesh(nats, agent, home, lambda m: _inbox_now(m, project))
        show_tasks("inbox", rows, as_json, quarantined)
        return
    if reset and out is not None:
        raise ConfigError("--reset", "with --out the file is the cursor: start a new file (or remove it) instead")
    from bus.intake.cursor import FileCursor
    from mesh.inbox import NotificationLog

    me = agent or default_agent()
    cursor: Cursor
    log = NotificationLog(out) if out is not None else None
    if log is not None:
        cursor = log
    else:
        cursor = FileCursor(epibus_home(home) / "mesh" / f"inbox-{me}-{project or 'all'}.cursor")
        if reset:
            cursor.save(0)
    run_mesh(nats, agent, home, lambda m: _watch_inbox(m, project, cursor, log, count, as_json))


async def _inbox_now(mesh: MeshAgent, project: str | None) -> tuple[list[dict[str, Any]], list[QuarantinedRecord]]:
    from mesh.inbox import inbox_now

    rows = [entry.summary(why) for entry, why in await inbox_now(mesh, project)]
    return rows, mesh.store.quarantine.records


async def _watch_inbox(
    mesh: MeshAgent, project: str | None, cursor: Cursor, log: NotificationLog | None, count: int | None, as_json: bool
) -> None:
    from mesh.inbox import Inbox

    done = asyncio.Event()
    told = 0

    async def notify(note: Notification) -> None:
        nonlocal told
        if log is not None:
            log.append(note)
        if as_json:
            print(json.dumps(note.as_json(), sort_keys=True), flush=True)
        else:
            console.print(
                shown(f"r{note.revision} [{note.project}] task {note.task_id} {note.state}: {note.title} — {note.why}"),
                soft_wrap=True,
            )
        told += 1
        if count is not None and told >= count:
            done.set()

    inbox_ = Inbox(mesh, notify, project=project, cursor=cursor)
    if not as_json:
        err_console.print(shown(f"watching the inbox of {mesh.agent} after revision {cursor.load()} (Ctrl-C stops)"))
    await until_stopped(inbox_.run(), done)
