"""The mesh's MCP tools: propose work, decide it, do it, close the handshake, and see what waits for this agent.
Each step is the mesh agent's own call, signed by the session's agent and written by a node, as from the CLI."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.model.ids import parse_event_id
from bus.model.records import QuarantinedRecord
from bus.model.vocab import describe
from epibus.mcp_tools import inputs as i
from epibus.mcp_tools.session import AgentSession
from epibus.mcp_tools.tools import Result, ToolSpec
from epibus.times import parse_time
from mesh.agent import MeshAgent, Outcome
from mesh.commits import require_commit
from mesh.inbox import inbox_now
from mesh.vocab import TaskAction


def _message_id(value: str | None) -> uuid.UUID | None:
    return None if value is None else parse_event_id(value, "message_id")


def _outcome(outcome: Outcome) -> Result:
    return {"ok": True, **outcome.as_json()}


def _listed(tasks: list[Result], skipped: list[QuarantinedRecord]) -> Result:
    """The tasks, and the records this listing skipped because they could not be trusted or read."""
    return {"tasks": tasks, "quarantined": [record.as_json() for record in skipped]}


async def _listing(session: AgentSession, read: Callable[[MeshAgent], Awaitable[list[Result]]]) -> Result:
    # A mesh agent of its own per listing: its quarantine holds what this listing skipped, as a CLI run's does.
    mesh = MeshAgent(await session.client())
    tasks = await read(mesh)
    return _listed(tasks, mesh.store.quarantine.records)


async def propose(session: AgentSession, args: i.ProposeInput) -> Result:
    mesh = await session.mesh()
    outcome = await mesh.propose(
        args.project,
        args.title,
        args.summary,
        category=args.category,
        agents=args.to,
        capabilities=args.capabilities,
        deadline=parse_time(args.deadline, "deadline", ahead=True),
        parent_id=args.parent_id,
        payload=args.payload,
        task_id=args.task_id,
        message_id=_message_id(args.message_id),
    )
    return _outcome(outcome)


async def accept(session: AgentSession, args: i.AcceptInput) -> Result:
    mesh = await session.mesh()
    mid = _message_id(args.message_id)
    return _outcome(await mesh.accept(args.task_id, assignee=args.assignee, project=args.project, message_id=mid))


async def decline(session: AgentSession, args: i.ReasonedTaskInput) -> Result:
    mesh = await session.mesh()
    mid = _message_id(args.message_id)
    return _outcome(await mesh.decline(args.task_id, args.reason, project=args.project, message_id=mid))


async def start(session: AgentSession, args: i.TaskInput) -> Result:
    mesh = await session.mesh()
    return _outcome(await mesh.start(args.task_id, project=args.project, message_id=_message_id(args.message_id)))


async def complete(session: AgentSession, args: i.CompleteInput) -> Result:
    mesh = await session.mesh()
    if args.repo is not None:
        entry = await mesh.locate(args.task_id, args.project)
        where = f"{args.task_id} ({entry.record.state})"
        repo = await asyncio.to_thread(Path(args.repo).expanduser)
        await asyncio.to_thread(require_commit, repo, args.sha, task=where)
    outcome = await mesh.complete(
        args.task_id,
        args.sha,
        evidence=list(args.evidence),
        note=args.note,
        project=args.project,
        message_id=_message_id(args.message_id),
    )
    return _outcome(outcome)


async def fail(session: AgentSession, args: i.ReasonedTaskInput) -> Result:
    mesh = await session.mesh()
    mid = _message_id(args.message_id)
    return _outcome(await mesh.fail(args.task_id, args.reason, project=args.project, message_id=mid))


async def cancel(session: AgentSession, args: i.CancelInput) -> Result:
    mesh = await session.mesh()
    mid = _message_id(args.message_id)
    return _outcome(await mesh.cancel(args.task_id, reason=args.reason, project=args.project, message_id=mid))


async def acknowledge(session: AgentSession, args: i.TaskInput) -> Result:
    mesh = await session.mesh()
    mid = _message_id(args.message_id)
    return _outcome(await mesh.acknowledge(args.task_id, project=args.project, message_id=mid))


async def inbox(session: AgentSession, args: i.MeshListInput) -> Result:
    async def read(mesh: MeshAgent) -> list[Result]:
        return [entry.summary(why) for entry, why in await inbox_now(mesh, args.project)]

    return await _listing(session, read)


async def pending(session: AgentSession, args: i.MeshListInput) -> Result:
    async def read(mesh: MeshAgent) -> list[Result]:
        return [entry.summary() for entry in await mesh.pending(args.project)]

    return await _listing(session, read)


async def outbox(session: AgentSession, args: i.MeshListInput) -> Result:
    async def read(mesh: MeshAgent) -> list[Result]:
        return [entry.summary() for entry in await mesh.outbox(args.project)]

    return await _listing(session, read)


async def show_task(session: AgentSession, args: i.TaskRef) -> Result:
    entry = await (await session.mesh()).locate(args.task_id, args.project)
    return {"revision": entry.revision, **entry.record.model_dump(mode="json")}


def mesh_tools() -> list[ToolSpec]:
    steps = describe(TaskAction)
    return [
        ToolSpec(
            "propose",
            "Propose work to a project's coordinators (this agent is the proposer). Only work a coordinator "
            "accepts may be started.",
            i.ProposeInput,
            propose,
        ),
        ToolSpec("accept", "Accept a proposal and name its assignee (coordinators only).", i.AcceptInput, accept),
        ToolSpec(
            "decline",
            "Decline a proposal, with the reason (coordinators only).",
            i.ReasonedTaskInput,
            decline,
            destructive=True,
        ),
        ToolSpec("start", "Start accepted work (its assignee only).", i.TaskInput, start),
        ToolSpec(
            "complete",
            "Complete started work with the commit that holds it (its assignee only); with repo, the SHA must "
            "be a commit there.",
            i.CompleteInput,
            complete,
        ),
        ToolSpec(
            "fail", "Give up on accepted or started work, with the reason (its assignee).", i.ReasonedTaskInput, fail
        ),
        ToolSpec(
            "cancel", "Withdraw an open task (its proposer or a coordinator).", i.CancelInput, cancel, destructive=True
        ),
        ToolSpec(
            "acknowledge",
            "Acknowledge a completion, closing the handshake (its proposer only).",
            i.TaskInput,
            acknowledge,
        ),
        ToolSpec(
            "inbox",
            "What needs this agent now: proposals to decide or to it, work assigned to it, news on its proposals.",
            i.MeshListInput,
            inbox,
            read_only=True,
        ),
        ToolSpec(
            "pending",
            "Completed tasks their proposer has not acknowledged yet (open handshakes).",
            i.MeshListInput,
            pending,
            read_only=True,
        ),
        ToolSpec("outbox", "Tasks this agent proposed, wherever they stand.", i.MeshListInput, outbox, read_only=True),
        ToolSpec(
            "show_task",
            f"One task: its proposal, state and every step with who took it. Steps: {steps}.",
            i.TaskRef,
            show_task,
            read_only=True,
        ),
    ]
