"""`epibus mesh propose|accept|decline|change|start|complete|fail|cancel|acknowledge`: propose work, decide it, do
it, close the handshake; and what every mesh command shares (options, running a mesh agent, showing tasks)."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from bus.broker.loops import cancel_and_wait
from bus.client.client import connect
from bus.errors import InvalidEvent
from bus.model.ids import parse_event_id
from bus.model.records import QuarantinedRecord
from bus.model.vocab import describe
from epibus.cli import ids, inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    QuietOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.times import parse_time
from mesh.vocab import ActionCategory

# The mesh's models load when a mesh command runs, not at every CLI start (`epibus --help` included).
if TYPE_CHECKING:
    from mesh.agent import MeshAgent, Outcome

T = TypeVar("T")

mesh_app = typer.Typer(
    help="The mesh: peers propose work, a coordinator decides, completions carry commit SHAs.", no_args_is_help=True
)
coordinators_app = typer.Typer(help="Which agents decide a project's work.", no_args_is_help=True)
mesh_app.add_typer(coordinators_app, name="coordinators")

TaskArg = Annotated[str, typer.Argument(help="The task id, or a unique prefix of it (4+ hex digits).")]
ProjectOpt = Annotated[
    str | None,
    typer.Option("--project", "-p", help="The task's project [default: found by id].", callback=inputs.project),
]
RequiredProject = Annotated[str, typer.Option("--project", "-p", help="The project.", callback=inputs.project)]
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


def run_mesh(nats: str | None, agent: str | None, home: Path | None, work: Callable[[MeshAgent], Awaitable[T]]) -> T:
    from mesh.agent import MeshAgent

    async def go() -> T:
        async with connect(nats, agent=agent, home=home) as client:
            return await work(MeshAgent(client))

    return run(go())


def run_task(
    nats: str | None,
    agent: str | None,
    home: Path | None,
    task: str,
    project: str | None,
    work: Callable[[MeshAgent, str], Awaitable[T]],
) -> T:
    """`run_mesh` for a command acting on one task: `work` gets the whole task id `task` abbreviates."""

    async def resolved(mesh: MeshAgent) -> T:
        return await work(mesh, await ids.task_id(mesh, task, field="TASK", project=project))

    return run_mesh(nats, agent, home, resolved)


def message_id_of(value: str | None) -> uuid.UUID | None:
    return None if value is None else parse_event_id(value, "--message-id")


def _show_outcome(outcome: Outcome, as_json: bool) -> None:
    if as_json:
        emit_json({"ok": True, **outcome.as_json()})
        return
    step = outcome.step
    moved = f"{step.from_state} -> {step.to_state}" if step.from_state else str(step.to_state)
    again = " (already applied: same outcome, no new event)" if outcome.duplicate else ""
    console.print(
        shown(
            f"task {outcome.record.task_id} [{outcome.record.proposal.project}]: {step.action} ({moved}), "
            f"revision {outcome.revision}, message {step.message_id}{again}"
        ),
        soft_wrap=True,
    )
    if outcome.record.child_id and step.child_id:
        console.print(shown(f"counter-proposal: task {step.child_id}"), soft_wrap=True)


def show_tasks(
    title: str, rows: list[dict[str, Any]], as_json: bool, quarantined: Sequence[QuarantinedRecord] = ()
) -> None:
    """The tasks, and the mesh records that could not be read while listing them (skipped, not fatal)."""
    if as_json:
        emit_json({"ok": True, "tasks": rows, "quarantined": [q.as_json() for q in quarantined]})
        return
    columns = ["task_id", "project", "state", "title", "proposer", "assignee", "last_action", "updated_at"]
    if any("why" in r for r in rows):
        columns.append("why")
    console.print(table(f"{title} ({len(rows)})", columns, [[r.get(c) for c in columns] for r in rows]))
    if quarantined:
        n = len(quarantined)
        err_console.print(shown(f"{n} unreadable mesh record{'s' if n != 1 else ''} quarantined (skipped):"))
    for q in quarantined:  # a key written around epibus may hold anything: shown() spells it out
        err_console.print(shown(f"  {q.key} revision {q.revision}: {q.reason}"), soft_wrap=True)


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
    parent: Annotated[
        str | None, typer.Option("--parent", help="The task this one follows from (id or unique prefix).")
    ] = None,
    payload: Annotated[str | None, typer.Option("--payload", help="A JSON object for the assignee.")] = None,
    task_id: Annotated[str | None, typer.Option("--task-id", help="[default: the message id]")] = None,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Propose work to a project's coordinators."""
    data = _payload(payload)
    due, mid = parse_time(deadline, "--deadline", ahead=True), message_id_of(message_id)

    async def work(m: MeshAgent) -> Outcome:
        parent_id = None if parent is None else await ids.task_id(m, parent, field="--parent", project=project)
        return await m.propose(
            project,
            title,
            summary,
            category=category,
            agents=to or (),
            capabilities=capability or (),
            deadline=due,
            parent_id=parent_id,
            payload=data,
            task_id=task_id,
            message_id=mid,
        )

    outcome = run_mesh(nats, agent, home, work)
    if quiet and not as_json:
        print(outcome.record.task_id, flush=True)
        return
    _show_outcome(outcome, as_json)


