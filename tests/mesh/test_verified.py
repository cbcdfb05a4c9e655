"""A reader verifies only what it has not verified yet (mesh.verified): a task's new revision past a verified
earlier one, a revision read again. Property: whatever a revision holds (genuine, or forged anywhere: a step
in the middle re-signed with another key, a field changed, a step dropped or repeated, the proposal swapped),
the reader that verified an earlier revision accepts or refuses it exactly as a reader verifying it in full."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.errors import MalformedRecord
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.model.ids import new_event_id
from bus.subjects import task_key
from mesh.events import opening_record, unsigned_roster_event, unsigned_step_event, with_signatures
from mesh.protocol import advance, child_task_id
from mesh.store import MeshStore
from mesh.task import Message, Roster, RosterChange, RosterDraft, TaskRecord, parse_message
from mesh.verified import Verified, VerifiedTasks
from mesh.vocab import TaskAction, TaskState

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
KEYS = {name: AgentKey.generate(name) for name in ("alice", "bob", "coord")}
MALLORY = {name: AgentKey.generate(name) for name in KEYS}  # the same names, other keys
QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
A = TaskAction
# Paths through the table, each step with the agent that sends it.
PATHS = [
    [(A.accept, "coord"), (A.start, "bob"), (A.complete, "bob"), (A.acknowledge, "alice")],
    [(A.accept, "coord"), (A.start, "bob"), (A.fail, "bob")],
    [(A.accept, "coord"), (A.cancel, "alice")],
    [(A.decline, "coord")],
    [(A.change, "coord")],
]
SHA = "0123456789abcdef0123456789abcdef01234567"


def signed(record: TaskRecord, key: AgentKey) -> TaskRecord:
    """The record with its newest step signed by `key` (as an agent's request carries it)."""
    counter = None
    if record.last_step.action is A.change:
        counter = key.sign_v1(unsigned_step_event(opening_record(record), 0, key.actor, "s1")).signature
    signature = key.sign_v1(unsigned_step_event(record, len(record.steps) - 1, key.actor, "s1")).signature
    assert signature is not None
    return with_signatures(
        record, public_key=key.public_key, session_id="s1", signature=signature, counter_signature=counter
    )


def history(project: str, path: list[tuple[TaskAction, str]]) -> list[TaskRecord]:
    """Every revision of one genuine task: proposed by alice for bob, then `path`."""
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    proposal = {
        "task_id": task_id,
        "project": project,
        "title": "t",
        "summary": "s",
        "proposer": "alice",
        "targets": {"agents": ["bob"]},
        "category": "operational",
    }
    fields: dict[TaskAction, dict[str, Any]] = {
        A.propose: {"proposal": proposal},
        A.decline: {"reason": "no", "policy": "manual"},
        A.accept: {"policy": "manual"},
        A.fail: {"reason": "broke"},
        A.complete: {"completion": {"sha": SHA}},
    }
    record: TaskRecord | None = None
    revisions: list[TaskRecord] = []
    for number, (action, sender) in enumerate([(A.propose, "alice"), *path]):
        message_id = new_event_id()
        extra = dict(fields.get(action, {}))
        if action is A.change:
            extra = {
                "policy": "manual",
                "proposal": proposal | {"task_id": child_task_id(message_id), "parent_id": task_id, "title": "t2"},
            }
        message: Message = parse_message(
            {
                "message_id": message_id,
                "action": action,
                "project": project,
                "task_id": task_id,
                "sender": sender,
                **extra,
            }
        )
        made = advance(
            record, message, coordinators=frozenset({"coord"}), now=T0 + timedelta(seconds=number), roster_version=1
        )
        record = signed(made, KEYS[sender])
        revisions.append(record)
    return revisions


def roster(project: str) -> Roster:
    draft = RosterDraft(
        message_id=new_event_id(), change="add", agent="coord", coordinators=("coord",), actor="coord", at=T0
    )
    key = KEYS["coord"]
    event = key.sign_v1(unsigned_roster_event(project, draft, seq=1, actor=key.actor, session_id="s1"))
    assert event.signature is not None
    change = RosterChange(**draft.model_dump(), public_key=key.public_key, session_id="s1", signature=event.signature)
    return Roster(project=project, changes=(change,))


@dataclass(frozen=True)
class Forgery:
    kind: str
    step: int  # which step (taken modulo the record's length)


forgeries = st.builds(
    Forgery,
    kind=st.sampled_from(
        ["none", "resign", "reason", "at", "actor", "drop", "repeat", "state", "assignee", "title", "roster", "swap"]
    ),
    step=st.integers(0, 10),
)


def forge(record: TaskRecord, forgery: Forgery) -> TaskRecord:
    """The record with one thing changed (a genuine record for "none")."""
    steps = list(record.steps)
    i = forgery.step % len(steps)
    step = steps[i]
    kind = forgery.kind
    if kind == "resign":  # the step re-signed, in its actor's name, with another key
        key = MALLORY[step.actor]
        forged = signed(record.model_copy(update={"steps": tuple(steps[: i + 1])}), key).steps[i]
        steps[i] = forged
    elif kind == "reason":
        steps[i] = step.model_copy(update={"reason": "changed afterwards"})
    elif kind == "at":
        steps[i] = step.model_copy(update={"at": step.at + timedelta(seconds=1)})
    elif kind == "actor":
        steps[i] = step.model_copy(update={"actor": "bob" if step.actor != "bob" else "alice"})
    elif kind == "drop" and len(steps) > 1:
        del steps[i]
    elif kind == "repeat":
        steps.insert(i, step)
    elif kind == "state":
        return record.model_copy(
            update={"state": TaskState.completed if record.state != TaskState.completed else TaskState.working}
        )
    elif kind == "assignee":
        return record.model_copy(update={"assignee": "alice"})
    elif kind == "title":
        return record.model_copy(update={"proposal": record.proposal.model_copy(update={"title": "other"})})
    elif kind == "roster":
        steps[i] = step.model_copy(update={"roster_version": 0 if step.roster_version else 1})
    elif kind == "swap" and len(steps) > 1:  # two steps' signatures exchanged
        j = (i + 1) % len(steps)
        steps[i] = step.model_copy(update={"signature": steps[j].signature})
    return record.model_copy(update={"steps": tuple(steps)})


async def verdict(store: MeshStore, record: TaskRecord, *, key: str, revision: int) -> str:
    """ "trusted", or the refusal's reason."""
    try:
        await store.verified_task(record.model_dump_json().encode(), key=key, revision=revision)
    except MalformedRecord as e:
        return e.reason
    return "trusted"


async def bound(store: MeshStore) -> MeshStore:
    """The store, with the genuine keys bound to their agents (first use) before any forgery is read."""
    for key in KEYS.values():
        await store.registry.bind(key.actor)
    return store


async def compare(url: str, path: list[tuple[TaskAction, str]], known: int, forgery: Forgery) -> None:
    project = f"p-{uuid.uuid4().hex[:10]}"
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        writer = await bound(MeshStore(js))
        await writer.write_roster(roster(project), last=0)
        revisions = history(project, path)
        earlier = revisions[known % len(revisions)]
        latest = forge(revisions[-1], forgery)
        key = task_key(project, revisions[0].task_id)
        full, incremental = MeshStore(js), MeshStore(js)
        assert await verdict(incremental, earlier, key=key, revision=1) == "trusted"
        expected = await verdict(full, latest, key=key, revision=2)
        assert await verdict(incremental, latest, key=key, revision=2) == expected
        assert await verdict(incremental, latest, key=key, revision=3) == expected  # read again: from what it knows
        if forgery.kind == "none":
            assert expected == "trusted"
        elif forgery.kind in ("resign", "reason", "at", "actor", "roster", "state", "assignee", "title"):
            assert expected != "trusted", forgery  # each of these changes what was signed or what it makes
    finally:
        await nc.close()


@settings(max_examples=60, deadline=None, suppress_health_check=QUIET)
@given(path=st.sampled_from(PATHS), known=st.integers(0, 10), forgery=forgeries)
def test_a_reader_that_verified_an_earlier_revision_judges_the_next_exactly_as_a_full_verification(
    nats_server: NatsServer, path: list[tuple[TaskAction, str]], known: int, forgery: Forgery
) -> None:
    asyncio.run(compare(nats_server.url, path, known, forgery))


def test_a_forged_revision_in_the_middle_is_refused_and_the_next_genuine_one_is_verified_in_full(
    nats_server: NatsServer,
) -> None:
    async def run() -> None:
        project = f"p-{uuid.uuid4().hex[:10]}"
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            store = await bound(MeshStore(js))
            await store.write_roster(roster(project), last=0)
            revisions = history(project, PATHS[0])
            key = task_key(project, revisions[0].task_id)
            assert await verdict(store, revisions[1], key=key, revision=2) == "trusted"
            forged = forge(revisions[2], Forgery("resign", 1))  # the acceptance re-signed by another key
            assert "step 2 (accept by coord) is not trustworthy" in await verdict(store, forged, key=key, revision=3)
            known = store.verified.get(key)
            assert known is not None
            assert known.revision == 2
            # A later revision building on the forged one repeats its forged step: refused too.
            later = forge(revisions[3], Forgery("resign", 1))
            assert "step 2 (accept by coord) is not trustworthy" in await verdict(store, later, key=key, revision=4)
            assert await verdict(store, revisions[3], key=key, revision=5) == "trusted"
        finally:
            await nc.close()

    asyncio.run(run())


def test_the_verified_tasks_forget_the_least_recently_used_first() -> None:
    tasks = VerifiedTasks(limit=2)
    revisions = history("p", PATHS[3])
    for n, key in enumerate(("a", "b", "c")):
        tasks.add(key, Verified(n + 1, b"", revisions[0], ()))
    assert tasks.get("a") is None
    assert len(tasks) == 2
    tasks.add("b", Verified(1, b"", revisions[0], ()))  # older than the one known: kept the newer
    found = tasks.get("b")
    assert found is not None
    assert found.revision == 2


@pytest.mark.parametrize("kind", ["resign", "swap"])
def test_a_forged_step_is_refused_whatever_the_reader_verified_before(nats_server: NatsServer, kind: str) -> None:
    for known in range(5):
        asyncio.run(compare(nats_server.url, PATHS[0], known, Forgery(kind, 2)))


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(a.value for a, _ in p))
def test_what_a_writer_made_and_remembers_unread_is_what_a_full_verification_trusts(
    nats_server: NatsServer, path: list[tuple[TaskAction, str]]
) -> None:
    async def run() -> None:
        project = f"p-{uuid.uuid4().hex[:10]}"
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            writer = await bound(MeshStore(js))
            the_roster = roster(project)
            await writer.write_roster(the_roster, last=0)
            revisions = history(project, path)
            key = task_key(project, revisions[0].task_id)
            for number, record in enumerate(revisions, start=1):
                data = record.model_dump_json().encode()
                writer.made(record, data, revision=number, roster=the_roster)
                known = writer.verified.get(key)
                assert known is not None
                assert (known.revision, known.data) == (number, data)  # remembered: the next step needs no read
                assert await verdict(MeshStore(js), record, key=key, revision=number) == "trusted"
            # Made on a basis it does not hold verified (a revision skipped): not remembered, so read and verified.
            other = MeshStore(js)
            other.made(revisions[-1], revisions[-1].model_dump_json().encode(), revision=9, roster=the_roster)
            assert other.verified.get(key) is None
        finally:
            await nc.close()

    asyncio.run(run())
