"""Hostile records in the mesh bucket: every one decodes to a typed error and is quarantined (counted, logged
once, skipped past). The node keeps recording and journaling, watchers move their cursors past them, and
`mesh inbox`/`outbox` show the good tasks and say how many records they could not read."""

from __future__ import annotations

import json
import logging
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bus.errors import MalformedRecord, Unavailable
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.intake.cursor import MemoryCursor
from bus.model.ids import new_event_id
from bus.subjects import MESH_BUCKET, capabilities_key, roster_key, task_key
from epibus.node.node import Node, service_failures
from mesh.agent import MeshAgent
from mesh.protocol import advance
from mesh.store import decode_capabilities, decode_roster, decode_task
from mesh.task import Message, Proposal
from mesh.vocab import ActionCategory, TaskAction
from mesh.watch import TaskWatcher
from tests.conftest import finding
from tests.hostile import Hostile, all_hostile_task_records, hostile_payloads, put_raw
from tests.mesh.conftest import MeshFactory
from tests.mesh.test_recorder import stop_after_the_kv_write
from tests.support import eventually, journal_event_ids, run_epibus

PROJECT = "hostile"
TASK = "t-1"


def good_record() -> dict[str, Any]:
    """A task record as `advance` makes it (server-free), in the JSON the bucket holds."""
    proposal = Proposal(
        task_id=TASK, project=PROJECT, title="t", summary="s", proposer="alice", category=ActionCategory.operational
    )
    message = Message(
        message_id=new_event_id(),
        action=TaskAction.propose,
        project=PROJECT,
        task_id=TASK,
        sender="alice",
        proposal=proposal,
    )
    record = advance(None, message, coordinators=frozenset({"coord"}), now=datetime.now(UTC))
    return json.loads(record.model_dump_json())  # type: ignore[no-any-return]


HOSTILE_TASKS = all_hostile_task_records(good_record())


def test_a_good_task_record_decodes() -> None:
    record = decode_task(json.dumps(good_record()).encode(), key=task_key(PROJECT, TASK), revision=3)
    assert (record.proposal.project, record.task_id, len(record.steps)) == (PROJECT, TASK, 1)


@pytest.mark.parametrize("hostile", HOSTILE_TASKS, ids=[h.name for h in HOSTILE_TASKS])
def test_every_hostile_task_record_decodes_to_a_malformed_record(hostile: Hostile) -> None:
    key = task_key(PROJECT, TASK)
    with pytest.raises(MalformedRecord) as caught:
        decode_task(hostile.value, key=key, revision=7)
    assert (caught.value.bucket, caught.value.key, caught.value.revision) == (MESH_BUCKET, key, 7)
    assert "\n" not in str(caught.value)
    assert f"{MESH_BUCKET} key {key}" in str(caught.value)


@pytest.mark.parametrize("hostile", hostile_payloads(), ids=[h.name for h in hostile_payloads()])
def test_every_hostile_roster_or_capabilities_record_decodes_to_a_malformed_record(hostile: Hostile) -> None:
    with pytest.raises(MalformedRecord):
        decode_roster(hostile.value, key=roster_key(PROJECT), revision=1)
    with pytest.raises(MalformedRecord):
        decode_capabilities(hostile.value, key=capabilities_key("bob"), revision=1)


def test_a_roster_or_capabilities_record_under_another_key_is_malformed() -> None:
    roster = json.dumps({"project": "elsewhere", "changes": []}).encode()
    with pytest.raises(MalformedRecord, match="belongs under"):
        decode_roster(roster, key=roster_key(PROJECT), revision=1)
    signed = {"public_key": AgentKey.generate("mallory").public_key, "signature": "A" * 86}
    advertised = json.dumps(
        {"agent": "mallory", "capabilities": ["python"], "updated_at": "2025-01-01T00:00:00Z"} | signed
    )
    with pytest.raises(MalformedRecord, match="belongs under"):
        decode_capabilities(advertised.encode(), key=capabilities_key("bob"), revision=1)


# -- against a real server ---------------------------------------------------------------------------------


async def raw_record(mesh: MeshAgent, project: str, task_id: str) -> dict[str, Any]:
    kv = await mesh.client.js.key_value(MESH_BUCKET)
    entry = await kv.get(task_key(project, task_id))
    assert entry.value is not None
    return json.loads(entry.value)  # type: ignore[no-any-return]


async def write_hostile_tasks(mesh: MeshAgent, project: str, task_id: str) -> dict[str, int]:
    """Every hostile task record, each under a key of its own in `project`: key → revision."""
    good = await raw_record(mesh, project, task_id)
    written: dict[str, int] = {}
    for i, hostile in enumerate(all_hostile_task_records(good)):
        key = task_key(project, f"bad-{i}")
        written[key] = await put_raw(mesh.client.js, MESH_BUCKET, key, hostile.value)
    return written


