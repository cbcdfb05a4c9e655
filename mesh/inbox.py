"""An agent's inbox: proposals for it, work assigned to it, decisions on its proposals, and the notification log
that doubles as the inbox's cursor."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.errors import MalformedRecord
from bus.intake.cursor import Cursor, LineLog
from mesh.agent import MeshAgent
from mesh.protocol import TERMINAL
from mesh.store import MeshStore, TaskEntry
from mesh.task import TaskRecord
from mesh.vocab import TaskAction, TaskState
from mesh.watch import agent_watcher

log = logging.getLogger(__name__)
CONTEXT_REFRESH_S = 5.0  # how often an inbox re-reads the rosters and the agent's capabilities


@dataclass(frozen=True)
class Notification:
    """One task revision that concerns an agent, and why."""

    revision: int
    project: str
    task_id: str
    title: str
    state: TaskState
    action: TaskAction
    actor: str
    why: str

    def as_json(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "project": self.project,
            "task_id": self.task_id,
            "title": self.title,
            "state": self.state.value,
            "action": self.action.value,
            "actor": self.actor,
            "why": self.why,
        }


def concern(agent: str, record: TaskRecord, *, coordinates: bool, capabilities: frozenset[str]) -> str | None:
    """Why the record's latest step concerns `agent`, or None. Nothing an agent did itself is news to it."""
    step = record.last_step
    proposal = record.proposal
    if step.actor == agent and step.action is not TaskAction.propose:
        return None
    if record.state is TaskState.proposed and step.action is TaskAction.propose:
        if coordinates:
            return "awaiting your decision (you coordinate this project)"
        if step.actor == agent:
            return None
        targeted = agent in proposal.targets.agents
        needed = frozenset(proposal.targets.capabilities)
        if targeted or (needed and needed <= capabilities):
            return "proposed to you; act on it only once a coordinator accepts it"
        if proposal.proposer == agent:
            return f"counter-proposal by {step.actor} replacing {proposal.parent_id}"
        return None
    if step.action is TaskAction.accept and record.assignee == agent:
        return "assigned to you: start it"
    if proposal.proposer == agent:
        if step.action is TaskAction.complete:
            return "completed: check the commit and acknowledge it"
        return f"on your proposal: {step.action} by {step.actor}"
    if record.assignee == agent and step.action in (TaskAction.cancel, TaskAction.expire):
        return f"your assignment was {step.to_state}: stop work on it"
    return None


def inbox_reason(agent: str, record: TaskRecord, *, coordinates: bool, capabilities: frozenset[str]) -> str | None:
    """Why a task is in the agent's inbox now (None: it is not): what `concern` says of its latest step, or the
    agent's own work in progress. Terminal tasks never are. The one rule behind `mesh inbox`, the MCP `inbox`
    tool and the statusline's count."""
    if record.state in TERMINAL:
        return None
    why = concern(agent, record, coordinates=coordinates, capabilities=capabilities)
    if why is None and record.assignee == agent and record.state is TaskState.working:
        return "yours, in progress"
    return why


async def inbox_now(mesh: MeshAgent, project: str | None = None) -> list[tuple[TaskEntry, str]]:
    """The tasks in the agent's inbox now, each with why. Unreadable records are skipped into the store's
    quarantine (mesh.store.quarantine), never shown."""
    capabilities = await advertised_capabilities(mesh)
    found: list[tuple[TaskEntry, str]] = []
    coordinated: dict[str, bool] = {}
    for entry in await mesh.tasks(project):
        p = entry.record.proposal.project
        if p not in coordinated:
            coordinated[p] = await coordinates(mesh, p)
        why = inbox_reason(mesh.agent, entry.record, coordinates=coordinated[p], capabilities=capabilities)
        if why is not None:
            found.append((entry, why))
    return found


async def advertised_capabilities(mesh: MeshAgent) -> frozenset[str]:
    return await capabilities_of(mesh.store, mesh.agent)


async def capabilities_of(store: MeshStore, agent: str) -> frozenset[str]:
    """What the agent advertises. An unreadable record (the store quarantines it) reads as nothing: the agent
    is offered less work, never work meant for others."""
    try:
        advertised = await store.get_capabilities(agent)
    except MalformedRecord:
        return frozenset()
    return frozenset(advertised.capabilities) if advertised else frozenset()


async def coordinates(mesh: MeshAgent, project: str) -> bool:
    """Whether the agent coordinates `project`."""
    return mesh.agent in await coordinators_of(mesh.store, project)


async def coordinators_of(store: MeshStore, project: str) -> frozenset[str]:
    """Who coordinates `project`. An unreadable roster (the store quarantines it) reads as nobody."""
    try:
        return frozenset((await store.get_roster(project)).roster.coordinators)
    except MalformedRecord:
        return frozenset()


class Inbox:
    """Follows the mesh for one agent and calls `notify` once per revision that concerns it."""

    def __init__(
        self,
        mesh: MeshAgent,
        notify: Callable[[Notification], Awaitable[None]],
        *,
        project: str | None = None,
        cursor: Cursor | None = None,
        poll_timeout_s: float = 1.0,
    ) -> None:
        self.mesh = mesh
        self.notify = notify
        self.watcher = agent_watcher(
            mesh,
            self._handle,
            name=f"inbox:{mesh.agent}",
            project=project,
            cursor=cursor,
            poll_timeout_s=poll_timeout_s,
        )
        self._coordinated: dict[str, bool] = {}
        self._capabilities: frozenset[str] = frozenset()
        self._context_at = 0.0

    async def run(self) -> None:
        await self.watcher.run()

    async def _context(self, project: str) -> tuple[bool, frozenset[str]]:
        if time.monotonic() - self._context_at > CONTEXT_REFRESH_S:
            self._coordinated.clear()
            self._capabilities = await advertised_capabilities(self.mesh)
            self._context_at = time.monotonic()
        if project not in self._coordinated:
            self._coordinated[project] = await coordinates(self.mesh, project)
        return self._coordinated[project], self._capabilities

    async def _handle(self, entry: TaskEntry) -> None:
        record = entry.record
        coordinates, capabilities = await self._context(record.proposal.project)
        why = concern(self.mesh.agent, record, coordinates=coordinates, capabilities=capabilities)
        if why is not None:  # the watcher verified the record: forged or unsigned steps never reach here
            await self.notify(notification(entry, why))


def notification(entry: TaskEntry, why: str) -> Notification:
    record, step = entry.record, entry.record.last_step
    return Notification(
        entry.revision,
        record.proposal.project,
        record.task_id,
        record.proposal.title,
        record.state,
        step.action,
        step.actor,
        why,
    )


class NotificationLog(LineLog):
    """Notifications appended to a JSON-lines file: the file is both what the agent was told and the inbox's
    cursor (its last complete line's revision). See bus.intake.cursor.LineLog."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "revision", what="notification")

    def append(self, note: Notification) -> None:
        self.append_line(note.as_json(), note.revision)
