"""The mesh work protocol: the explicit transition table, its A2A mapping, and `advance`, the one
pure function that decides what a message does to a task (the data it works on is in mesh.task).

`advance` is the only place the rules live: the agent API calls it before every compare-and-set write, the
tests drive the full matrix through it, and the CLI's errors come from it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bus.errors import Conflict, Forbidden, IllegalTransition, InvalidEvent, NotFound
from bus.model.ids import derived_event_id
from mesh.task import SHA_RULE, Message, Proposal, Roster, Step, TaskRecord, message_digest
from mesh.vocab import MeshRole, TaskAction, TaskState


@dataclass(frozen=True)
class Move:
    sources: frozenset[TaskState]
    target: TaskState
    roles: frozenset[MeshRole]  # any one of these may send it


_OPEN = frozenset({TaskState.proposed, TaskState.accepted, TaskState.working})
# The explicit transition table. `propose` has no source: it creates the task.
TRANSITIONS: dict[TaskAction, Move] = {
    TaskAction.propose: Move(frozenset(), TaskState.proposed, frozenset({MeshRole.proposer})),
    TaskAction.accept: Move(frozenset({TaskState.proposed}), TaskState.accepted, frozenset({MeshRole.coordinator})),
    TaskAction.decline: Move(frozenset({TaskState.proposed}), TaskState.declined, frozenset({MeshRole.coordinator})),
    TaskAction.change: Move(frozenset({TaskState.proposed}), TaskState.changed, frozenset({MeshRole.coordinator})),
    TaskAction.start: Move(frozenset({TaskState.accepted}), TaskState.working, frozenset({MeshRole.assignee})),
    TaskAction.complete: Move(frozenset({TaskState.working}), TaskState.completed, frozenset({MeshRole.assignee})),
    TaskAction.fail: Move(
        frozenset({TaskState.accepted, TaskState.working}), TaskState.failed, frozenset({MeshRole.assignee})
    ),
    TaskAction.cancel: Move(_OPEN, TaskState.canceled, frozenset({MeshRole.proposer, MeshRole.coordinator})),
    TaskAction.acknowledge: Move(
        frozenset({TaskState.completed}), TaskState.acknowledged, frozenset({MeshRole.proposer})
    ),
    TaskAction.expire: Move(_OPEN, TaskState.expired, frozenset({MeshRole.coordinator})),
}
TERMINAL = frozenset(s for s in TaskState if not any(s in move.sources for move in TRANSITIONS.values()))
DECISIONS = frozenset({TaskAction.accept, TaskAction.decline, TaskAction.change})
REASON_REQUIRED = frozenset({TaskAction.decline, TaskAction.fail})

# Mesh states onto A2A task states (A2A has no acceptance, acknowledgement or deadline states):
# accepted is work taken on (A2A `working` from the proposer's view), acknowledged is a completed task whose
# proposer confirmed it, changed is a rejection that names its replacement, expired is canceled by the clock.
A2A_STATE: dict[TaskState, str] = {
    TaskState.proposed: "submitted",
    TaskState.accepted: "working",
    TaskState.working: "working",
    TaskState.completed: "completed",
    TaskState.acknowledged: "completed",
    TaskState.declined: "rejected",
    TaskState.changed: "rejected",
    TaskState.failed: "failed",
    TaskState.canceled: "canceled",
    TaskState.expired: "canceled",
}


def awaits_acknowledgement(record: TaskRecord, by: str | None = None) -> bool:
    """Whether the task's handshake is open: completed, not yet acknowledged; with `by`, also that `by` is the
    one to acknowledge it (its proposer). The one rule behind `mesh pending`, `epibus stats` and the statusline."""
    if record.state not in TRANSITIONS[TaskAction.acknowledge].sources:
        return False
    return by is None or record.proposal.proposer == by


def allowed_actions(state: TaskState) -> list[str]:
    return [a.value for a, move in TRANSITIONS.items() if state in move.sources]


def roles_of(
    agent: str, record: TaskRecord | None, proposal: Proposal | None, coordinators: frozenset[str]
) -> set[MeshRole]:
    roles: set[MeshRole] = set()
    proposer = record.proposal.proposer if record is not None else (proposal.proposer if proposal else None)
    if agent == proposer:
        roles.add(MeshRole.proposer)
    if agent in coordinators:
        roles.add(MeshRole.coordinator)
    if record is not None and agent == record.assignee:
        roles.add(MeshRole.assignee)
    return roles


def child_task_id(message_id: uuid.UUID) -> str:
    """The id of the counter-proposal a `change` message creates: derived from the message, so a retried
    change creates the same child, never a second one."""
    return str(uuid.uuid5(uuid.UUID(int=message_id.int), "epibus.mesh.change"))


def advance(
    record: TaskRecord | None,
    message: Message,
    *,
    coordinators: frozenset[str],
    now: datetime,
    roster_version: int = 0,
) -> TaskRecord:
    """The task after `message`, or an error naming the task, its state and what is allowed; writes nothing.
    `coordinators` are the project's roster at `roster_version` (recorded in the step, so a reader can judge
    the step against the same roster).

    Raises IllegalTransition (not in the table, out of a terminal state, deadline passed), Forbidden (the
    sender lacks the role: e.g. a decision by an agent that is not a coordinator), InvalidEvent (a field the
    action needs is missing or malformed). A missing record for any action but propose is the caller's
    NotFound."""
    move = TRANSITIONS[message.action]
    label = record.state.value if record is not None else "absent"
    _require_legal(record, message, move, label)
    roles = roles_of(message.sender, record, message.proposal, coordinators) & move.roles
    if not roles:
        raise Forbidden(
            message.sender,
            message.action.value,
            f"task {message.task_id} ({label})",
            _who_may(move, record, coordinators, message.project),
        )
    _require_fields(message, label)
    _require_timely(record, message, now)
    if record is None:
        if message.proposal is None:
            raise InvalidEvent(f"task {message.task_id} (absent) propose.proposal", "is required")
        step = _step(None, message, roles, now, roster_version)
        return TaskRecord(proposal=message.proposal, state=move.target, steps=(step,))
    if message.action is TaskAction.change:
        _check_counter(record, message)
    return _applied(record, message, _step(record, message, roles, now, roster_version))


def _require_legal(record: TaskRecord | None, message: Message, move: Move, label: str) -> None:
    action = message.action
    if action is TaskAction.propose:
        if record is not None:
            raise IllegalTransition(message.task_id, label, action, "a task with this id already exists", what="task")
        return
    if record is not None and record.state in move.sources:
        return
    allowed = allowed_actions(record.state) if record is not None else ["propose"]
    terminal = " (a terminal state: it has no exit)" if record is not None and record.state in TERMINAL else ""
    raise IllegalTransition(
        message.task_id,
        f"{label}{terminal}",
        action,
        f"allowed from {label}: {', '.join(allowed) or 'nothing'}",
        what="task",
    )


def _step(
    record: TaskRecord | None, message: Message, roles: set[MeshRole], now: datetime, roster_version: int
) -> Step:
    action = message.action
    return Step(
        message_id=message.message_id,
        action=action,
        actor=message.sender,
        roles=tuple(sorted(roles)),
        from_state=record.state if record is not None else None,
        to_state=TRANSITIONS[action].target,
        at=now,
        roster_version=roster_version,
        assignee=_assignee(record, message) if action is TaskAction.accept else None,
        reason=message.reason,
        completion=message.completion,
        policy=message.policy if action in DECISIONS else None,
        child_id=child_task_id(message.message_id) if action is TaskAction.change else None,
        counter=message.proposal if action is TaskAction.change else None,
        digest=message_digest(message),
    )


def _applied(record: TaskRecord, message: Message, step: Step) -> TaskRecord:
    action = message.action
    changes: dict[str, Any] = {"state": step.to_state, "steps": (*record.steps, step)}
    if action in DECISIONS:
        changes |= {"decided_by": message.sender, "decided_policy": step.policy}
    if action is TaskAction.accept:
        changes["assignee"] = step.assignee
    if action is TaskAction.complete:
        changes["completion"] = message.completion
    if action is TaskAction.change:
        changes["child_id"] = step.child_id
    if message.reason is not None:
        changes["reason"] = message.reason
    return record.model_copy(update=changes)


def counter_opening(change: Step) -> Step:
    """The first (unsigned) step of the counter-proposal a `change` step creates: proposed by the coordinator
    on the original proposer's behalf, with a message id derived from the change's."""
    if change.counter is None:
        raise InvalidEvent(f"step {change.message_id}", "is not a change: it carries no counter-proposal")
    return Step(
        message_id=derived_event_id(change.message_id, "counter-proposal"),
        action=TaskAction.propose,
        actor=change.actor,
        roles=(MeshRole.coordinator,),
        from_state=None,
        to_state=TaskState.proposed,
        at=change.at,
        roster_version=change.roster_version,
        reason=change.reason,
        policy=change.policy,
    )


def counter_record(change: Step) -> TaskRecord:
    """The counter-proposal task of a `change` step, as its signed opening step describes it."""
    if change.counter is None or change.counter_opening is None:
        raise InvalidEvent(f"step {change.message_id}", "is not a change with a signed counter-proposal")
    return TaskRecord(proposal=change.counter, state=TaskState.proposed, steps=(change.counter_opening,))


NO_COORDINATORS = "the project has no coordinators to decide it; an admin seats one with `epibus mesh coordinators add`"


def who_may(roster: Roster) -> str:
    """Who may change a roster, in words."""
    if roster.coordinators:
        return f"only its coordinators ({', '.join(roster.coordinators)}) or an admin may"
    return "only an admin (the node's operator, or an agent with the admin role) seats a project's first coordinator"


def roster_after(roster: Roster, change: str, agent: str, *, actor: str) -> tuple[str, ...]:
    """The project's coordinators after `actor` adds or removes `agent` (who may is checked apart, against the
    registry: mesh.trust.roster_authority). Raises NotFound (removing one who is not there), Forbidden (removing
    the last one), Conflict (adding one who is there already: the caller returns the roster unchanged)."""
    current = set(roster.coordinators)
    if change == "add":
        if agent in current:
            raise Conflict(f"coordinators of {roster.project}", f"{agent} is one already", fix="nothing to do")
        return tuple(sorted(current | {agent}))
    if agent not in current:
        raise NotFound("coordinator", agent, f"project {roster.project} has {sorted(current) or 'none'}")
    if current == {agent}:
        raise Forbidden(actor, "remove", f"the last coordinator of project {roster.project}", "add another one first")
    return tuple(sorted(current - {agent}))


def _who_may(move: Move, record: TaskRecord | None, coordinators: frozenset[str], project: str) -> str:
    names = {
        MeshRole.coordinator: f"the coordinators of project {project} ({', '.join(sorted(coordinators)) or 'none'})",
        MeshRole.proposer: f"its proposer ({record.proposal.proposer})" if record else "the agent named as proposer",
        MeshRole.assignee: f"its assignee ({record.assignee if record and record.assignee else 'none yet'})",
    }
    return "only " + " or ".join(names[r] for r in sorted(move.roles)) + " may"


def _require_fields(message: Message, state: str) -> None:
    action = message.action
    where = f"task {message.task_id} ({state}) {action.value}"
    needs_proposal = action in (TaskAction.propose, TaskAction.change)
    if needs_proposal and message.proposal is None:
        raise InvalidEvent(f"{where}.proposal", "is required")
    if action is TaskAction.propose:
        assert message.proposal is not None
        if (message.proposal.task_id, message.proposal.project) != (message.task_id, message.project):
            raise InvalidEvent(f"{where}.proposal", "must carry the message's task_id and project")
        if message.proposal.proposer != message.sender:
            raise InvalidEvent(f"{where}.proposal.proposer", f"must be the sender {message.sender!r}")
    if action in REASON_REQUIRED and not message.reason:
        raise InvalidEvent(f"{where}.reason", "is required")
    if action is TaskAction.complete and message.completion is None:
        raise InvalidEvent(f"{where}.sha", f"is required: {SHA_RULE}")


def _check_counter(record: TaskRecord, message: Message) -> None:
    counter = message.proposal
    assert counter is not None
    where = f"task {message.task_id} ({record.state}) change.proposal"
    expected = {
        "task_id": child_task_id(message.message_id),
        "project": record.proposal.project,
        "proposer": record.proposal.proposer,
        "parent_id": record.task_id,
    }
    for field, value in expected.items():
        if getattr(counter, field) != value:
            raise InvalidEvent(f"{where}.{field}={getattr(counter, field)!r}", f"must be {value!r}")


def _assignee(record: TaskRecord | None, message: Message) -> str:
    if record is None:
        raise InvalidEvent(f"task {message.task_id} (absent) accept", "there is no proposal to accept")
    targets = record.proposal.targets
    where = f"task {message.task_id} ({record.state}) accept.assignee"
    if message.assignee is None:
        if len(targets.agents) == 1:
            return targets.agents[0]
        named = f"it targets agents {list(targets.agents)}" if targets.agents else "it names no single agent"
        raise InvalidEvent(where, f"is required: {named}; name the agent that does the work")
    if targets.agents and message.assignee not in targets.agents:
        raise InvalidEvent(f"{where}={message.assignee!r}", "is not a targeted agent", allowed=targets.agents)
    return message.assignee


def _require_timely(record: TaskRecord | None, message: Message, now: datetime) -> None:
    """A proposal's deadline must be ahead; after a deadline an open task may only expire or be canceled."""
    if record is None:
        deadline = message.proposal.deadline if message.proposal is not None else None
        if deadline is not None and deadline <= now:
            raise InvalidEvent(
                f"task {message.task_id} (absent) propose.deadline={deadline.isoformat()}",
                "has passed; a deadline must be in the future",
            )
        return
    deadline = record.proposal.deadline
    passed = deadline is not None and now >= deadline
    if message.action is TaskAction.expire and not passed:
        shown = deadline.isoformat() if deadline else "none"
        raise IllegalTransition(
            message.task_id, record.state, "expire", f"its deadline ({shown}) has not passed", what="task"
        )
    late = message.action not in (TaskAction.expire, TaskAction.cancel) and record.state in _OPEN
    if deadline is not None and passed and late:
        raise IllegalTransition(
            message.task_id,
            record.state,
            message.action,
            f"its deadline passed at {deadline.isoformat()}; it can only expire or be canceled",
            what="task",
        )
