"""The transition table, driven through `advance` for every (state, action) pair: the expected table below is
written out by hand from the protocol's rules, not derived from the code's table."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from bus.errors import Forbidden, IllegalTransition, InvalidEvent
from bus.model.ids import new_event_id
from mesh.protocol import A2A_STATE, TERMINAL, advance, awaits_acknowledgement, child_task_id
from mesh.task import TaskRecord, parse_message
from mesh.vocab import TaskAction, TaskState

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DEADLINE = T0 + timedelta(hours=1)
AFTER_DEADLINE = T0 + timedelta(hours=2)
COORDINATORS = frozenset({"coord"})
PROJECT = "matrix"
TASK = "task-1"

S, A = TaskState, TaskAction
EXPECTED: dict[TaskState, dict[TaskAction, TaskState]] = {
    S.proposed: {
        A.accept: S.accepted,
        A.decline: S.declined,
        A.change: S.changed,
        A.cancel: S.canceled,
        A.expire: S.expired,
    },
    S.accepted: {A.start: S.working, A.fail: S.failed, A.cancel: S.canceled, A.expire: S.expired},
    S.working: {A.complete: S.completed, A.fail: S.failed, A.cancel: S.canceled, A.expire: S.expired},
    S.completed: {A.acknowledge: S.acknowledged},
    S.acknowledged: {},
    S.declined: {},
    S.changed: {},
    S.failed: {},
    S.canceled: {},
    S.expired: {},
}
SENDER = {
    A.propose: "alice",
    A.accept: "coord",
    A.decline: "coord",
    A.change: "coord",
    A.start: "bob",
    A.complete: "bob",
    A.fail: "bob",
    A.cancel: "alice",
    A.acknowledge: "alice",
    A.expire: "coord",
}
SHA = "a" * 40


def proposal(**overrides: Any) -> dict[str, Any]:
    return {
        "task_id": TASK,
        "project": PROJECT,
        "title": "rotate the logs",
        "summary": "logs fill the disk",
        "proposer": "alice",
        "targets": {"agents": ["bob"]},
        "category": "operational",
        "deadline": DEADLINE,
    } | overrides


def message(action: TaskAction, sender: str | None = None, **fields: Any) -> dict[str, Any]:
    message_id = new_event_id()
    raw: dict[str, Any] = {
        "message_id": message_id,
        "action": action,
        "project": PROJECT,
        "task_id": TASK,
        "sender": sender or SENDER[action],
    }
    if action is A.propose:
        raw["proposal"] = proposal()
    if action is A.change:
        raw["proposal"] = proposal(task_id=child_task_id(message_id), parent_id=TASK, title="rotate and compress")
    if action in (A.decline, A.fail):
        raw["reason"] = "not now"
    if action is A.complete:
        raw["completion"] = {"sha": SHA}
    return raw | fields


def step(record: TaskRecord | None, action: TaskAction, *, now: datetime = T0, **fields: Any) -> TaskRecord:
    return advance(record, parse_message(message(action, **fields)), coordinators=COORDINATORS, now=now)


PATHS: dict[TaskState, list[TaskAction]] = {
    S.proposed: [],
    S.accepted: [A.accept],
    S.working: [A.accept, A.start],
    S.completed: [A.accept, A.start, A.complete],
    S.acknowledged: [A.accept, A.start, A.complete, A.acknowledge],
    S.declined: [A.decline],
    S.changed: [A.change],
    S.failed: [A.accept, A.fail],
    S.canceled: [A.cancel],
    S.expired: [A.expire],
}


def record_in(state: TaskState) -> TaskRecord:
    record = step(None, A.propose)
    for action in PATHS[state]:
        record = step(record, action, now=AFTER_DEADLINE if action is A.expire else T0)
    assert record.state is state
    return record


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("action", [a for a in A if a is not A.propose])
def test_every_state_and_action_follows_the_table(state: TaskState, action: TaskAction) -> None:
    record = record_in(state)
    now = AFTER_DEADLINE if action is A.expire else T0
    expected = EXPECTED[state].get(action)
    if expected is None:
        with pytest.raises(IllegalTransition) as raised:
            step(record, action, now=now)
        text = str(raised.value)
        assert f"task {TASK}" in text
        assert state.value in text
        assert action.value in text
        assert raised.value.current.startswith(state.value)
        return
    after = step(record, action, now=now)
    assert after.state is expected
    assert after.steps[-1].from_state is state
    assert after.steps[-1].to_state is expected
    assert len(after.steps) == len(record.steps) + 1


def test_terminal_states_are_exactly_those_without_exit() -> None:
    assert {s for s, moves in EXPECTED.items() if not moves} == TERMINAL
    assert S.completed not in TERMINAL  # it waits for the proposer's acknowledgement


@pytest.mark.parametrize("state", list(S))
def test_only_a_completed_task_awaits_acknowledgement_and_only_by_its_proposer(state: TaskState) -> None:
    record = record_in(state)
    completed = state is S.completed
    assert awaits_acknowledgement(record) is completed
    assert awaits_acknowledgement(record, "alice") is completed  # alice proposed it
    assert awaits_acknowledgement(record, "bob") is False  # bob completed it; only alice acknowledges


def test_every_state_maps_onto_an_a2a_state() -> None:
    a2a = {"submitted", "working", "input-required", "completed", "canceled", "failed", "rejected", "auth-required"}
    assert set(A2A_STATE) == set(S)
    assert set(A2A_STATE.values()) <= a2a


@pytest.mark.parametrize(
    ("action", "state", "intruder"),
    [
        (A.accept, S.proposed, "alice"),  # the proposer is not a coordinator
        (A.decline, S.proposed, "bob"),
        (A.change, S.proposed, "mallory"),
        (A.start, S.accepted, "alice"),  # only the assignee works on it
        (A.complete, S.working, "coord"),
        (A.fail, S.working, "alice"),
        (A.cancel, S.accepted, "bob"),  # the assignee cannot withdraw it
        (A.acknowledge, S.completed, "bob"),  # only the proposer closes the handshake
        (A.expire, S.proposed, "alice"),
    ],
)
def test_a_move_by_an_agent_without_the_role_is_forbidden(action: TaskAction, state: TaskState, intruder: str) -> None:
    now = AFTER_DEADLINE if action is A.expire else T0
    with pytest.raises(Forbidden) as raised:
        step(record_in(state), action, sender=intruder, now=now)
    assert intruder in str(raised.value)
    assert TASK in str(raised.value)


def test_a_coordinator_may_cancel_and_the_proposer_may_too() -> None:
    assert step(record_in(S.working), A.cancel, sender="coord").state is S.canceled
    assert step(record_in(S.proposed), A.cancel, sender="alice").state is S.canceled


def test_a_completion_needs_a_well_formed_sha() -> None:
    working = record_in(S.working)
    with pytest.raises(InvalidEvent, match=r"sha.*is required"):
        step(working, A.complete, completion=None)
    for bad in ("abc123", "A" * 40, "g" * 40, "a" * 41, "a" * 63):
        with pytest.raises(InvalidEvent, match="40 or 64 lowercase hex") as raised:
            step(working, A.complete, completion={"sha": bad})
        assert TASK in str(raised.value)
    assert step(working, A.complete, completion={"sha": "b" * 64}).completion is not None


def test_decline_and_fail_need_a_reason() -> None:
    with pytest.raises(InvalidEvent, match="reason: is required"):
        step(record_in(S.proposed), A.decline, reason=None)
    with pytest.raises(InvalidEvent, match="reason: is required"):
        step(record_in(S.accepted), A.fail, reason=None)


def test_after_the_deadline_only_expire_or_cancel_move_an_open_task() -> None:
    accepted = record_in(S.accepted)
    with pytest.raises(IllegalTransition, match="deadline passed"):
        step(accepted, A.start, now=AFTER_DEADLINE)
    with pytest.raises(IllegalTransition, match="has not passed"):
        step(accepted, A.expire, now=T0)
    assert step(accepted, A.expire, now=AFTER_DEADLINE).state is S.expired


def test_accept_names_the_assignee_among_the_targets() -> None:
    two = step(None, A.propose, proposal=proposal(targets={"agents": ["bob", "carol"]}))
    with pytest.raises(InvalidEvent, match="assignee: is required"):
        step(two, A.accept)
    with pytest.raises(InvalidEvent, match="not a targeted agent"):
        step(two, A.accept, assignee="dave")
    assert step(two, A.accept, assignee="carol").assignee == "carol"


def test_a_decision_records_who_decided_and_by_which_policy() -> None:
    accepted = step(record_in(S.proposed), A.accept, policy="auto-accept:operational")
    assert (accepted.decided_by, accepted.decided_policy) == ("coord", "auto-accept:operational")
    assert accepted.steps[-1].roles == ("coordinator",)


def test_a_counter_proposal_must_link_to_its_parent_and_keep_the_proposer() -> None:
    proposed = record_in(S.proposed)
    raw = message(A.change)
    raw["proposal"] = raw["proposal"] | {"proposer": "coord"}
    with pytest.raises(InvalidEvent, match="proposer"):
        advance(proposed, parse_message(raw), coordinators=COORDINATORS, now=T0)
    raw = message(A.change)
    raw["proposal"] = raw["proposal"] | {"parent_id": None}
    with pytest.raises(InvalidEvent, match="parent_id"):
        advance(proposed, parse_message(raw), coordinators=COORDINATORS, now=T0)
    changed = step(proposed, A.change)
    assert changed.child_id == changed.steps[-1].child_id == changed.steps[-1].counter.task_id  # type: ignore[union-attr]


def test_a_proposal_must_come_from_its_proposer() -> None:
    with pytest.raises(Forbidden, match="proposer"):
        step(None, A.propose, sender="mallory")


def test_a_title_over_200_characters_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidEvent, match="title"):
        parse_message(message(A.propose, proposal=proposal(title="x" * 201)))


def test_the_readme_shows_the_transition_table_the_code_applies() -> None:
    from pathlib import Path

    from mesh.protocol import TRANSITIONS

    readme = (Path(__file__).parents[2] / "docs" / "mesh-protocol.md").read_text()
    for action, move in TRANSITIONS.items():
        sources = ", ".join(sorted(s.value for s in move.sources)) or "(none: creates the task)"
        roles = " or ".join(sorted(r.value for r in move.roles))
        assert f"| `{action}` | {sources} | {move.target} | {roles} |" in readme
    for state, a2a in A2A_STATE.items():
        assert f"| {state} | {a2a} |" in readme
