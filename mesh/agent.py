"""One agent's handle on the mesh: every protocol message (propose, decide, start, complete, fail, cancel,
acknowledge, expire), the coordinator roster and advertised capabilities. The verbs are here; how a message
becomes a step is `mesh.steps`, what the agent signs `mesh.signer`, asking a node to write `mesh.asker`, the
roster and capabilities `mesh.roster`.

Each message is read (verified) → `advance` → the step signed → a node asked to write it (mesh.service: the
node re-checks everything and writes with compare-and-set on the task's KV revision) → one event on the bus.
A lost race re-reads and re-decides (so of two coordinators deciding one proposal exactly one wins, the other
gets an IllegalTransition naming the winner's state). A message id already applied returns the recorded
outcome and re-sends the same event id (deduplicated by the stream and the journal): retries are idempotent."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from bus.client.client import EpibusClient
from bus.errors import Forbidden, InvalidEvent, NotFound
from bus.model.ids import new_event_id
from bus.model.kinds import Evidence
from mesh.asker import NodeAsker
from mesh.protocol import awaits_acknowledgement, child_task_id
from mesh.roster import RosterChanges
from mesh.signer import MeshSigner
from mesh.steps import STALE_BASIS as STALE_BASIS
from mesh.steps import Outcome as Outcome
from mesh.steps import StepSender
from mesh.store import MeshStore, Roster, TaskEntry, utc_now
from mesh.task import AgentCapabilities, Message, Targets, TaskRecord, parse_message
from mesh.vocab import ActionCategory, TaskAction
from mesh.wire import StepRequest


class MeshAgent:
    """The mesh as one agent (the client's agent) sees it. Use while the client is connected."""

    def __init__(self, client: EpibusClient, *, clock: Callable[[], datetime] = utc_now) -> None:
        self.client = client
        self.clock = clock
        self.agent = client.key.agent_id
        self._store: MeshStore | None = None
        self.asker = NodeAsker(client)
        self.signer = MeshSigner(client.key, client.session_id)
        # Through `ask_node`, so that a caller wrapping it sees every request.
        self.steps = StepSender(client, lambda: self.store, self.signer, self._ask, clock)
        self.roster = RosterChanges(client, lambda: self.store, self.signer, self._ask, clock)

    @property
    def store(self) -> MeshStore:
        enrolment = self.client.enrolment  # known once connected: a confined agent reads its projects only
        projects = enrolment.projects if enrolment is not None else None
        store = self._store
        if store is None or store.js is not self.client.js or store.projects != MeshStore.readable(projects):
            self._store = MeshStore(self.client.js, replicas=self.client.replicas, projects=projects)
        assert self._store is not None
        return self._store

    async def _ask(self, subject: str, request: BaseModel) -> int:
        return await self.ask_node(subject, request)

    async def ask_node(self, subject: str, request: BaseModel) -> int:
        """See NodeAsker.ask: a node asked to write; the revision it wrote."""
        return await self.asker.ask(subject, request)

    def signed_request(
        self, record: TaskRecord, message: Message, revision: int, roster_version: int, at: datetime
    ) -> StepRequest:
        """See MeshSigner.step_request."""
        return self.signer.step_request(record, message, revision, roster_version, at)

    # -- messages --------------------------------------------------------------------------------------

    async def send(self, message: Message) -> Outcome:
        """Apply one message. Raises NotFound (no such task or project), IllegalTransition, Forbidden,
        InvalidEvent (nothing written in every case), Conflict (a message id reused for something else),
        MalformedRecord (the task or its roster cannot be read or trusted: quarantined, never acted on)."""
        if message.sender != self.agent:
            raise Forbidden(self.agent, f"send {message.action}", f"as {message.sender}", "an agent sends as itself")
        return await self.steps.send(message)

    def message(self, action: TaskAction, project: str, task_id: str, **fields: Any) -> Message:
        """A validated message from this agent; InvalidEvent names the task and the field."""
        raw = {
            "message_id": fields.pop("message_id", None) or new_event_id(),
            "action": action,
            "project": project,
            "task_id": task_id,
            "sender": self.agent,
            **{k: v for k, v in fields.items() if v is not None},
        }
        return parse_message(raw)

    async def locate(self, task_id: str, project: str | None = None) -> TaskEntry:
        """The task, in the given project or whichever holds it. Raises NotFound."""
        entry = (
            await self.store.get_task(project, task_id) if project is not None else await self.store.find_task(task_id)
        )
        if entry is None:
            where = f"in project {project}" if project else "in any project"
            raise NotFound("task", task_id, f"no task with this id {where}; list them with `epibus mesh outbox`")
        return entry

    async def propose(
        self,
        project: str,
        title: str,
        summary: str,
        *,
        category: ActionCategory | str,
        agents: Sequence[str] = (),
        capabilities: Sequence[str] = (),
        deadline: datetime | None = None,
        parent_id: str | None = None,
        payload: dict[str, Any] | None = None,
        task_id: str | None = None,
        message_id: uuid.UUID | None = None,
    ) -> Outcome:
        message_id = message_id or new_event_id()
        task_id = task_id or str(message_id)
        proposal = {
            "task_id": task_id,
            "project": project,
            "title": title,
            "summary": summary,
            "proposer": self.agent,
            "targets": {"agents": list(agents), "capabilities": list(capabilities)},
            "category": category,
            "deadline": deadline,
            "parent_id": parent_id,
            "payload": payload or {},
        }
        return await self.send(
            self.message(TaskAction.propose, project, task_id, proposal=proposal, message_id=message_id)
        )

    async def _act(self, action: TaskAction, task_id: str, project: str | None, **fields: Any) -> Outcome:
        if project is None:
            project = (await self.locate(task_id)).record.proposal.project
        try:
            message = self.message(action, project, task_id, **fields)
        except InvalidEvent as e:  # name the task's state too (read only on this error path)
            entry = await self.store.get_task(project, task_id)
            state = entry.record.state.value if entry is not None else "absent"
            where = e.field.replace(f"task {task_id} ", f"task {task_id} ({state}) ", 1)
            raise InvalidEvent(where, e.problem, allowed=e.allowed) from e
        return await self.send(message)

    async def accept(
        self,
        task_id: str,
        *,
        assignee: str | None = None,
        project: str | None = None,
        policy: str = "manual",
        message_id: uuid.UUID | None = None,
    ) -> Outcome:
        return await self._act(
            TaskAction.accept, task_id, project, assignee=assignee, policy=policy, message_id=message_id
        )

    async def decline(
        self,
        task_id: str,
        reason: str,
        *,
        project: str | None = None,
        policy: str = "manual",
        message_id: uuid.UUID | None = None,
    ) -> Outcome:
        return await self._act(
            TaskAction.decline, task_id, project, reason=reason, policy=policy, message_id=message_id
        )

    async def change(
        self,
        task_id: str,
        *,
        project: str | None = None,
        reason: str | None = None,
        policy: str = "manual",
        message_id: uuid.UUID | None = None,
        **counter: Any,
    ) -> Outcome:
        """Counter-propose: the task becomes `changed` and a new proposal, linked to it by parent_id and
        owned by the same proposer, takes its place. `counter` overrides the parent's proposal fields
        (title, summary, category, agents, capabilities, deadline, payload)."""
        parent = (await self.locate(task_id, project)).record.proposal
        message_id = message_id or new_event_id()
        agents = counter.pop("agents", None)
        capabilities = counter.pop("capabilities", None)
        unknown = set(counter) - {"title", "summary", "category", "deadline", "payload"}
        if unknown:
            raise InvalidEvent(f"task {task_id} change.{sorted(unknown)[0]}", "is not a proposal field one can change")
        targets = Targets(
            agents=tuple(agents) if agents is not None else parent.targets.agents,
            capabilities=tuple(capabilities) if capabilities is not None else parent.targets.capabilities,
        )
        proposal = parent.model_dump(mode="json") | {
            "task_id": child_task_id(message_id),
            "parent_id": parent.task_id,
            "targets": targets.model_dump(mode="json"),
            **{k: v for k, v in counter.items() if v is not None},
        }
        return await self.send(
            self.message(
                TaskAction.change,
                parent.project,
                task_id,
                proposal=proposal,
                reason=reason,
                policy=policy,
                message_id=message_id,
            )
        )

    async def start(self, task_id: str, *, project: str | None = None, message_id: uuid.UUID | None = None) -> Outcome:
        return await self._act(TaskAction.start, task_id, project, message_id=message_id)

    async def complete(
        self,
        task_id: str,
        sha: str,
        *,
        evidence: Sequence[Evidence | dict[str, Any]] = (),
        note: str | None = None,
        project: str | None = None,
        message_id: uuid.UUID | None = None,
    ) -> Outcome:
        completion = {"sha": sha, "evidence": list(evidence), "note": note}
        return await self._act(TaskAction.complete, task_id, project, completion=completion, message_id=message_id)

    async def fail(
        self, task_id: str, reason: str, *, project: str | None = None, message_id: uuid.UUID | None = None
    ) -> Outcome:
        return await self._act(TaskAction.fail, task_id, project, reason=reason, message_id=message_id)

    async def cancel(
        self,
        task_id: str,
        *,
        reason: str | None = None,
        project: str | None = None,
        message_id: uuid.UUID | None = None,
    ) -> Outcome:
        return await self._act(TaskAction.cancel, task_id, project, reason=reason, message_id=message_id)

    async def acknowledge(
        self, task_id: str, *, project: str | None = None, message_id: uuid.UUID | None = None
    ) -> Outcome:
        return await self._act(TaskAction.acknowledge, task_id, project, message_id=message_id)

    async def expire(self, task_id: str, *, project: str | None = None, message_id: uuid.UUID | None = None) -> Outcome:
        entry = await self.locate(task_id, project)
        deadline = entry.record.proposal.deadline
        reason = f"deadline {deadline.isoformat()} passed in state {entry.record.state}" if deadline else None
        return await self._act(
            TaskAction.expire, task_id, entry.record.proposal.project, reason=reason, message_id=message_id
        )

    # -- reading ---------------------------------------------------------------------------------------

    async def tasks(self, project: str | None = None) -> list[TaskEntry]:
        return await self.store.tasks(project)

    async def pending(self, project: str | None = None, *, proposer: str | None = None) -> list[TaskEntry]:
        """Completed but not yet acknowledged: handshakes still open (with `proposer`, only those it is to
        acknowledge)."""
        return [e for e in await self.store.tasks(project) if awaits_acknowledgement(e.record, proposer)]

    async def outbox(self, project: str | None = None) -> list[TaskEntry]:
        """Tasks this agent proposed."""
        return [e for e in await self.store.tasks(project) if e.record.proposal.proposer == self.agent]

    # -- roster and capabilities (mesh.roster) ---------------------------------------------------------

    async def coordinators(self, project: str) -> tuple[str, ...]:
        return await self.roster.coordinators(project)

    async def add_coordinator(self, project: str, agent: str, *, message_id: uuid.UUID | None = None) -> Roster:
        """Seat a coordinator (see mesh.roster for who may). Seating one already there changes nothing. Raises
        Forbidden."""
        return await self.roster.change(project, agent, "add", message_id or new_event_id())

    async def remove_coordinator(self, project: str, agent: str, *, message_id: uuid.UUID | None = None) -> Roster:
        """Remove a coordinator (an admin or a coordinator; the last one stays). Raises Forbidden, NotFound."""
        return await self.roster.change(project, agent, "remove", message_id or new_event_id())

    async def advertise(self, capabilities: Sequence[str]) -> AgentCapabilities:
        """Say what this agent can do (the capability-match policy assigns by it), signed by this agent."""
        return await self.roster.advertise(capabilities)
