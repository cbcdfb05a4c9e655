"""Handshake integrity on the watching side: an inbox stopped and restarted mid-stream, or
cut off by a server restart, misses nothing and repeats nothing; an empty or failed poll resets nothing."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bus.broker.loops import cancel_and_wait
from bus.broker.nats_errors import RETRYABLE
from bus.errors import InvalidEvent, Unavailable
from bus.host.server import NatsServer
from bus.intake.cursor import FileCursor
from bus.subjects import MESH_STREAM
from mesh.agent import MeshAgent
from mesh.inbox import Inbox, Notification, NotificationLog
from mesh.store import TaskEntry
from mesh.watch import TaskWatcher
from tests.mesh.conftest import MeshFactory
from tests.support import eventually


def logged(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def run_inbox(bob: MeshAgent, path: Path, project: str) -> tuple[Inbox, asyncio.Task[None]]:
    log = NotificationLog(path)

    async def notify(note: Notification) -> None:
        log.append(note)
        await asyncio.sleep(0.01)  # a handler that takes a moment, so a stop can land mid-stream

    inbox = Inbox(bob, notify, project=project, cursor=log, poll_timeout_s=0.2)
    return inbox, asyncio.create_task(inbox.run())


async def bucket_end(mesh: MeshAgent) -> int:
    """The mesh bucket's last revision, read from the server."""
    return int((await mesh.client.js.stream_info(MESH_STREAM)).state.last_seq)


async def test_an_inbox_stopped_and_restarted_mid_stream_neither_misses_nor_repeats(
    mesh_as: MeshFactory, project: str, tmp_path: Path
) -> None:
    alice, coord, bob = await mesh_as("alice"), await mesh_as("coord"), await mesh_as("bob")
    await coord.add_coordinator(project, "coord")
    path = tmp_path / "bob.jsonl"
    n = 20

    async def traffic() -> list[str]:
        ids = []
        for i in range(n):
            task = (await alice.propose(project, f"job {i}", "s", category="operational", agents=["bob"])).record
            await coord.accept(task.task_id)
            ids.append(task.task_id)
        return ids

    _, watching = await run_inbox(bob, path, project)
    producing = asyncio.create_task(traffic())
    await eventually(lambda: len(logged(path)) >= 8, timeout_s=20)
    await cancel_and_wait([watching])  # stopped mid-stream, while traffic goes on
    stopped_at = len(logged(path))
    inbox, watching = await run_inbox(bob, path, project)
    try:
        task_ids = await producing
        end = await bucket_end(bob)
        await eventually(lambda: inbox.watcher.last_seen >= end, timeout_s=20)  # it has handled everything
    finally:
        await cancel_and_wait([watching])

    notes = logged(path)
    assert stopped_at < 2 * n
    assert [r for r, c in Counter(note["revision"] for note in notes).items() if c > 1] == []
    told = Counter((note["task_id"], note["action"]) for note in notes)
    expected = {(t, a): 1 for t in task_ids for a in ("propose", "accept")}
    assert dict(told) == expected
    revisions = [note["revision"] for note in notes]
    assert revisions == sorted(revisions)


