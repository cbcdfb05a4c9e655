"""`epibus mesh …`: propose work, decide it, do it, close the handshake; watch an inbox; run a coordinator."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from bus.client import connect
from bus.errors import ConfigError, InvalidEvent
from bus.home import default_agent, epibus_home
from bus.tasks import cancel_and_wait
from bus.vocab import ActionCategory, TaskState, describe
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from mesh.agent import MeshAgent, Outcome
from mesh.coordinator import Coordinator, parse_policy
from mesh.peer import Inbox, Notification, NotificationLog, concern, require_commit
from mesh.protocol import TERMINAL
from mesh.store import TaskEntry
from mesh.task import TaskRecord
from mesh.watch import Cursor, FileCursor

T = TypeVar("T")

mesh_app = typer.Typer(
    help="The mesh: peers propose work, a coordinator decides, completions carry commit SHAs.", no_args_is_help=True
)
coordinators_app = typer.Typer(help="Which agents decide a project's work.", no_args_is_help=True)
mesh_app.add_typer(coordinators_app, name="coordinators")

TaskArg = Annotated[str, typer.Argument(help="The task id.")]
ProjectOpt = Annotated[str | None, typer.Option("--project", "-p", help="The task's project [default: found by id].")]
RequiredProject = Annotated[str, typer.Option("--project", "-p", help="The project.")]
MessageIdOpt = Annotated[
    str | None,
    typer.Option("--message-id", help="A UUIDv7 for this message; sending the same id again is a safe retry."),
]
ToOpt = Annotated[list[str] | None, typer.Option("--to", help="A target agent (repeatable).")]
CapabilityOpt = Annotated[list[str] | None, typer.Option("--capability", help="A capability needed (repeatable).")]
DeadlineOpt = Annotated[
    str | None, typer.Option("--deadline", help="ISO 8601 time, or a duration from now like 30m, 2h, 7d.")
]
CategoryHelp = f"Action category. {describe(ActionCategory)}"


def _mesh(nats: str | None, agent: str | None, home: Path | None, work: Callable[[MeshAgent], Awaitable[T]]) -> T:
    async def go() -> T:
        async with connect(nats, agent=agent, home=home) as client:
            return await work(MeshAgent(client))

    return run(go())


def _message_id(value: str | None) -> uuid.UUID | None:
    if value is None:
        return None
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        raise InvalidEvent(f"--message-id={value!r}", "is not a UUID") from None
    if parsed.version != 7:
        raise InvalidEvent(f"--message-id={value!r}", f"must be a UUIDv7, got version {parsed.version}")
    return parsed


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_deadline(value: str | None) -> datetime | None:
    """ISO 8601 (UTC if no offset) or a duration from now (30m, 2h, 7d)."""
    if value is None:
        return None
    match = _DURATION.match(value.strip())
    if match:
        return datetime.now(UTC) + timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError("--deadline", f"{value!r} is neither ISO 8601 nor a duration like 30m, 2h, 7d") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


def _show_outcome(outcome: Outcome, as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, **outcome.as_json()})
        return
    step = outcome.step
    moved = f"{step.from_state} -> {step.to_state}" if step.from_state else str(step.to_state)
    again = " (already applied: same outcome, no new event)" if outcome.duplicate else ""
    console.print(
        f"task {outcome.record.task_id} [{outcome.record.proposal.project}]: {step.action} ({moved}), "
        f"revision {outcome.revision}, message {step.message_id}{again}",
        highlight=False,
        soft_wrap=True,
    )
    if outcome.record.child_id and step.child_id:
        console.print(f"counter-proposal: task {step.child_id}", highlight=False)


def _task_row(entry: TaskEntry, why: str | None = None) -> dict[str, Any]:
    record = entry.record
    step = record.last_step
    return {
        "task_id": record.task_id,
        "project": record.proposal.project,
        "state": record.state.value,
        "title": record.proposal.title,
        "category": record.proposal.category.value,
        "proposer": record.proposal.proposer,
        "assignee": record.assignee,
        "deadline": record.proposal.deadline.isoformat() if record.proposal.deadline else None,
        "last_action": step.action.value,
        "last_actor": step.actor,
        "updated_at": step.at.isoformat(),
        "revision": entry.revision,
        "sha": record.completion.sha if record.completion else None,
        **({"why": why} if why is not None else {}),
    }


def _show_tasks(title: str, rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, "tasks": rows})
        return
    columns = ["task_id", "project", "state", "title", "proposer", "assignee", "last_action", "updated_at"]
    if any("why" in r for r in rows):
        columns.append("why")
    console.print(table(f"{title} ({len(rows)})", columns, [[r.get(c) for c in columns] for r in rows]))


# -- proposing and deciding -------------------------------------------------------------------------------


@mesh_app.command()
@handles_errors
def propose(
    project: RequiredProject,
    title: Annotated[str, typer.Option("--title", help="At most 200 characters.")],
    summary: Annotated[str, typer.Option("--summary", help="What is to be done and why.")],
    category: Annotated[ActionCategory, typer.Option("--category", help=CategoryHelp)] = ActionCategory.operational,
    to: ToOpt = None,
    capability: CapabilityOpt = None,
    deadline: DeadlineOpt = None,
    parent: Annotated[str | None, typer.Option("--parent", help="The task this one follows from.")] = None,
    payload: Annotated[str | None, typer.Option("--payload", help="A JSON object for the assignee.")] = None,
    task_id: Annotated[str | None, typer.Option("--task-id", help="[default: the message id]")] = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Propose work to a project's coordinators."""
    data = _payload(payload)
    outcome = _mesh(
        nats,
        agent,
        home,
        lambda m: m.propose(
            project,
            title,
            summary,
            category=category,
            agents=to or (),
            capabilities=capability or (),
            deadline=parse_deadline(deadline),
            parent_id=parent,
            payload=data,
            task_id=task_id,
            message_id=_message_id(message_id),
        ),
    )
    _show_outcome(outcome, as_json)


