"""The mesh's event kinds: every task transition and every change of a project's coordinators is also an
event on the bus (journaled, recallable, visible in `tail`). Each event is its own artifact; its event id is
the message id, so a retried message is deduplicated by the stream and the journal."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from bus.enrolment.registry import AgentRegistry
from bus.errors import InvalidEvent
from bus.identity.signing import verify_signature
from bus.model.event import LEGACY_SCHEMA_VERSION, Actor, Envelope, validate_event
from bus.model.fields import AgentId, Count, ShortText, Text
from bus.model.kinds import Body, Evidence, register_kind
from mesh.protocol import counter_opening
from mesh.task import CommitSha, Digest, Roster, RosterDraft, TaskId, TaskRecord, proposal_digest
from mesh.vocab import ActionCategory, MeshRole, TaskAction, TaskState


def _without_unset(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """Fields added after events of a kind were first signed are left out when unset, so the events signed
    before them serialize (and verify) byte for byte as they were signed."""
    return {k: v for k, v in data.items() if not (k in names and v is None)}


TASK_KIND = "task"
COORDINATORS_KIND = "coordinators"


class TaskEventBody(Body):
    kind: ClassVar[str] = TASK_KIND
    system_record: ClassVar[bool] = True  # written by MeshAgent after the KV compare-and-set, never by hand
    task_id: TaskId
    step: Count  # position in the task's history, 1 for the proposal
    action: TaskAction
    from_state: TaskState | None
    to_state: TaskState
    roles: tuple[MeshRole, ...]
    title: ShortText
    summary: Text
    category: ActionCategory
    proposer: AgentId
    assignee: AgentId | None = None
    parent_id: TaskId | None = None
    child_id: TaskId | None = None
    policy: ShortText | None = None
    reason: Text | None = None
    sha: CommitSha | None = None
    evidence: tuple[Evidence, ...] = ()
    note: Text | None = None
    # What the signature binds beyond the fields above: the whole proposal (targets, payload, deadline...), the
    # counter-proposal of a change, and the roster version the step was judged against.
    proposal_digest: Digest | None = None
    counter_digest: Digest | None = None
    roster_version: Annotated[int, Field(ge=0, strict=True)] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset(handler(self), ("proposal_digest", "counter_digest", "roster_version"))

    def content_text(self) -> str:
        moved = f"{self.from_state} -> {self.to_state}" if self.from_state else str(self.to_state)
        parts = [f"task {self.title!r} ({self.category}): {self.action} ({moved}). {self.summary}"]
        for label, value in (
            ("assignee", self.assignee),
            ("reason", self.reason),
            ("commit", self.sha),
            ("note", self.note),
            ("counter-proposal", self.child_id),
        ):
            if value:
                parts.append(f"{label}: {value}")
        return " ".join(parts)


class CoordinatorsEventBody(Body):
    kind: ClassVar[str] = COORDINATORS_KIND
    system_record: ClassVar[bool] = True
    change: Literal["add", "remove"]
    agent: AgentId
    coordinators: tuple[AgentId, ...]  # the project's coordinators after the change
    seq: Count | None = None  # the change's place in the project's roster (1 for the first)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset(handler(self), ("seq",))

    def content_text(self) -> str:
        verb = "added to" if self.change == "add" else "removed from"
        return f"{self.agent} {verb} the coordinators; now: {', '.join(self.coordinators) or 'none'}"


register_kind(TaskEventBody)
register_kind(CoordinatorsEventBody)


def task_event_body(record: TaskRecord, index: int) -> TaskEventBody:
    """The event of the record's step at `index` (0-based), rebuilt identically on every call."""
    step = record.steps[index]
    proposal = record.proposal
    completion = step.completion
    return TaskEventBody(
        task_id=proposal.task_id,
        step=index + 1,
        action=step.action,
        from_state=step.from_state,
        to_state=step.to_state,
        roles=step.roles,
        title=proposal.title,
        summary=proposal.summary,
        category=proposal.category,
        proposer=proposal.proposer,
        assignee=step.assignee,
        parent_id=proposal.parent_id,
        child_id=step.child_id,
        policy=step.policy,
        reason=step.reason,
        sha=completion.sha if completion else None,
        evidence=completion.evidence if completion else (),
        note=completion.note if completion else None,
        proposal_digest=proposal_digest(proposal),
        counter_digest=proposal_digest(step.counter) if step.counter is not None else None,
        roster_version=step.roster_version,
    )


