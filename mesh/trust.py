"""What every reader of the mesh bucket checks before it shows or acts on a record: each step is signed by its
actor's registered key over everything the actor decided (the whole proposal, the assignee, the commit), each
step is one the transition table lets its actor take against the project's roster as it then was, and the
record's fields are exactly what its steps make. A roster is a chain of changes, each signed by an admin (the
node's operator or an enrolled admin), by a coordinator at that point, or, on a registry still open to first
use, by anyone for its first coordinator. Capabilities are signed by the agent that advertises them.

A record that fails is an UntrustedRecord: quarantined like a malformed one (counted, logged once, skipped),
never shown as real, never acted on."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from bus.enrolment.registry import AgentRegistry
from bus.errors import (
    Conflict,
    Forbidden,
    IllegalTransition,
    InvalidEvent,
    MalformedRecord,
    NotFound,
    validation_message,
)
from bus.identity.signing import NODE_IDENTITY, verify_document, verify_signature
from bus.model.event import Actor
from bus.model.vocab import Role
from bus.subjects import MESH_BUCKET
from mesh.events import roster_event, verify_step
from mesh.protocol import advance, counter_opening, counter_record, roster_after
from mesh.task import CAPABILITIES_PURPOSE, AgentCapabilities, Message, Roster, Step, TaskRecord
from mesh.vocab import MeshRole, TaskAction, TaskState

# Not part of what the protocol makes of a message: who signed it, and how (checked apart).
SIGNED_FIELDS = frozenset({"public_key", "session_id", "signature", "digest", "counter_opening"})
REFUSED = (IllegalTransition, Forbidden, InvalidEvent, NotFound, Conflict)


class UntrustedRecord(MalformedRecord):
    """A mesh record that decodes but is not trustworthy (see the module's docstring)."""


async def roster_authority(registry: AgentRegistry, actor: str, public_key: str, current: frozenset[str]) -> str | None:
    """As what `actor` (signing with `public_key`) may change a roster whose coordinators are `current`:
    "operator" (a node's key), "admin", "coordinator", "first use" (the first coordinator of a project while
    the registry is open to first use), or None: it may not."""
    if actor == NODE_IDENTITY and await registry.is_node_key(public_key):
        return "operator"
    if actor in current:
        return "coordinator"
    try:
        enrolment = await registry.get(actor)
    except Conflict:  # an unreadable enrolment (the registry quarantines it) is nobody's authority
        enrolment = None
    if enrolment is not None and enrolment.public_key == public_key and enrolment.has_role(Role.admin):
        return "admin"
    if not current and not await registry.is_closed():
        return "first use"
    return None


async def verify_roster(roster: Roster, registry: AgentRegistry, *, key: str, revision: int | None) -> None:
    """Raise UntrustedRecord unless every change is signed by its actor and allowed at its point."""
    current: frozenset[str] = frozenset()
    for index, change in enumerate(roster.changes):
        where = f"change {index + 1} ({change.change} {change.agent} by {change.actor})"
        try:
            event = roster_event(roster, index)
            verify_signature(event)
            await registry.bind(event.actor)
            after = roster_after(
                roster.model_copy(update={"changes": roster.changes[:index]}),
                change.change,
                change.agent,
                actor=change.actor,
            )
        except REFUSED as e:
            raise UntrustedRecord(MESH_BUCKET, key, revision, f"{where} is not trustworthy: {e}") from e
        if after != change.coordinators:
            raise UntrustedRecord(MESH_BUCKET, key, revision, f"{where} names coordinators its change does not make")
        if await roster_authority(registry, change.actor, change.public_key, current) is None:
            rule = "only an admin seats a project's first coordinator" if not current else "it is no coordinator"
            raise UntrustedRecord(MESH_BUCKET, key, revision, f"{where} was not allowed: {rule}")
        current = frozenset(after)


async def verify_capabilities(
    advertised: AgentCapabilities, registry: AgentRegistry, *, key: str, revision: int | None
) -> None:
    """Raise UntrustedRecord unless the agent's registered key signed what the record says it advertises."""
    try:
        verify_document(advertised.public_key, CAPABILITIES_PURPOSE, advertised.document(), advertised.signature)
        await registry.bind(Actor(agent_id=advertised.agent, public_key=advertised.public_key))
    except (InvalidEvent, Conflict) as e:
        raise UntrustedRecord(MESH_BUCKET, key, revision, f"is not signed by {advertised.agent}: {e}") from e


async def verify_task(
    record: TaskRecord,
    roster: Roster,
    registry: AgentRegistry,
    *,
    key: str,
    revision: int | None,
    verified: TaskRecord | None = None,
) -> None:
    """Raise UntrustedRecord unless every step is signed by its actor and is what the protocol makes of it
    against the roster at the step's `roster_version`, and the record is what its steps make.

    `verified`: an earlier revision of the task that passed this check against a roster whose first changes
    (as far as its steps use them) are `roster`'s. When `record` holds its proposal and its steps unchanged, only
    the steps after them are checked: each step is judged by what precedes it, so the verdict is the same."""
    rebuilt: TaskRecord | None = None
    start = 0
    if verified is not None and extends(record, verified):
        rebuilt, start = verified, len(verified.steps)
    for index, step in enumerate(record.steps[start:], start=start):
        where = f"step {index + 1} ({step.action} by {step.actor})"
        try:
            await verify_step(record, index, registry)
            if step.roster_version > roster.version:
                raise InvalidEvent("roster_version", f"{step.roster_version} is past the roster's {roster.version}")
            coordinators = roster.at_version(step.roster_version)
            if index == 0 and _is_counter_opening(record, step):
                expected = _opened(record, step, coordinators)
            else:
                expected = advance(
                    rebuilt,
                    _message_of(record, step),
                    coordinators=coordinators,
                    now=step.at,
                    roster_version=step.roster_version,
                )
            _same_step(expected.last_step, step)
            if step.action is TaskAction.change:
                await _verify_opening(step, registry)
        except REFUSED as e:
            raise UntrustedRecord(MESH_BUCKET, key, revision, f"{where} is not trustworthy: {e}") from e
        except ValidationError as e:  # e.g. a message id no protocol message carries
            problem = validation_message(e.errors()[0])
            raise UntrustedRecord(MESH_BUCKET, key, revision, f"{where} is no protocol message: {problem}") from e
        rebuilt = expected.model_copy(update={"steps": record.steps[: index + 1]})
    if rebuilt != record:
        raise UntrustedRecord(MESH_BUCKET, key, revision, "holds fields its signed steps do not make")


def extends(record: TaskRecord, earlier: TaskRecord) -> bool:
    """Whether `record` holds `earlier`'s proposal and all its steps, unchanged and in order."""
    count = len(earlier.steps)
    return len(record.steps) >= count and record.steps[:count] == earlier.steps and record.proposal == earlier.proposal


def _message_of(record: TaskRecord, step: Step) -> Message:
    """The protocol message a step applied, as far as the step records it."""
    return Message(
        message_id=step.message_id,
        action=step.action,
        project=record.proposal.project,
        task_id=record.task_id,
        sender=step.actor,
        proposal=record.proposal if step.action is TaskAction.propose else step.counter,
        assignee=step.assignee,
        reason=step.reason,
        completion=step.completion,
        policy=step.policy,
    )


def _is_counter_opening(record: TaskRecord, step: Step) -> bool:
    """A proposal made as coordinator: only a change makes one (a proposer proposes as proposer)."""
    return (
        step.action is TaskAction.propose
        and record.proposal.parent_id is not None
        and step.roles == (MeshRole.coordinator,)
    )


def _opened(record: TaskRecord, step: Step, coordinators: frozenset[str]) -> TaskRecord:
    """A counter-proposal's first step: proposed by a coordinator, on its proposer's behalf."""
    if step.actor not in coordinators:
        raise Forbidden(step.actor, "counter-propose", f"task {record.task_id}", "only a coordinator may")
    return TaskRecord(proposal=record.proposal, state=TaskState.proposed, steps=(step,))


def _same_step(expected: Step, stored: Step) -> None:
    made, held = _unsigned(expected), _unsigned(stored)
    if made != held:
        differ = sorted(name for name in made.keys() | held.keys() if made.get(name) != held.get(name))
        raise InvalidEvent(", ".join(differ), "differ from what the protocol makes of the step's message")


def _unsigned(step: Step) -> dict[str, Any]:
    return step.model_dump(mode="json", exclude=set(SIGNED_FIELDS))


async def _verify_opening(change: Step, registry: AgentRegistry) -> None:
    """A change carries its counter-proposal's first step, signed by the same coordinator."""
    if change.counter_opening is None:
        raise InvalidEvent("counter_opening", "is missing: a change carries its counter-proposal's first step")
    _same_step(counter_opening(change), change.counter_opening)
    if change.counter_opening.public_key != change.public_key:
        raise InvalidEvent("counter_opening.public_key", "is not the key that signed the change")
    await verify_step(counter_record(change), 0, registry)
