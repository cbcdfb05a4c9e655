"""One agent's handle on the mesh: every protocol message (propose, decide, start, complete, fail, cancel,
acknowledge, expire), the coordinator roster and advertised capabilities.

Each message is read (verified) → `advance` → the step signed → a node asked to write it (mesh.service: the
node re-checks everything and writes with compare-and-set on the task's KV revision) → one event on the bus.
A lost race re-reads and re-decides (so of two coordinators deciding one proposal exactly one wins, the other
gets an IllegalTransition naming the winner's state). A message id already applied returns the recorded
outcome and re-sends the same event id (deduplicated by the stream and the journal): retries are idempotent."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bus.client import EpibusClient
from bus.errors import Conflict, Forbidden, IllegalTransition, InvalidEvent, NotFound
from bus.ids import new_event_id
from bus.kinds import Evidence
from bus.publish import Receipt
from bus.subjects import MESH_STEP
from mesh.events import opening_record, step_event, unsigned_step_event
from mesh.protocol import NO_COORDINATORS, advance, awaits_acknowledgement, child_task_id, counter_record
from mesh.roster import RosterChanges
from mesh.store import MeshStore, TaskEntry, retry_on_conflict, utc_now
from mesh.task import Message, Roster, Step, Targets, TaskRecord, message_digest, parse_message
from mesh.vocab import ActionCategory, TaskAction
from mesh.wire import StepRequest

log = logging.getLogger(__name__)
# What deciding on a stale basis can raise: the message is decided again on a fresh read, which raises it anew
# if it still holds.
STALE_BASIS = (IllegalTransition, Forbidden, NotFound, InvalidEvent, Conflict)


@dataclass(frozen=True)
class Outcome:
    """What a message did: the task after it, the step it made, and whether it was a replay."""

    record: TaskRecord
    revision: int
    step: Step
    duplicate: bool
    receipts: tuple[Receipt, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.record.task_id,
            "project": self.record.proposal.project,
            "state": self.record.state.value,
            "revision": self.revision,
            "action": self.step.action.value,
            "message_id": str(self.step.message_id),
            "duplicate": self.duplicate,
            "events": [{"event_id": str(r.event_id), "level": r.level.value} for r in self.receipts],
        }


class MeshAgent(RosterChanges):
    """The mesh as one agent (the client's agent) sees it. Use while the client is connected."""

    def __init__(self, client: EpibusClient, *, clock: Callable[[], datetime] = utc_now) -> None:
        self.client = client
        self.clock = clock
        self._store: MeshStore | None = None

    @property
    def store(self) -> MeshStore:
        if self._store is None or self._store.js is not self.client.js:
            self._store = MeshStore(self.client.js, replicas=self.client.replicas)
        return self._store

    # -- messages --------------------------------------------------------------------------------------

    async def send(self, message: Message) -> Outcome:
        """Apply one message. Raises NotFound (no such task or project), IllegalTransition, Forbidden,
        InvalidEvent (nothing written in every case), Conflict (a message id reused for something else),
        MalformedRecord (the task or its roster cannot be read or trusted: quarantined, never acted on)."""
        if message.sender != self.agent:
            raise Forbidden(self.agent, f"send {message.action}", f"as {message.sender}", "an agent sends as itself")

        fresh = False

        async def attempt() -> Outcome:
            nonlocal fresh
            if not fresh:  # the first attempt decides on what this agent verified already, if it has it
                fresh = True
                basis = self._known_basis(message)
                if basis is not None:
                    try:
                        decided = await self._decide(message, *basis)
                    except STALE_BASIS as e:  # the basis may be stale: decided again on what the bucket holds
                        log.debug("task %s: deciding again on a fresh read (%s)", message.task_id, e)
                    else:
                        return await self._apply(decided, basis[1])
            entry = await self.store.get_task(message.project, message.task_id)
            roster = (await self.store.get_roster(message.project)).roster
            return await self._apply(await self._decide(message, entry, roster), roster)

        return await retry_on_conflict(attempt, what=f"task {message.task_id}")

    def _known_basis(self, message: Message) -> tuple[TaskEntry | None, Roster] | None:
        """The task and roster this agent's store verified moments ago (its inbox keeps them current), or None
        when it has not: then the basis is read."""
        known = self.store.known_roster(message.project)
        if known is None:
            return None
        entry = self.store.known_task(message.project, message.task_id, known.roster)
        if entry is None and message.action is not TaskAction.propose:
            return None
        return entry, known.roster

    async def _decide(
        self, message: Message, entry: TaskEntry | None, roster: Roster
    ) -> Outcome | tuple[StepRequest, TaskRecord]:
        """What `message` does to the task at `entry` (None: absent) against `roster`, decided here, nothing
        asked yet: the recorded outcome of a replay, or the signed request for the node and the record it makes."""
        if entry is not None and (step := entry.record.step_for(message.message_id)) is not None:
            return await self._replay(entry, step, message)
        if entry is None and message.action is not TaskAction.propose:
            raise NotFound("task", message.task_id, f"project {message.project} has no such task")
        if message.action is TaskAction.propose and not roster.coordinators:
            raise NotFound("project", message.project, f"task {message.task_id} cannot be proposed: {NO_COORDINATORS}")
        at = self.clock()
        record = advance(
            entry.record if entry is not None else None,
            message,
            coordinators=frozenset(roster.coordinators),
            now=at,
            roster_version=roster.version,
        )
        request = self.signed_request(record, message, entry.revision if entry is not None else 0, roster.version, at)
        return request, request.signed(record)

    async def _apply(self, decided: Outcome | tuple[StepRequest, TaskRecord], roster: Roster) -> Outcome:
        """Ask the node to write the decided step. Its refusals are raised as they are: decided on a revision or a
        roster the node no longer holds, the refusal is a lost race, which is decided again on a fresh read."""
        if isinstance(decided, Outcome):
            return decided
        request, signed = decided
        revision = await self.ask_node(MESH_STEP, request)
        # What the node wrote (it made the same record): the next message on the task decides on it unread.
        self.store.made(signed, signed.model_dump_json().encode(), revision=revision, roster=roster)
        return await self._follow_up(TaskEntry(signed, revision), len(signed.steps) - 1, duplicate=False)

    async def _replay(self, entry: TaskEntry, step: Step, message: Message) -> Outcome:
        same = (step.action, step.actor) == (message.action, message.sender)
        if not same or (step.digest is not None and step.digest != message_digest(message)):
            raise Conflict(
                f"message {message.message_id}",
                f"it was already applied to task {message.task_id} as {step.action} by {step.actor}, "
                "with other content",
                fix="send a new message id for a new message",
            )
        return await self._follow_up(entry, entry.record.steps.index(step), duplicate=True)

    def signed_request(
        self, record: TaskRecord, message: Message, revision: int, roster_version: int, at: datetime
    ) -> StepRequest:
        """The request for the node: `record` (what `message` makes, by `advance`) with its newest step signed by
        this agent (and, for a change, the counter-proposal's first step)."""
        key, session = self.client.key, self.client.session_id
        counter = None
        if record.last_step.action is TaskAction.change:
            counter = key.sign_v1(unsigned_step_event(opening_record(record), 0, key.actor, session)).signature
        signed = key.sign_v1(unsigned_step_event(record, len(record.steps) - 1, key.actor, session))
        assert signed.signature is not None
        return StepRequest(
            message=message,
            revision=revision,
            roster_version=roster_version,
            at=at,
            public_key=key.public_key,
            session_id=session,
            signature=signed.signature,
            counter_signature=counter,
        )

    async def _follow_up(self, entry: TaskEntry, index: int, *, duplicate: bool) -> Outcome:
        """The step's event, published again on a replay (idempotent: the stream and the journal deduplicate
        it by id; the node's MeshRecorder publishes it from the bucket if this agent stops first), and for a
        change the counter-proposal's (the node created its task)."""
        record, step = entry.record, entry.record.steps[index]
        receipts = [await self.client.publish(step_event(record, index))]
        if step.action is TaskAction.change:
            receipts.append(await self.client.publish(step_event(counter_record(step), 0)))
        return Outcome(record, entry.revision, step, duplicate, tuple(receipts))

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
