"""The mesh against a real nats-server: KV state with compare-and-set, one event per step (read back from the
stream and the journal), idempotent retries, racing coordinators, deadlines, policies and rosters."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest

from bus.broker.loops import cancel_and_wait
from bus.errors import ConfigError, Conflict, Forbidden, IllegalTransition, InvalidEvent, NotFound
from bus.host.server import NatsServer
from bus.intake.stream_read import read_stream
from bus.model.event import decode_event
from bus.model.ids import new_event_id
from bus.subjects import MESH_STREAM, STREAM, events_filter, task_key
from epibus.node.node import Node, NodeConfig
from mesh.agent import MeshAgent
from mesh.commits import require_commit
from mesh.coordinator import Coordinator, parse_policy
from mesh.vocab import TaskAction, TaskState
from tests.mesh.conftest import MeshFactory
from tests.support import eventually, journal_rows_of_kind

HISTORY_ATTEMPTS = 5

SHA = "0123456789abcdef0123456789abcdef01234567"


def both_read_before_either_writes(*agents: MeshAgent) -> Callable[[], None]:
    """Hold each agent's first request to the node of a round until every agent reached its own, so both
    decisions are made against the same revision and the node's compare-and-set must pick the winner. Returns
    `next_round`."""
    state: dict[str, Any] = {}

    def next_round() -> None:
        state["barrier"] = asyncio.Barrier(len(agents))
        state["waited"] = set()

    for mesh in agents:
        original = mesh.ask_node

        async def ask_node(subject: str, request: Any, _original: Any = original, _agent: str = mesh.agent) -> int:
            if _agent not in state["waited"]:
                state["waited"].add(_agent)
                await state["barrier"].wait()
            return int(await _original(subject, request))

        mesh.ask_node = ask_node  # type: ignore[method-assign]
    next_round()
    return next_round


@pytest.fixture
async def trio(mesh_as: MeshFactory, project: str) -> tuple[MeshAgent, MeshAgent, MeshAgent]:
    """alice proposes, coord coordinates `project`, bob does the work."""
    alice, coord, bob = await mesh_as("alice"), await mesh_as("coord"), await mesh_as("bob")
    await coord.add_coordinator(project, "coord")
    return alice, coord, bob


async def task_events(mesh: MeshAgent, project: str) -> list[dict[str, Any]]:
    """The project's task events as the stream holds them (not through the mesh's KV)."""
    found: list[dict[str, Any]] = []
    async for batch in read_stream(mesh.client.js, STREAM, filter_subject=events_filter(project, "task")):
        for msg in batch:
            event = decode_event(msg.data)
            found.append({"event_id": str(event.event_id), "actor": event.actor.agent_id, **event.body.model_dump()})
    return found


async def revisions_of(mesh: MeshAgent, project: str, task_id: str) -> list[int | None]:
    kv = await mesh.store.bucket()
    for attempt in range(HISTORY_ATTEMPTS):
        try:
            return [e.revision for e in await kv.history(task_key(project, task_id))]
        except nats.js.errors.NoKeysError:  # nats-py's watch can end before the first entry of a key that exists
            if attempt == HISTORY_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


async def test_a_full_handshake_lands_every_step_in_the_bucket_the_stream_and_the_journal(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str, node: Node, sqlite_journal_url: str
) -> None:
    alice, coord, bob = trio
    proposed = await alice.propose(project, "rotate logs", "the disk fills up", category="operational", agents=["bob"])
    task = proposed.record.task_id
    await coord.accept(task)
    await bob.start(task)
    await bob.complete(task, SHA, note="rotated", evidence=[{"kind": "commit", "ref": SHA}])
    assert [e.record.task_id for e in await alice.pending(project)] == [task]
    done = await alice.acknowledge(task)
    assert await alice.pending(project) == []

    entry = await MeshAgent(bob.client).locate(task)  # read back through a fresh store, found by id alone
    assert entry.record.state is TaskState.acknowledged
    assert entry.revision == done.revision
    assert entry.record.completion is not None
    assert entry.record.completion.sha == SHA
    assert (entry.record.decided_by, entry.record.decided_policy) == ("coord", "manual")

    expected = [
        ("propose", "alice", "proposed"),
        ("accept", "coord", "accepted"),
        ("start", "bob", "working"),
        ("complete", "bob", "completed"),
        ("acknowledge", "alice", "acknowledged"),
    ]
    events = await task_events(alice, project)
    assert [(e["action"], e["actor"], e["to_state"]) for e in events] == expected
    assert [e["event_id"] for e in events] == [str(s.message_id) for s in entry.record.steps]

    async def journaled() -> list[tuple[str, dict[str, Any], str, str]]:
        rows = journal_rows_of_kind(sqlite_journal_url, project, "task")
        return rows if len(rows) == len(expected) else []

    rows = await eventually(journaled)
    assert [(r[1]["action"], r[2]) for r in rows] == [(a, actor) for a, actor, _ in expected]
    assert [r[0] for r in rows] == [e["event_id"] for e in events]
    assert {r[3] for r in rows} == {"applied"}  # each step is its own record: the projection rejects none


async def test_two_coordinators_racing_to_decide_one_proposal_exactly_one_wins(
    mesh_as: MeshFactory, project: str
) -> None:
    alice, one, two = await mesh_as("alice"), await mesh_as("one"), await mesh_as("two")
    await one.add_coordinator(project, "one")
    await one.add_coordinator(project, "two")
    next_round = both_read_before_either_writes(one, two)
    for i in range(12):
        task = (await alice.propose(project, f"job {i}", "race me", category="tactical", agents=["bob"])).record.task_id
        next_round()
        results = await asyncio.gather(
            one.accept(task, project=project),
            two.decline(task, "we have no capacity", project=project),
            return_exceptions=True,
        )
        wins = [r for r in results if not isinstance(r, BaseException)]
        losses = [r for r in results if isinstance(r, BaseException)]
        assert len(wins) == 1, results
        assert len(losses) == 1, results
        assert isinstance(losses[0], IllegalTransition)
        assert "allowed from" in str(losses[0])
        entry = await alice.locate(task, project)
        decisions = [s for s in entry.record.steps if s.action in (TaskAction.accept, TaskAction.decline)]
        assert len(decisions) == 1
        assert entry.record.state is wins[0].record.state
        assert len(await revisions_of(alice, project, task)) == 2  # the proposal and one decision
    events = await task_events(alice, project)
    assert len(events) == 24  # 12 proposals + 12 decisions: the losers wrote nothing


async def test_the_same_message_twice_gives_the_same_outcome_and_one_event(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent],
    project: str,
    mesh_as: MeshFactory,
    node: Node,
    sqlite_journal_url: str,
) -> None:
    alice, coord, _bob = trio
    message_id = new_event_id()
    first = await alice.propose(
        project, "once", "only once", category="operational", agents=["bob"], message_id=message_id
    )
    again = await alice.propose(
        project, "once", "only once", category="operational", agents=["bob"], message_id=message_id
    )
    assert (again.duplicate, again.revision, again.record) == (True, first.revision, first.record)
    task = first.record.task_id

    decision_id = new_event_id()
    coord_elsewhere = await mesh_as("coord")  # the retry comes over another connection, as after a crash
    accepted = await coord.accept(task, message_id=decision_id)
    retried = await coord_elsewhere.accept(task, message_id=decision_id)
    assert retried.duplicate
    assert retried.revision == accepted.revision
    assert retried.record.state is TaskState.accepted
    assert len(await revisions_of(alice, project, task)) == 2

    events = await task_events(alice, project)
    assert sorted(e["event_id"] for e in events) == sorted([str(message_id), str(decision_id)])

    async def journaled() -> list[str]:
        ids = [r[0] for r in journal_rows_of_kind(sqlite_journal_url, project, "task")]
        return ids if len(ids) >= 2 else []

    assert sorted(await eventually(journaled)) == sorted([str(message_id), str(decision_id)])


async def test_a_message_id_reused_for_another_action_is_a_conflict(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str
) -> None:
    alice, _coord, _ = trio
    message_id = new_event_id()
    task = (
        await alice.propose(project, "t", "s", category="operational", agents=["bob"], message_id=message_id)
    ).record
    with pytest.raises(Conflict, match="already applied"):
        await alice.cancel(task.task_id, message_id=message_id)
    assert (await alice.locate(task.task_id)).record.state is TaskState.proposed


async def test_decline_closes_the_proposal_with_its_reason(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str
) -> None:
    alice, coord, bob = trio
    task = (
        await alice.propose(project, "buy gpus", "we need them", category="strategic", agents=["bob"])
    ).record.task_id
    declined = await coord.decline(task, "not this quarter")
    assert declined.record.state is TaskState.declined
    assert declined.record.reason == "not this quarter"
    with pytest.raises(IllegalTransition, match="terminal"):
        await bob.start(task)


async def test_change_counter_proposes_a_linked_task_that_then_runs_normally(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str
) -> None:
    alice, coord, bob = trio
    parent = (await alice.propose(project, "rewrite it all", "in rust", category="strategic", agents=["bob"])).record
    changed = await coord.change(parent.task_id, title="rewrite the hot loop", category="tactical", reason="smaller")
    child_id = changed.step.child_id
    assert changed.record.state is TaskState.changed
    assert changed.record.child_id == child_id
    assert child_id
    child = (await alice.locate(child_id, project)).record
    assert child.state is TaskState.proposed
    assert (child.proposal.parent_id, child.proposal.proposer) == (parent.task_id, "alice")
    assert (child.proposal.title, child.proposal.category, child.proposal.summary) == (
        "rewrite the hot loop",
        "tactical",
        "in rust",
    )
    await coord.accept(child_id)
    await bob.start(child_id)
    await bob.complete(child_id, SHA)
    assert (await alice.acknowledge(child_id)).record.state is TaskState.acknowledged

    events = await task_events(alice, project)
    change_event = next(e for e in events if e["action"] == "change")
    child_event = next(e for e in events if e["task_id"] == child_id and e["action"] == "propose")
    assert change_event["child_id"] == child_id
    assert child_event["parent_id"] == parent.task_id
    assert child_event["actor"] == "coord"
    assert child_event["proposer"] == "alice"

    same = {"title": "rewrite the hot loop", "category": "tactical", "reason": "smaller"}
    retried = await coord.change(parent.task_id, message_id=changed.step.message_id, **same)
    assert retried.duplicate
    assert retried.step.child_id == child_id
    assert len([e for e in await task_events(alice, project) if e["action"] == "change"]) == 1
    with pytest.raises(Conflict, match="with other content"):
        await coord.change(parent.task_id, message_id=changed.step.message_id, **(same | {"title": "other"}))


async def test_a_coordinator_that_counter_proposes_its_own_proposal_is_trusted_by_every_reader(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str
) -> None:
    _alice, coord, bob = trio
    parent = (await coord.propose(project, "upgrade", "all hosts", category="strategic", agents=["bob"])).record
    child_id = (await coord.change(parent.task_id, title="upgrade one host", reason="canary first")).step.child_id
    assert child_id is not None
    child = (await MeshAgent(bob.client).locate(child_id, project)).record  # a fresh reader verifies it
    assert (child.proposal.proposer, child.steps[0].actor, child.steps[0].roles) == ("coord", "coord", ("coordinator",))
    assert [e.record.task_id for e in await bob.tasks(project)] == [parent.task_id, child_id]
    assert bob.store.quarantine.count == 0


async def test_bad_input_gets_a_clear_error_and_writes_nothing(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str, mesh_as: MeshFactory
) -> None:
    alice, coord, bob = trio
    task = (await alice.propose(project, "t", "s", category="operational", agents=["bob"])).record.task_id
    before = await revisions_of(alice, project, task)
    events_before = len(await task_events(alice, project))

    with pytest.raises(Forbidden, match=f"may not accept task {task} \\(proposed\\): only the coordinators"):
        await bob.accept(task)
    await coord.accept(task)
    await bob.start(task)
    for bad in (None, "xyz", "A" * 40):
        with pytest.raises(InvalidEvent, match=f"task {task}.*sha") as raised:
            await bob.complete(task, bad)  # type: ignore[arg-type]
        assert "40 or 64" in str(raised.value)
    await bob.complete(task, SHA)
    with pytest.raises(Forbidden, match="only its proposer \\(alice\\) may"):
        await bob.acknowledge(task)
    await alice.acknowledge(task)
    with pytest.raises(IllegalTransition, match=r"acknowledged \(a terminal state: it has no exit\)"):
        await alice.cancel(task)
    with pytest.raises(NotFound, match="no coordinators"):
        await alice.propose("nobody-coordinates", "t", "s", category="operational")
    with pytest.raises(NotFound, match="task 'nope' not found"):
        await alice.start("nope", project=project)

    history = await revisions_of(alice, project, task)
    assert history[: len(before)] == before
    assert len(history) == len(before) + 4
    assert len(await task_events(alice, project)) == events_before + 4
    with pytest.raises(NotFound):
        await MeshAgent(alice.client).locate("whatever", "nobody-coordinates")


async def test_only_coordinators_or_an_admin_change_the_roster_and_the_last_one_stays(
    mesh_as: MeshFactory, project: str
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    assert await alice.coordinators(project) == ()
    await coord.add_coordinator(project, "coord")  # a registry open to first use: anyone seats the first
    with pytest.raises(Forbidden, match="only its coordinators \\(coord\\) or an admin may"):
        await alice.add_coordinator(project, "alice")
    with pytest.raises(Forbidden, match="last coordinator"):
        await coord.remove_coordinator(project, "coord")
    await coord.add_coordinator(project, "dana")
    await coord.remove_coordinator(project, "coord")
    assert await alice.coordinators(project) == ("dana",)
    with pytest.raises(Forbidden):
        await coord.accept(
            (await alice.propose(project, "t", "s", category="operational", agents=["x"])).record.task_id
        )
    events = []
    async for batch in read_stream(alice.client.js, STREAM, filter_subject=events_filter(project, "coordinators")):
        events += [decode_event(m.data).body.model_dump() for m in batch]
    assert [(e["change"], e["agent"], e["coordinators"]) for e in events] == [
        ("add", "coord", ("coord",)),
        ("add", "dana", ("coord", "dana")),
        ("remove", "coord", ("dana",)),
    ]


async def test_a_deadline_passing_expires_open_tasks(mesh_as: MeshFactory, project: str) -> None:
    now = [datetime(2026, 12, 1, 12, 0, tzinfo=UTC)]  # every agent's clock, moved by the test

    def clock() -> datetime:
        return now[0]

    alice, coord, bob = [await mesh_as(name, clock) for name in ("alice", "coord", "bob")]
    await coord.add_coordinator(project, "coord")
    deadline = now[0] + timedelta(hours=1)
    undecided = (
        await alice.propose(project, "a", "s", category="operational", agents=["bob"], deadline=deadline)
    ).record
    accepted = (
        await alice.propose(project, "b", "s", category="operational", agents=["bob"], deadline=deadline)
    ).record
    later = (
        await alice.propose(
            project, "c", "s", category="operational", agents=["bob"], deadline=deadline + timedelta(hours=1)
        )
    ).record
    await coord.accept(accepted.task_id)
    service = Coordinator(coord, project, parse_policy("manual"), sweep_interval_s=0.1, poll_timeout_s=0.2)
    running = asyncio.create_task(service.run())
    try:
        await eventually(lambda: service.watcher.stats.handled >= 4)  # it has seen every task, before the deadline
        assert service.stats.expired == 0
        now[0] = deadline + timedelta(minutes=1)

        async def states() -> bool:
            found = {e.record.task_id: e.record.state for e in await alice.tasks(project)}
            return found[undecided.task_id] is found[accepted.task_id] is TaskState.expired

        await eventually(states, timeout_s=10)
        # the service counts an expiry once its write returned, a moment after the bucket shows it
        await eventually(lambda: service.stats.expired == 2, timeout_s=10)
    finally:
        await cancel_and_wait([running])
    assert (await alice.locate(later.task_id)).record.state is TaskState.proposed
    with pytest.raises(IllegalTransition, match="terminal"):
        await bob.start(accepted.task_id)
    expired = (await alice.locate(accepted.task_id)).record
    assert expired.last_step.actor == "coord"
    assert expired.reason is not None
    assert "deadline" in expired.reason
    assert service.stats.expired == 2


async def test_auto_accept_takes_only_its_categories_and_records_the_policy(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str
) -> None:
    alice, coord, _ = trio
    service = Coordinator(coord, project, parse_policy("auto-accept:operational"), poll_timeout_s=0.2)
    running = asyncio.create_task(service.run())
    try:
        routine = (await alice.propose(project, "restart", "s", category="operational", agents=["bob"])).record
        big = (await alice.propose(project, "replatform", "s", category="irreversible", agents=["bob"])).record

        async def decided() -> bool:
            return (await alice.locate(routine.task_id)).record.state is TaskState.accepted

        await eventually(decided)
        await eventually(lambda: service.stats.left_to_person >= 1)
    finally:
        await cancel_and_wait([running])
    accepted = (await alice.locate(routine.task_id)).record
    assert (accepted.decided_by, accepted.decided_policy, accepted.assignee) == (
        "coord",
        "auto-accept:operational",
        "bob",
    )
    assert (await alice.locate(big.task_id)).record.state is TaskState.proposed  # waits for a person


async def test_capability_match_assigns_the_least_loaded_capable_agent_or_declines(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str, mesh_as: MeshFactory
) -> None:
    alice, coord, bob = trio
    ann = await mesh_as("ann")  # sorts before bob: only the load can make the policy pass her over
    await bob.advertise(["python"])
    await ann.advertise(["python", "postgres"])
    service = Coordinator(coord, project, parse_policy("capability-match"), poll_timeout_s=0.2)
    running = asyncio.create_task(service.run())
    try:
        db = (await alice.propose(project, "index", "s", category="tactical", capabilities=["postgres"])).record
        py1 = (await alice.propose(project, "lint", "s", category="tactical", capabilities=["python"])).record
        gpu = (await alice.propose(project, "train", "s", category="tactical", capabilities=["cuda"])).record

        async def all_decided() -> bool:
            states = [(await alice.locate(t.task_id)).record.state for t in (db, py1, gpu)]
            return TaskState.proposed not in states

        await eventually(all_decided)
    finally:
        await cancel_and_wait([running])
    assert (await alice.locate(db.task_id)).record.assignee == "ann"
    assert (await alice.locate(py1.task_id)).record.assignee == "bob"  # ann already has one open task
    declined = (await alice.locate(gpu.task_id)).record
    assert declined.state is TaskState.declined
    assert declined.reason
    assert "cuda" in declined.reason
    assert declined.decided_policy == "capability-match"


async def test_a_coordinator_service_refuses_to_run_for_an_agent_that_is_not_a_coordinator(
    mesh_as: MeshFactory, project: str
) -> None:
    alice = await mesh_as("alice")
    with pytest.raises(Forbidden, match="not among its coordinators"):
        await Coordinator(alice, project, parse_policy("manual")).run()


def test_a_policy_name_that_does_not_exist_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="allowed: manual, auto-accept:<categories>, capability-match"):
        parse_policy("yolo")
    with pytest.raises(ConfigError, match=r"'sometimes' is unknown.*operational, tactical"):
        parse_policy("auto-accept:sometimes")


def test_a_completion_sha_must_be_a_commit_of_the_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README").write_text("hello\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    require_commit(repo, sha, task="t1")
    blob = subprocess.run([*git, "rev-parse", "HEAD:README"], check=True, capture_output=True, text=True).stdout.strip()
    for missing in (uuid.uuid4().hex + "00000000", blob):  # absent, and an object that is not a commit
        with pytest.raises(InvalidEvent, match=f"task t1 complete.sha='{missing}': is not a commit in {repo}"):
            require_commit(repo, missing, task="t1")
    with pytest.raises(ConfigError, match="not a git repository"):
        require_commit(tmp_path, sha, task="t1")


async def test_every_revision_of_a_task_stays_in_the_bucket_for_watchers(
    trio: tuple[MeshAgent, MeshAgent, MeshAgent], project: str
) -> None:
    alice, coord, bob = trio
    task = (await alice.propose(project, "t", "s", category="operational", agents=["bob"])).record.task_id
    await coord.accept(task)
    await bob.start(task)
    info = await alice.client.js.stream_info(MESH_STREAM)
    assert info.config.max_msgs_per_subject == 64
    assert len(await revisions_of(alice, project, task)) == 3


async def test_a_node_runs_the_coordinators_it_is_configured_with(
    mesh_as: MeshFactory, project: str, nats_server: NatsServer, tmp_path: Path
) -> None:
    alice = await mesh_as("alice")
    config = NodeConfig(
        home=tmp_path / "node",
        nats_url=nats_server.url,
        mirror="off",
        agent="eco",
        coordinate=((project, "auto-accept:operational"),),
    )
    with pytest.raises(Forbidden, match="not among its coordinators"):
        async with Node(config):
            pass
    await alice.add_coordinator(project, "eco")
    async with Node(config) as node:
        assert [c.policy.name for c in node.coordinators] == ["auto-accept:operational"]
        task = (await alice.propose(project, "restart", "s", category="operational", agents=["bob"])).record.task_id

        async def accepted() -> bool:
            return (await alice.locate(task)).record.state is TaskState.accepted

        await eventually(accepted)
    assert (await alice.locate(task)).record.decided_by == "eco"
    with pytest.raises(ConfigError, match="allowed: manual"):
        async with Node(config.__class__(**{**config.__dict__, "coordinate": ((project, "sometimes"),)})):
            pass
