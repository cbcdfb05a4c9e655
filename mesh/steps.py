"""How one protocol message becomes a step: decided with `advance` on the task and roster this agent verified
(read again when that basis is missing or stale), signed, written by a node, then published as the step's
event. A message id already applied returns the recorded outcome and re-sends the same event id."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from bus.client.client import EpibusClient
from bus.errors import Conflict, Forbidden, IllegalTransition, InvalidEvent, NotFound
from bus.outbox.publish import Receipt
from bus.subjects import MESH_STEP
from mesh.events import step_event
from mesh.protocol import NO_COORDINATORS, advance, counter_record
from mesh.signer import MeshSigner
from mesh.store import MeshStore, TaskEntry, retry_on_conflict
from mesh.task import Message, Roster, Step, TaskRecord, message_digest
from mesh.vocab import TaskAction
from mesh.wire import StepRequest

log = logging.getLogger(__name__)
# What deciding on a stale basis can raise: the message is decided again on a fresh read, which raises it anew
# if it still holds.
STALE_BASIS = (IllegalTransition, Forbidden, NotFound, InvalidEvent, Conflict)
Ask = Callable[[str, BaseModel], Awaitable[int]]


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


class StepSender:
    """Sends one agent's messages: `store` gives the agent's (verifying) store, `ask` asks a node to write,
    `client` publishes the events."""

    def __init__(
        self,
        client: EpibusClient,
        store: Callable[[], MeshStore],
        signer: MeshSigner,
        ask: Ask,
        clock: Callable[[], datetime],
    ) -> None:
        self.client = client
        self.store = store
        self.signer = signer
        self.ask = ask
        self.clock = clock

    async def send(self, message: Message) -> Outcome:
        """See MeshAgent.send."""
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
            entry = await self.store().get_task(message.project, message.task_id)
            roster = (await self.store().get_roster(message.project)).roster
            return await self._apply(await self._decide(message, entry, roster), roster)

        return await retry_on_conflict(attempt, what=f"task {message.task_id}")

    def _known_basis(self, message: Message) -> tuple[TaskEntry | None, Roster] | None:
        """The task and roster this agent's store verified moments ago (its inbox keeps them current), or None
        when it has not: then the basis is read."""
        known = self.store().known_roster(message.project)
        if known is None:
            return None
        entry = self.store().known_task(message.project, message.task_id, known.roster)
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
        revision = entry.revision if entry is not None else 0
        request = self.signer.step_request(record, message, revision, roster.version, at)
        return request, request.signed(record)

    async def _apply(self, decided: Outcome | tuple[StepRequest, TaskRecord], roster: Roster) -> Outcome:
        """Ask the node to write the decided step. Its refusals are raised as they are: decided on a revision or a
        roster the node no longer holds, the refusal is a lost race, which is decided again on a fresh read."""
        if isinstance(decided, Outcome):
            return decided
        request, signed = decided
        revision = await self.ask(MESH_STEP, request)
        # What the node wrote (it made the same record): the next message on the task decides on it unread.
        self.store().made(signed, signed.model_dump_json().encode(), revision=revision, roster=roster)
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

    async def _follow_up(self, entry: TaskEntry, index: int, *, duplicate: bool) -> Outcome:
        """The step's event, published again on a replay (idempotent: the stream and the journal deduplicate
        it by id; the node's MeshRecorder publishes it from the bucket if this agent stops first), and for a
        change the counter-proposal's (the node created its task)."""
        record, step = entry.record, entry.record.steps[index]
        receipts = [await self.client.publish(step_event(record, index))]
        if step.action is TaskAction.change:
            receipts.append(await self.client.publish(step_event(counter_record(step), 0)))
        return Outcome(record, entry.revision, step, duplicate, tuple(receipts))