def _payload(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidEvent("--payload", f"is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise InvalidEvent("--payload", f"is a JSON {type(data).__name__}, expected an object")
    return data


@mesh_app.command()
@handles_errors
def accept(
    task: TaskArg,
    assignee: Annotated[str | None, typer.Option("--assignee", help="[default: the one targeted agent]")] = None,
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Accept a proposal and name who does it (coordinators only)."""
    mid = _message_id(message_id)
    _show_outcome(
        _mesh(nats, agent, home, lambda m: m.accept(task, assignee=assignee, project=project, message_id=mid)), as_json
    )


@mesh_app.command()
@handles_errors
def decline(
    task: TaskArg,
    reason: Annotated[str, typer.Option("--reason", help="Why (required).")],
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Decline a proposal, with the reason (coordinators only)."""
    mid = _message_id(message_id)
    _show_outcome(_mesh(nats, agent, home, lambda m: m.decline(task, reason, project=project, message_id=mid)), as_json)


@mesh_app.command()
@handles_errors
def change(
    task: TaskArg,
    title: Annotated[str | None, typer.Option("--title")] = None,
    summary: Annotated[str | None, typer.Option("--summary")] = None,
    category: Annotated[ActionCategory | None, typer.Option("--category", help=CategoryHelp)] = None,
    to: ToOpt = None,
    capability: CapabilityOpt = None,
    deadline: DeadlineOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why the change.")] = None,
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Counter-propose (coordinators only): the proposal becomes `changed` and a new one, linked to it,
    takes its place with the fields given here changed."""
    mid = _message_id(message_id)
    outcome = _mesh(
        nats,
        agent,
        home,
        lambda m: m.change(
            task,
            project=project,
            reason=reason,
            message_id=mid,
            title=title,
            summary=summary,
            category=category,
            agents=to,
            capabilities=capability,
            deadline=parse_deadline(deadline),
        ),
    )
    _show_outcome(outcome, as_json)


# -- doing the work ---------------------------------------------------------------------------------------


@mesh_app.command()
@handles_errors
def start(
    task: TaskArg,
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Start accepted work (its assignee only)."""
    mid = _message_id(message_id)
    _show_outcome(_mesh(nats, agent, home, lambda m: m.start(task, project=project, message_id=mid)), as_json)


@mesh_app.command()
@handles_errors
def complete(
    task: TaskArg,
    sha: Annotated[str, typer.Option("--sha", help="The commit: 40 or 64 lowercase hex characters.")],
    repo: Annotated[
        Path | None, typer.Option("--repo", help="Refuse unless the SHA is a commit in this git repo.")
    ] = None,
    evidence: Annotated[
        list[str] | None, typer.Option("--evidence", help="KIND:REF, e.g. file:src/x.py or url:https://… (repeatable).")
    ] = None,
    note: Annotated[str | None, typer.Option("--note", help="A result note.")] = None,
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Complete the work with its commit SHA (its assignee only)."""
    mid = _message_id(message_id)
    pointers = [_evidence(e) for e in evidence or []]

    async def work(m: MeshAgent) -> Outcome:
        if repo is not None:
            entry = await m.locate(task, project)
            await asyncio.to_thread(require_commit, repo, sha, task=f"{task} ({entry.record.state})")
        return await m.complete(task, sha, evidence=pointers, note=note, project=project, message_id=mid)

    _show_outcome(_mesh(nats, agent, home, work), as_json)


def _evidence(value: str) -> dict[str, str]:
    kind, sep, ref = value.partition(":")
    if not sep or not ref:
        raise InvalidEvent(f"--evidence={value!r}", "must be KIND:REF, e.g. commit:<sha> or file:path")
    return {"kind": kind, "ref": ref}


@mesh_app.command()
@handles_errors
def fail(
    task: TaskArg,
    reason: Annotated[str, typer.Option("--reason", help="Why it failed (required).")],
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Give up on accepted or started work, with the reason (its assignee only)."""
    mid = _message_id(message_id)
    _show_outcome(_mesh(nats, agent, home, lambda m: m.fail(task, reason, project=project, message_id=mid)), as_json)


@mesh_app.command()
@handles_errors
def cancel(
    task: TaskArg,
    reason: Annotated[str | None, typer.Option("--reason")] = None,
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Withdraw an open task (its proposer or a coordinator)."""
    mid = _message_id(message_id)
    _show_outcome(
        _mesh(nats, agent, home, lambda m: m.cancel(task, reason=reason, project=project, message_id=mid)), as_json
    )


@mesh_app.command("ack")
@handles_errors
def acknowledge(
    task: TaskArg,
    project: ProjectOpt = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Acknowledge a completion, closing the handshake (its proposer only)."""
    mid = _message_id(message_id)
    _show_outcome(_mesh(nats, agent, home, lambda m: m.acknowledge(task, project=project, message_id=mid)), as_json)


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
) -> None:
    """One task: its proposal, where it stands, and every step with who took it."""
    entry = _mesh(nats, agent, home, lambda m: m.locate(task, project))
    record = entry.record
    if as_json:
        emit_json({"ok": True, "revision": entry.revision, **record.model_dump(mode="json")})
        return
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
) -> None:
    """Tasks this agent proposed, wherever they stand."""
    entries = _mesh(nats, agent, home, lambda m: m.outbox(project))
    _show_tasks("outbox", [_task_row(e) for e in entries], as_json)


@mesh_app.command()
@handles_errors
def pending(
    project: ProjectOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Completed tasks their proposer has not acknowledged yet (open handshakes)."""
    entries = _mesh(nats, agent, home, lambda m: m.pending(project))
    _show_tasks("pending acknowledgement", [_task_row(e) for e in entries], as_json)


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
        int | None, typer.Option("--count", "-n", help="With --watch: stop after N notifications.")
    ] = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Proposals for this agent, work assigned to it, decisions on its proposals. With --watch, follows new
    ones, resuming after the last one it showed (a saved cursor, or --out's last line)."""
    if not watch:
        rows = _mesh(nats, agent, home, lambda m: _inbox_now(m, project))
        _show_tasks("inbox", rows, as_json)
        return
    if reset and out is not None:
        raise ConfigError("--reset", "with --out the file is the cursor: start a new file (or remove it) instead")
    me = agent or default_agent()
    cursor: Cursor
    log = NotificationLog(out) if out is not None else None
    if log is not None:
        cursor = log
    else:
        cursor = FileCursor(epibus_home(home) / "mesh" / f"inbox-{me}-{project or 'all'}.cursor")
        if reset:
            cursor.save(0)
    _mesh(nats, agent, home, lambda m: _watch_inbox(m, project, cursor, log, count, as_json))


async def _inbox_now(mesh: MeshAgent, project: str | None) -> list[dict[str, Any]]:
    advertised = await mesh.store.get_capabilities(mesh.agent)
    capabilities = frozenset(advertised.capabilities) if advertised else frozenset()
    rows: list[dict[str, Any]] = []
    coordinated: dict[str, bool] = {}
    for entry in await mesh.tasks(project):
        record: TaskRecord = entry.record
        if record.state in TERMINAL:
            continue
        p = record.proposal.project
        if p not in coordinated:
            coordinated[p] = mesh.agent in await mesh.coordinators(p)
        why = concern(mesh.agent, record, coordinates=coordinated[p], capabilities=capabilities)
        if why is None and record.assignee == mesh.agent and record.state is TaskState.working:
            why = "yours, in progress"
        if why is not None:
            rows.append(_task_row(entry, why))
    return rows


async def _watch_inbox(
    mesh: MeshAgent, project: str | None, cursor: Cursor, log: NotificationLog | None, count: int | None, as_json: bool
) -> None:
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
                f"r{note.revision} [{note.project}] task {note.task_id} {note.state}: {note.title} — {note.why}",
                highlight=False,
                soft_wrap=True,
            )
        told += 1
        if count is not None and told >= count:
            done.set()

    inbox_ = Inbox(mesh, notify, project=project, cursor=cursor)
    if not as_json:
        err_console.print(f"watching the inbox of {mesh.agent} after revision {cursor.load()} (Ctrl-C stops)")
    await _until_stopped(inbox_.run(), done)


async def _until_stopped(work: Awaitable[None], done: asyncio.Event) -> None:
    """Run `work` until it ends, `done` is set, or SIGINT/SIGTERM arrives."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, done.set)
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # re-raise what ended it
    finally:
        await cancel_and_wait([task, stopper])


# -- coordinators -----------------------------------------------------------------------------------------


@mesh_app.command()
@handles_errors
def coordinate(
    project: RequiredProject,
    policy: Annotated[
        str,
        typer.Option("--policy", help="manual | auto-accept:<category>[,<category>…] | capability-match"),
    ] = "manual",
    sweep: Annotated[float, typer.Option("--sweep", help="Seconds between deadline sweeps.")] = 1.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the coordinator service for a project: decide proposals by the policy, expire overdue tasks.
    This agent must be one of the project's coordinators."""
    chosen = parse_policy(policy)

    async def work(mesh: MeshAgent) -> None:
        cursor = FileCursor(epibus_home(home) / "mesh" / f"coordinator-{mesh.agent}-{project}.cursor")
        service = Coordinator(mesh, project, chosen, sweep_interval_s=sweep, cursor=cursor)
        await service.check()
        if as_json:
            emit_json(
                {"ok": True, "status": "coordinating", "project": project, "agent": mesh.agent, "policy": chosen.name}
            )
        else:
            err_console.print(f"{mesh.agent} coordinates {project} with policy {chosen.name} (Ctrl-C stops)")
        await _until_stopped(service.run(), asyncio.Event())
        figures = {
            "decided": dict(service.stats.decided),
            "left_to_person": service.stats.left_to_person,
            "lost_races": service.stats.lost_races,
            "expired": service.stats.expired,
            "refused": service.stats.refused,
            "sweep_errors": service.stats.sweep_errors,
        }
        if as_json:
            emit_json({"ok": True, "status": "stopped", **figures})
        else:
            err_console.print(f"stopped: {figures}")

    _mesh(nats, agent, home, work)


@mesh_app.command()
@handles_errors
def advertise(
    capabilities: Annotated[list[str], typer.Argument(help="What this agent can do, e.g. python db:postgres.")],
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Advertise this agent's capabilities (the capability-match policy assigns by them)."""
    advertised = _mesh(nats, agent, home, lambda m: m.advertise(capabilities))
    if as_json:
        emit_json({"ok": True, **advertised.model_dump(mode="json")})
    else:
        console.print(f"{advertised.agent} advertises {', '.join(advertised.capabilities)}", highlight=False)


AgentArg = Annotated[str, typer.Argument(help="The agent.")]


def _show_roster(project: str, coordinators: tuple[str, ...], as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, "project": project, "coordinators": list(coordinators)})
    else:
        console.print(f"coordinators of {project}: {', '.join(coordinators) or 'none'}", highlight=False)


@coordinators_app.command("add")
@handles_errors
def coordinators_add(
    who: AgentArg,
    project: RequiredProject,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Add a coordinator (anyone may add a project's first; after that, only its coordinators)."""
    mid = _message_id(message_id)
    roster = _mesh(nats, agent, home, lambda m: m.add_coordinator(project, who, message_id=mid))
    _show_roster(project, roster.coordinators, as_json)


@coordinators_app.command("remove")
@handles_errors
def coordinators_remove(
    who: AgentArg,
    project: RequiredProject,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a coordinator (coordinators only; the last one stays)."""
    mid = _message_id(message_id)
    roster = _mesh(nats, agent, home, lambda m: m.remove_coordinator(project, who, message_id=mid))
    _show_roster(project, roster.coordinators, as_json)


@coordinators_app.command("list")
@handles_errors
def coordinators_list(
    project: RequiredProject,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The project's coordinators."""
    _show_roster(project, _mesh(nats, agent, home, lambda m: m.coordinators(project)), as_json)