def _payload(value: str | None) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidEvent("--payload", f"is not JSON ({e})") from None
    except RecursionError:
        raise InvalidEvent("--payload", "is JSON nested too deeply to decode") from None
    except ValueError as e:  # e.g. an integer longer than Python's 4300-digit conversion limit
        raise InvalidEvent("--payload", f"holds a value JSON cannot decode here ({e})") from None
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
    mid = message_id_of(message_id)
    _show_outcome(
        run_task(
            nats,
            agent,
            home,
            task,
            project,
            lambda m, t: m.accept(t, assignee=assignee, project=project, message_id=mid),
        ),
        as_json,
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
    mid = message_id_of(message_id)
    _show_outcome(
        run_task(nats, agent, home, task, project, lambda m, t: m.decline(t, reason, project=project, message_id=mid)),
        as_json,
    )


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
    mid = message_id_of(message_id)
    outcome = run_task(
        nats,
        agent,
        home,
        task,
        project,
        lambda m, t: m.change(
            t,
            project=project,
            reason=reason,
            message_id=mid,
            title=title,
            summary=summary,
            category=category,
            agents=to,
            capabilities=capability,
            deadline=parse_time(deadline, "--deadline", ahead=True),
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
    mid = message_id_of(message_id)
    _show_outcome(
        run_task(nats, agent, home, task, project, lambda m, t: m.start(t, project=project, message_id=mid)), as_json
    )


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
    mid = message_id_of(message_id)
    pointers = [_evidence(e) for e in evidence or []]

    from mesh.commits import require_commit

    async def work(m: MeshAgent, whole: str) -> Outcome:
        if repo is not None:
            entry = await m.locate(whole, project)
            await asyncio.to_thread(require_commit, repo, sha, task=f"{whole} ({entry.record.state})")
        return await m.complete(whole, sha, evidence=pointers, note=note, project=project, message_id=mid)

    _show_outcome(run_task(nats, agent, home, task, project, work), as_json)


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
    mid = message_id_of(message_id)
    _show_outcome(
        run_task(nats, agent, home, task, project, lambda m, t: m.fail(t, reason, project=project, message_id=mid)),
        as_json,
    )


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
    mid = message_id_of(message_id)
    _show_outcome(
        run_task(
            nats, agent, home, task, project, lambda m, t: m.cancel(t, reason=reason, project=project, message_id=mid)
        ),
        as_json,
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
    mid = message_id_of(message_id)
    _show_outcome(
        run_task(nats, agent, home, task, project, lambda m, t: m.acknowledge(t, project=project, message_id=mid)),
        as_json,
    )


async def until_stopped(work: Awaitable[None], done: asyncio.Event) -> None:
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