def step_event(record: TaskRecord, index: int) -> Envelope:
    """The signed event of the record's step at `index`, rebuilt byte for byte from the record: the event id
    is the step's message id, the signature the one the actor stored with the step. Raises InvalidEvent for a
    step that carries no signature."""
    step = record.steps[index]
    if step.signature is None or step.public_key is None or step.session_id is None:
        raise InvalidEvent(f"task {record.task_id} step {index + 1}", "carries no signature; it has no event")
    actor = Actor(agent_id=step.actor, public_key=step.public_key)
    return validate_event(_step_event_fields(record, index, actor, step.session_id) | {"signature": step.signature})


def unsigned_step_event(record: TaskRecord, index: int, actor: Actor, session_id: str) -> Envelope:
    """The step's event before its actor signs it."""
    return validate_event(_step_event_fields(record, index, actor, session_id))


def _step_event_fields(record: TaskRecord, index: int, actor: Actor, session_id: str) -> dict[str, Any]:
    step = record.steps[index]
    return {
        "event_id": step.message_id,
        # Mesh records keep the signature and the event is rebuilt from them: the legacy format, signed inside.
        "schema_version": LEGACY_SCHEMA_VERSION,
        "project": record.proposal.project,
        "kind": TASK_KIND,
        "artifact_id": str(step.message_id),
        "actor": actor,
        "session_id": session_id,
        "recorded_at": step.at,
        "body": task_event_body(record, index),
    }


async def verify_step(record: TaskRecord, index: int, registry: AgentRegistry) -> Envelope:
    """The step's event, checked: signed by its actor with the key registered to that agent. Raises
    InvalidEvent (unsigned, or a signature that does not verify) or Conflict (another key is registered)."""
    event = step_event(record, index)
    verify_signature(event)
    await registry.bind(event.actor)
    return event


def roster_event(roster: Roster, index: int) -> Envelope:
    """The signed `coordinators` event of the roster's change at `index` (0-based), rebuilt from the roster."""
    change = roster.changes[index]
    actor = Actor(agent_id=change.actor, public_key=change.public_key)
    return unsigned_roster_event(
        roster.project, change, seq=index + 1, actor=actor, session_id=change.session_id
    ).model_copy(update={"signature": change.signature})


def unsigned_roster_event(project: str, change: RosterDraft, *, seq: int, actor: Actor, session_id: str) -> Envelope:
    """A roster change's event before its actor signs it: the change's signature is the signature of this."""
    body = CoordinatorsEventBody(change=change.change, agent=change.agent, coordinators=change.coordinators, seq=seq)
    return validate_event(
        {
            "event_id": change.message_id,
            "schema_version": LEGACY_SCHEMA_VERSION,
            "project": project,
            "kind": COORDINATORS_KIND,
            "artifact_id": str(change.message_id),
            "actor": actor,
            "session_id": session_id,
            "recorded_at": change.at,
            "body": body,
        }
    )


def with_signatures(
    record: TaskRecord, *, public_key: str, session_id: str, signature: str, counter_signature: str | None
) -> TaskRecord:
    """The record with its newest step signed (and, for a change, the counter-proposal's first step)."""
    step = record.last_step
    signed = {"public_key": public_key, "session_id": session_id}
    if step.action is TaskAction.change and step.counter is not None:
        if counter_signature is None:
            raise InvalidEvent("counter_signature", "is required: a change signs its counter-proposal's first step")
        opening = counter_opening(step).model_copy(update=signed | {"signature": counter_signature})
        step = step.model_copy(update={"counter_opening": opening})
    step = step.model_copy(update=signed | {"signature": signature})
    return record.model_copy(update={"steps": (*record.steps[:-1], step)})


def opening_record(change: TaskRecord) -> TaskRecord:
    """The counter-proposal a record's newest step (a change) creates, before its opening step is signed."""
    step = change.last_step
    assert step.counter is not None
    return TaskRecord(proposal=step.counter, state=TaskState.proposed, steps=(counter_opening(step),))
