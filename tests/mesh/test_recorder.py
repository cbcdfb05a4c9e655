"""The node's mesh recorder: a step written to the bucket reaches the stream even when its agent stopped
before publishing, a change's counter-proposal is created even when its coordinator stopped first, and a
step nobody signed (or signed with another agent's key) is never published, nor acted on."""

from __future__ import annotations

import os
from collections.abc import Awaitable
from typing import Any

import nkeys
import pytest

import mesh.service
from bus.errors import Unavailable
from bus.identity.signing import AgentKey
from bus.intake.stream_read import read_stream
from bus.model.event import decode_event
from bus.model.ids import new_event_id
from bus.subjects import MESH_BUCKET, STREAM, events_filter, task_key
from epibus.node.node import Node
from mesh.agent import MeshAgent
from mesh.events import unsigned_step_event
from mesh.task import Step
from mesh.trust import UntrustedRecord
from mesh.vocab import MeshRole, TaskAction, TaskState
from tests.mesh.conftest import MeshFactory
from tests.support import eventually, journal_rows_of_kind


def stop_after_the_kv_write(mesh: MeshAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's process 'dies' between its KV write and its publish: every publish fails."""

    async def unavailable(*_args: Any, **_kwargs: Any) -> None:
        raise Unavailable("nats", "the agent stopped before publishing")

    monkeypatch.setattr(mesh.client, "publish", unavailable)


async def stream_task_events(mesh: MeshAgent, project: str) -> dict[str, str]:
    """event id → action, read from the stream."""
    found: dict[str, str] = {}
    async for batch in read_stream(mesh.client.js, STREAM, filter_subject=events_filter(project, "task")):
        for msg in batch:
            event = decode_event(msg.data)
            found[str(event.event_id)] = event.body.model_dump()["action"]
    return found


async def test_a_step_its_agent_never_published_reaches_the_stream_and_the_journal(
    mesh_as: MeshFactory, project: str, node: Node, sqlite_journal_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    stop_after_the_kv_write(alice, monkeypatch)
    message_id = new_event_id()
    with pytest.raises(Unavailable):
        await alice.propose(project, "t", "s", category="operational", agents=["bob"], message_id=message_id)
    entry = await coord.locate(str(message_id), project)  # the KV write happened
    assert entry.record.state is TaskState.proposed

    async def recorded() -> dict[str, str]:
        return await stream_task_events(coord, project)

    assert await eventually(recorded) == {str(message_id): "propose"}

    def journaled() -> list[tuple[str, dict[str, Any], str, str]]:
        return journal_rows_of_kind(sqlite_journal_url, project, "task")

    rows = await eventually(journaled)
    assert [(r[0], r[2]) for r in rows] == [(str(message_id), "alice")]  # alice's signature, verified by the journal
    assert node.recorder is not None
    assert node.recorder.watcher.stats.untrusted == 0


async def test_a_counter_proposal_the_node_never_created_is_created_by_the_recorder(
    mesh_as: MeshFactory, project: str, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    parent = (await alice.propose(project, "big", "s", category="strategic", agents=["bob"])).record

    async def writer_stops(*_args: Any) -> None:
        raise Unavailable("nats", "the node stopped between the change and its counter-proposal")

    monkeypatch.setattr(mesh.service, "ensure_counter_task", writer_stops)  # whichever node writes the change
    stop_after_the_kv_write(coord, monkeypatch)
    with pytest.raises(Unavailable, match="between the change and its counter-proposal"):
        await coord.change(parent.task_id, title="smaller", reason="too big")
    changed = (await alice.locate(parent.task_id, project)).record
    assert changed.state is TaskState.changed
    assert changed.child_id is not None

    async def child_exists() -> bool:
        return await alice.store.get_task(project, changed.child_id or "") is not None

    await eventually(child_exists)
    child = (await alice.locate(changed.child_id, project)).record
    assert (child.proposal.title, child.proposal.proposer, child.proposal.parent_id) == (
        "smaller",
        "alice",
        parent.task_id,
    )
    events = await eventually(lambda: _with_n(stream_task_events(alice, project), 3))
    assert sorted(events.values()) == ["change", "propose", "propose"]
    assert node.recorder is not None
    assert node.recorder.stats.children_created == 1


async def _with_n(found: Awaitable[dict[str, str]], n: int) -> dict[str, str] | None:
    events = await found
    return events if len(events) == n else None


async def test_a_step_signed_with_another_agents_key_is_never_published(
    mesh_as: MeshFactory, project: str, node: Node
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    entry = (await alice.propose(project, "t", "s", category="operational", agents=["mallory"])).record
    # an acceptance in coord's name signed with mallory's key, written straight into the bucket (as a writer
    # around the node could on this open server)
    mallory = AgentKey("coord", nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))  # coord's name, her key
    step = Step(
        message_id=new_event_id(),
        action=TaskAction.accept,
        actor="coord",
        roles=(MeshRole.coordinator,),
        from_state=TaskState.proposed,
        to_state=TaskState.accepted,
        at=entry.steps[0].at,
        roster_version=1,
        assignee="mallory",
    )
    forged = entry.model_copy(
        update={"state": TaskState.accepted, "assignee": "mallory", "steps": (*entry.steps, step)}
    )
    signed = mallory.sign_v1(unsigned_step_event(forged, 1, mallory.actor, "s1"))
    step = step.model_copy(
        update={"public_key": mallory.actor.public_key, "session_id": "s1", "signature": signed.signature}
    )
    forged = forged.model_copy(update={"steps": (*entry.steps, step)})
    current = await alice.locate(entry.task_id, project)
    written = await alice.store.write_task(forged, last=current.revision)
    await eventually(lambda: node.recorder is not None and node.recorder.watcher.stats.untrusted == 1)
    assert node.recorder is not None
    assert [(q.key, q.revision) for q in node.recorder.watcher.quarantine.records] == [
        (task_key(project, entry.task_id), written)
    ]
    assert str(step.message_id) not in await stream_task_events(alice, project)
    worker = await mesh_as("mallory")
    with pytest.raises(UntrustedRecord, match="step 2 \\(accept by coord\\) is not trustworthy"):  # never acted on
        await worker.start(entry.task_id, project=project)
    kv = await alice.client.js.key_value(MESH_BUCKET)
    assert (await kv.get(task_key(project, entry.task_id))).revision == written  # nothing written over it
