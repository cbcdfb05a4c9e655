"""The mesh's event kinds: every task transition and every change of a project's coordinators is also an
event on the bus (journaled, recallable, visible in `tail`). Each event is its own artifact; its event id is
the message id, so a retried message is deduplicated by the stream and the journal."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from bus.errors import Conflict, Forbidden, InvalidEvent
from bus.event import Actor, AgentId, Body, Count, Envelope, Evidence, ShortText, Text, register_kind, validate_event
from bus.registry import AgentRegistry
from bus.signing import verify_signature
from bus.vocab import ActionCategory, MeshRole, TaskAction, TaskState
from mesh.task import CommitSha, TaskId, TaskRecord

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


async def require_trusted_acceptance(record: TaskRecord, coordinators: frozenset[str], registry: AgentRegistry) -> None:
    """Only coordinator-decided work is acted on: the task's acceptance must be a signed step by an agent
    that coordinates the project. Raises Forbidden otherwise (e.g. a record written around the protocol)."""
    index = next((i for i, s in enumerate(record.steps) if s.action is TaskAction.accept), None)
    if index is None:
        raise Forbidden(record.assignee or "?", "act on", f"task {record.task_id}", "it was never accepted")
    step = record.steps[index]
    try:
        await verify_step(record, index, registry)
    except (InvalidEvent, Conflict) as e:
        raise Forbidden(
            record.assignee or "?", "act on", f"task {record.task_id}", f"its acceptance is not trustworthy: {e}"
        ) from e
    if step.actor not in coordinators:
        raise Forbidden(
            record.assignee or "?",
            "act on",
            f"task {record.task_id}",
            f"it was accepted by {step.actor}, who does not coordinate project {record.proposal.project}",
        )