async def test_a_node_moves_past_hostile_task_records_and_records_what_follows(
    mesh_as: MeshFactory,
    project: str,
    node: Node,
    home: Path,
    sqlite_journal_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures_before = service_failures["mesh recorder"]  # counted per process, across tests
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    before = (await alice.propose(project, "before", "s", category="operational", agents=["bob"])).record
    written = await write_hostile_tasks(alice, project, before.task_id)
    stop_after_the_kv_write(alice, monkeypatch)  # only the node's recorder can publish what alice writes next
    after_id = new_event_id()
    with pytest.raises(Unavailable, match="stopped before publishing"):
        await alice.propose(project, "after", "s", category="operational", agents=["bob"], message_id=after_id)
    finding_event = coord.client.event("finding", finding(1), project=project)
    await coord.client.publish(finding_event)

    expected = {str(before.steps[0].message_id), str(after_id), str(finding_event.event_id)}
    await eventually(lambda: expected <= set(journal_event_ids(sqlite_journal_url, project)), timeout_s=20)
    recorder = node.recorder
    assert recorder is not None
    last_bad = max(written.values())
    assert recorder.watcher.last_seen > last_bad
    assert int((home / "mesh" / "recorder.cursor").read_text()) > last_bad
    assert {q.key for q in recorder.watcher.quarantine.records} == set(written)
    assert recorder.watcher.stats.quarantined == len(written)
    assert service_failures["mesh recorder"] == failures_before  # never crashed, never restarted


async def test_a_watcher_hands_over_only_good_revisions_and_logs_each_hostile_one_once(
    mesh_as: MeshFactory, project: str, caplog: pytest.LogCaptureFixture
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    before = (await alice.propose(project, "before", "s", category="operational")).record
    written = await write_hostile_tasks(alice, project, before.task_id)
    after = await alice.propose(project, "after", "s", category="operational")
    handled: list[tuple[int, str]] = []

    async def handle(entry: Any) -> None:
        handled.append((entry.revision, entry.record.task_id))

    caplog.set_level(logging.WARNING)
    watcher = TaskWatcher(lambda: alice.client.js, handle, project=project, cursor=MemoryCursor(), poll_timeout_s=0.2)
    await eventually(lambda: _stepped(watcher, after.revision))
    assert [task_id for _, task_id in handled] == [before.task_id, after.record.task_id]
    assert watcher.last_seen == after.revision
    assert watcher.stats.quarantined == len(written)
    quarantined = {(q.key, q.revision) for q in watcher.quarantine.records}
    assert quarantined == set(written.items())

    tasks = await alice.store.tasks(project)  # and a store listing the bucket twice logs each once
    tasks = await alice.store.tasks(project)
    assert {e.record.task_id for e in tasks} == {before.task_id, after.record.task_id}
    assert alice.store.quarantine.count == len(written)
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "quarantined" in r.getMessage()
    ]
    for key, revision in written.items():
        assert sum(f"{key} (revision {revision})" in w for w in warnings) == 2  # the watcher's and the store's


async def _stepped(watcher: TaskWatcher, end: int) -> bool:
    await watcher.step()
    return watcher.last_seen >= end


async def test_unreadable_roster_and_capabilities_are_skipped_by_a_listing_and_refused_by_a_decision(
    mesh_as: MeshFactory, project: str
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    await alice.advertise(["python"])
    other = f"{project}-x"
    await put_raw(alice.client.js, MESH_BUCKET, capabilities_key("bob"), b"[" * 30000)
    await put_raw(alice.client.js, MESH_BUCKET, roster_key(other), b"\xff\xfe")
    assert await alice.store.all_capabilities() == {"alice": ("python",)}
    assert [q.key for q in alice.store.quarantine.records] == [capabilities_key("bob")]
    with pytest.raises(MalformedRecord, match=f"{MESH_BUCKET} key {roster_key(other)}"):
        await alice.propose(other, "t", "s", category="operational")


# -- the CLI ---------------------------------------------------------------------------------------------------


def epibus(home: Path, nats_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_epibus(home, *args, "--nats", nats_url, check=False, columns=250)  # task ids whole in a row


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


async def test_mesh_inbox_and_outbox_show_the_good_tasks_and_the_quarantined_records(
    mesh_as: MeshFactory, project: str, nats_server: NatsServer, home: Path
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await mesh_as("bob")  # bob's key, in the home the CLI uses
    await coord.add_coordinator(project, "coord")
    good = (await alice.propose(project, "good", "s", category="operational", agents=["bob"])).record
    written = await write_hostile_tasks(alice, project, good.task_id)
    await put_raw(alice.client.js, MESH_BUCKET, capabilities_key("bob"), b'{"agent": "bob", "capabilities": 5}')
    later = (await alice.propose(project, "later", "s", category="operational", agents=["bob"])).record
    tasks = [good.task_id, later.task_id]
    url = nats_server.url

    outbox = ok_json(epibus(home, url, "mesh", "outbox", "-p", project, "--agent", "alice", "--json"))
    assert [t["task_id"] for t in outbox["tasks"]] == tasks
    assert {q["key"] for q in outbox["quarantined"]} == set(written)
    assert all(q["reason"] and q["revision"] == written[q["key"]] for q in outbox["quarantined"])

    inbox = ok_json(epibus(home, url, "mesh", "inbox", "-p", project, "--agent", "bob", "--json"))
    assert [t["task_id"] for t in inbox["tasks"]] == tasks
    assert {q["key"] for q in inbox["quarantined"]} == {*written, capabilities_key("bob")}

    shown = epibus(home, url, "mesh", "outbox", "-p", project, "--agent", "alice")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert good.task_id in shown.stdout
    assert f"{len(written)} unreadable mesh records quarantined" in " ".join(shown.stderr.split())

    figures = ok_json(epibus(home, url, "stats", "--json"))
    assert figures["mesh_quarantined"] == len(written)

    # the watcher moves past the hostile revisions to the task written after them
    watched = epibus(home, url, "mesh", "inbox", "--watch", "-n", "2", "-p", project, "--agent", "bob", "--json")
    note = ok_json(watched)
    assert (note["task_id"], note["action"]) == (later.task_id, "propose")
