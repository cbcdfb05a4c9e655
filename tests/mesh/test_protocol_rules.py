"""The mesh rules against tables written out by hand: every message in every state from every role, a second
proposal, deadlines, counter-proposals and the exact record each move leaves. Pure: no server."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from bus.errors import Forbidden, IllegalTransition, InvalidEvent
from bus.model.ids import derived_event_id
from mesh.protocol import advance, child_task_id, counter_opening, counter_record
from mesh.task import Step, TaskRecord, message_digest, parse_message
from mesh.vocab import MeshRole, TaskAction, TaskState
from tests.mesh.test_protocol import (
    AFTER_DEADLINE,
    COORDINATORS,
    DEADLINE,
    EXPECTED,
    T0,
    A,
    S,
    message,
    proposal,
    record_in,
    step,
)

P, CO, AS = MeshRole.proposer, MeshRole.coordinator, MeshRole.assignee
# Who may send each message, written by hand (propose is covered on its own below).
MAY_SEND: dict[TaskAction, set[MeshRole]] = {
    A.accept: {CO},
    A.decline: {CO},
    A.change: {CO},
    A.start: {AS},
    A.complete: {AS},
    A.fail: {AS},
    A.cancel: {P, CO},
    A.acknowledge: {P},
    A.expire: {CO},
}
WITH_ASSIGNEE = {S.accepted, S.working, S.completed, S.acknowledged, S.failed}


def roles(sender: str, state: TaskState) -> set[MeshRole]:
    return {"alice": {P}, "coord": {CO}, "bob": {AS} if state in WITH_ASSIGNEE else set(), "mallory": set()}[sender]


@pytest.mark.parametrize("sender", ["alice", "coord", "bob", "mallory"])
@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("action", list(MAY_SEND))
def test_every_message_in_every_state_from_every_role_has_the_hand_written_outcome(
    action: TaskAction, state: TaskState, sender: str
) -> None:
    record = record_in(state)
    now = AFTER_DEADLINE if action is A.expire else T0
    target = EXPECTED[state].get(action)
    if target is None:
        with pytest.raises(IllegalTransition):
            step(record, action, sender=sender, now=now)
    elif roles(sender, state) & MAY_SEND[action]:
        after = step(record, action, sender=sender, now=now)
        assert (after.state, after.steps[-1].actor, set(after.steps[-1].roles)) == (
            target,
            sender,
            roles(sender, state) & MAY_SEND[action],
        )
    else:
        with pytest.raises(Forbidden):
            step(record, action, sender=sender, now=now)


def test_an_illegal_move_names_the_state_and_what_is_allowed_from_it() -> None:
    with pytest.raises(IllegalTransition) as raised:
        step(record_in(S.proposed), A.start)
    assert str(raised.value) == (
        "task task-1: proposed -> start is illegal: allowed from proposed: accept, decline, change, cancel, expire"
    )


def test_a_move_out_of_a_terminal_state_says_it_has_no_exit() -> None:
    with pytest.raises(IllegalTransition) as raised:
        step(record_in(S.declined), A.accept)
    assert str(raised.value) == (
        "task task-1: declined (a terminal state: it has no exit) -> accept is illegal: allowed from declined: nothing"
    )


def test_a_message_about_a_task_that_does_not_exist_allows_only_propose() -> None:
    with pytest.raises(IllegalTransition) as raised:
        step(None, A.accept)
    assert str(raised.value) == "task task-1: absent -> accept is illegal: allowed from absent: propose"


def test_a_second_propose_of_an_existing_task_is_refused() -> None:
    with pytest.raises(IllegalTransition) as raised:
        step(record_in(S.proposed), A.propose)
    assert str(raised.value) == "task task-1: proposed -> propose is illegal: a task with this id already exists"


@pytest.mark.parametrize("deadline", [T0, T0 - timedelta(seconds=1)], ids=["now", "past"])
def test_a_proposal_whose_deadline_is_not_ahead_is_refused(deadline: object) -> None:
    with pytest.raises(InvalidEvent) as raised:
        step(None, A.propose, proposal=proposal(deadline=deadline))
    assert str(raised.value).endswith("has passed; a deadline must be in the future")
    assert str(raised.value).startswith("task task-1 (absent) propose.deadline=")


def test_a_proposal_without_a_deadline_is_accepted_and_never_expires() -> None:
    open_ended = step(None, A.propose, proposal=proposal(deadline=None))
    assert open_ended.state is S.proposed
    assert step(open_ended, A.accept, now=AFTER_DEADLINE + timedelta(days=999)).state is S.accepted
    with pytest.raises(IllegalTransition) as raised:
        step(open_ended, A.expire, now=AFTER_DEADLINE)
    assert str(raised.value) == "task task-1: proposed -> expire is illegal: its deadline (none) has not passed"


def test_at_the_deadline_itself_the_task_may_expire_and_no_longer_start() -> None:
    accepted = record_in(S.accepted)
    assert step(accepted, A.expire, now=DEADLINE).state is S.expired
    with pytest.raises(IllegalTransition, match="its deadline passed at"):
        step(accepted, A.start, now=DEADLINE)
    assert step(accepted, A.cancel, now=AFTER_DEADLINE).state is S.canceled


def test_a_completed_task_may_be_acknowledged_after_its_deadline() -> None:
    assert step(record_in(S.completed), A.acknowledge, now=AFTER_DEADLINE).state is S.acknowledged


def test_a_proposal_for_another_task_or_project_is_refused() -> None:
    with pytest.raises(InvalidEvent, match=r"propose.proposal: must carry the message's task_id and project"):
        step(None, A.propose, proposal=proposal(task_id="task-2"))
    with pytest.raises(InvalidEvent, match=r"propose.proposal: must carry the message's task_id and project"):
        step(None, A.propose, proposal=proposal(project="elsewhere"))


def test_a_change_without_a_counter_proposal_is_refused() -> None:
    with pytest.raises(InvalidEvent) as raised:
        step(record_in(S.proposed), A.change, proposal=None)
    assert str(raised.value) == "task task-1 (proposed) change.proposal: is required"


def test_accepting_records_every_field_of_the_step() -> None:
    proposed = record_in(S.proposed)
    raw = message(A.accept, policy="manual")
    accepted = advance(proposed, parse_message(raw), coordinators=COORDINATORS, now=T0)
    expected_step = Step(
        message_id=raw["message_id"],
        action=A.accept,
        actor="coord",
        roles=(CO,),
        from_state=S.proposed,
        to_state=S.accepted,
        at=T0,
        assignee="bob",
        policy="manual",
        digest=message_digest(parse_message(raw)),
    )
    expected = proposed.model_copy(
        update={
            "state": S.accepted,
            "assignee": "bob",
            "decided_by": "coord",
            "decided_policy": "manual",
            "steps": (*proposed.steps, expected_step),
        }
    )
    assert accepted == expected


def test_declining_keeps_the_reason_and_failing_keeps_it_too() -> None:
    declined = step(record_in(S.proposed), A.decline, reason="out of scope")
    assert (declined.reason, declined.steps[-1].reason, declined.decided_by) == (
        "out of scope",
        "out of scope",
        "coord",
    )
    failed = step(record_in(S.working), A.fail, reason="disk full")
    assert (failed.reason, failed.decided_by, failed.assignee) == ("disk full", "coord", "bob")


def test_a_policy_is_kept_only_on_decisions() -> None:
    started = step(record_in(S.accepted), A.start, policy="auto")
    assert started.steps[-1].policy is None
    assert started.decided_policy is None


def test_a_change_creates_a_counter_proposal_whose_opening_step_is_derived_from_it() -> None:
    raw = message(A.change, policy="manual", reason="smaller scope")
    changed = advance(record_in(S.proposed), parse_message(raw), coordinators=COORDINATORS, now=T0)
    change = changed.last_step
    child = child_task_id(raw["message_id"])
    assert (changed.state, changed.child_id, change.child_id) == (S.changed, child, child)
    assert change.counter is not None
    assert change.counter.task_id == child
    opening = counter_opening(change)
    assert opening == Step(
        message_id=derived_event_id(raw["message_id"], "counter-proposal"),
        action=A.propose,
        actor="coord",
        roles=(CO,),
        from_state=None,
        to_state=S.proposed,
        at=T0,
        reason="smaller scope",
        policy="manual",
    )
    signed = change.model_copy(update={"counter_opening": opening})
    assert counter_record(signed) == TaskRecord(proposal=change.counter, state=S.proposed, steps=(opening,))


def test_only_a_change_step_has_a_counter_proposal() -> None:
    accept = record_in(S.accepted).last_step
    with pytest.raises(InvalidEvent) as raised:
        counter_opening(accept)
    assert str(raised.value) == f"step {accept.message_id}: is not a change: it carries no counter-proposal"
    unsigned = step(record_in(S.proposed), A.change).last_step
    with pytest.raises(InvalidEvent, match="is not a change with a signed counter-proposal"):
        counter_record(unsigned)
    with pytest.raises(InvalidEvent, match="is not a change with a signed counter-proposal"):
        counter_record(accept)


def test_a_counter_proposal_id_is_derived_from_the_change_message() -> None:
    assert child_task_id(uuid.UUID("01900000-0000-7000-8000-000000000001")) == "8ac48b77-996d-5475-a01a-1f317bb49422"


def test_accepting_a_task_with_no_named_agent_requires_an_assignee() -> None:
    anyone = step(None, A.propose, proposal=proposal(targets={"capabilities": ["logs"]}))
    with pytest.raises(InvalidEvent) as raised:
        step(anyone, A.accept)
    assert str(raised.value) == (
        "task task-1 (proposed) accept.assignee: is required: it names no single agent; "
        "name the agent that does the work"
    )
    assert step(anyone, A.accept, assignee="dave").assignee == "dave"


def test_a_proposer_who_also_coordinates_holds_both_roles() -> None:
    own = step(record_in(S.proposed), A.cancel, sender="alice")
    assert own.last_step.roles == (P,)
    both = advance(
        record_in(S.proposed),
        parse_message(message(A.cancel, sender="alice")),
        coordinators=frozenset({"alice"}),
        now=T0,
    )
    assert set(both.last_step.roles) == {P, CO}


def test_a_forbidden_move_names_who_may_make_it() -> None:
    with pytest.raises(Forbidden) as raised:
        step(record_in(S.proposed), A.accept, sender="alice")
    assert str(raised.value) == (
        "agent 'alice' may not accept task task-1 (proposed): only the coordinators of project matrix (coord) may"
    )
    with pytest.raises(Forbidden) as raised:
        step(record_in(S.accepted), A.start, sender="mallory")
    assert str(raised.value) == "agent 'mallory' may not start task task-1 (accepted): only its assignee (bob) may"
    with pytest.raises(Forbidden) as raised:
        step(record_in(S.completed), A.acknowledge, sender="bob")
    assert str(raised.value) == (
        "agent 'bob' may not acknowledge task task-1 (completed): only its proposer (alice) may"
    )
    with pytest.raises(Forbidden) as raised:
        step(record_in(S.working), A.cancel, sender="bob")
    assert str(raised.value) == (
        "agent 'bob' may not cancel task task-1 (working): only the coordinators of project matrix (coord) "
        "or its proposer (alice) may"
    )