async def test_a_watcher_cut_off_by_a_server_restart_resumes_from_its_last_revision(
    mesh_as: MeshFactory, project: str, nats_server: NatsServer
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    seen: list[int] = []

    async def handle(entry: TaskEntry) -> None:
        seen.append(entry.revision)

    watcher = TaskWatcher(lambda: coord.client.js, handle, project=project, poll_timeout_s=0.2)
    running = asyncio.create_task(watcher.run())
    try:
        for i in range(5):
            await alice.propose(project, f"before {i}", "s", category="operational", agents=["bob"])
        await eventually(lambda: len(seen) == 5)
        nats_server.kill()
        await asyncio.sleep(0.5)
        assert watcher.last_seen == seen[-1]  # failed polls reset nothing
        nats_server.start()
        await eventually(lambda: alice.client.connected, timeout_s=15)
        for i in range(5):
            await alice.propose(project, f"after {i}", "s", category="operational", agents=["bob"])
        end = await bucket_end(alice)
        await eventually(lambda: watcher.last_seen >= end, timeout_s=30)  # it has handled everything
    finally:
        await cancel_and_wait([running])
    assert len(seen) == len(set(seen)) == 10
    assert seen == sorted(seen)
    assert watcher.stats.resubscribed >= 2  # the consumer died with the server and was made again


async def test_an_empty_or_failed_poll_never_resets_what_was_seen(
    mesh_as: MeshFactory, project: str, nats_server: NatsServer, tmp_path: Path
) -> None:
    alice, coord = await mesh_as("alice"), await mesh_as("coord")
    await coord.add_coordinator(project, "coord")
    await alice.propose(project, "one", "s", category="operational", agents=["bob"])
    cursor = FileCursor(tmp_path / "cursor")
    handled: list[int] = []

    async def handle(entry: TaskEntry) -> None:
        handled.append(entry.revision)

    watcher = TaskWatcher(lambda: alice.client.js, handle, project=project, cursor=cursor, poll_timeout_s=0.2)
    assert await watcher.step() == 1
    seen = watcher.last_seen
    assert await watcher.step() == 0
    assert watcher.stats.empty_polls == 1
    nats_server.kill()
    watcher._checked_at = 0.0  # make the next empty poll ask the server for its consumer: a failed poll

    async def five_steps() -> None:
        for _ in range(5):
            await watcher.step()

    with pytest.raises(RETRYABLE):
        await five_steps()
    assert watcher.last_seen == seen
    assert cursor.load() == seen
    assert handled == [seen]
    nats_server.start()
    await eventually(lambda: alice.client.connected, timeout_s=15)
    again = TaskWatcher(lambda: alice.client.js, handle, project=project, cursor=FileCursor(tmp_path / "cursor"))
    assert again.last_seen == seen  # a new process starts after what the last one handled
    assert await again.step() == 0  # and hands over nothing it already handled
    await alice.propose(project, "two", "s", category="operational", agents=["bob"])
    assert await eventually(again.step) == 1
    assert handled[0] == seen
    assert len(handled) == 2


def test_a_notification_log_drops_a_torn_last_line_and_resumes_after_the_last_whole_one(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"revision": 7, "task_id": "a"}\n{"revision": 9, "task_')
    log = NotificationLog(path)
    assert log.load() == 7
    assert path.read_text() == '{"revision": 7, "task_id": "a"}\n'


@pytest.mark.parametrize(
    ("last_line", "problem"),
    [
        ('{"revision": -5}', "last line's revision is '-5', expected a revision number (0 or more)"),
        ('{"revision": 1e999}', "last line's revision is 'inf', expected a revision number (0 or more)"),
        ('{"revision": "7"}', "last line's revision is '7', expected a revision number (0 or more)"),
        ('{"revision": true}', "last line's revision is 'True', expected a revision number (0 or more)"),
        ('{"revision": ' + "[" * 5000 + "]" * 5000 + "}", "last line is not a notification: RecursionError"),
    ],
    ids=["negative", "infinite", "string", "bool", "deep-nesting"],
)
def test_a_notification_log_whose_last_line_holds_no_revision_is_refused_naming_the_file(
    tmp_path: Path, last_line: str, problem: str
) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text('{"revision": 7, "task_id": "a"}\n' + last_line + "\n")
    with pytest.raises(InvalidEvent, match=rf"^notification log {re.escape(str(path))}: {re.escape(problem)}"):
        NotificationLog(path)


@pytest.mark.parametrize("text", ["\u00b2", "-5", "9" * 5000, "12 13"])
def test_a_cursor_file_holding_no_revision_number_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "cursor").write_text(text + "\n")
    with pytest.raises(InvalidEvent, match=r"^cursor file .*cursor: holds .*, expected a revision number$"):
        FileCursor(tmp_path / "cursor").load()


async def test_a_watcher_whose_connection_was_closed_for_good_stops_saying_so(
    mesh_as: MeshFactory, project: str
) -> None:
    alice = await mesh_as("alice")

    async def handle(entry: TaskEntry) -> None:
        raise AssertionError(f"nothing should be handled, got {entry.revision}")

    watcher = TaskWatcher(
        lambda: alice.client.js, handle, project=project, closed=lambda: alice.client.closed, poll_timeout_s=0.2
    )
    await alice.client.close()
    with pytest.raises(Unavailable, match="connection was closed"):
        await asyncio.wait_for(watcher.run(), timeout=10)
