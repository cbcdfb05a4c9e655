"""A node stopped and started again, as users run it: every process is a real `epibus` CLI in its own process on
one EPIBUS_HOME. The node keeps its ports, watchers (`tail`, `mesh inbox --watch`, `mesh coordinate`) ride out
the restart, and `publish` with no node running keeps the event in the outbox until the node sends it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import stat
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from bus.client.client import connect
from bus.host.ports import free_ports
from epibus.node.node import Node, NodeConfig
from observers.journal_engine import make_engine
from tests.conftest import finding
from tests.e2e.test_mesh_processes import epibus, error_json, first_line, lines, spawn, stop
from tests.support import eventually, eventually_sync, journal_event_ids, last_json

pytestmark = pytest.mark.slow
PROJECT = "fleet"


class Nodes:
    """`epibus up --mirror off` on one home, started and stopped as often as a test likes."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.process: subprocess.Popen[str] | None = None

    def start(self, *flags: str) -> dict[str, Any]:
        self.process = spawn(self.home, "up", "--json", "--mirror", "off", *flags)
        status: dict[str, Any] = first_line(self.process)
        assert status["status"] == "running"
        return status

    def stop(self) -> None:
        assert self.process is not None
        stop(self.process)
        assert self.process.returncode == 0
        self.process = None


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    runner = Nodes(tmp_path / "home")
    try:
        yield runner
    finally:
        if runner.process is not None:
            stop(runner.process)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# -- ports ------------------------------------------------------------------------------------------------


def test_a_node_started_again_in_the_same_home_listens_on_the_same_ports(nodes: Nodes) -> None:
    first = nodes.start()
    nodes.stop()
    second = nodes.start()
    assert (second["nats_url"], second["monitor_url"]) == (first["nats_url"], first["monitor_url"])
    kept = nodes.home / "nats" / "ports.json"
    assert first["monitor_url"] is None  # a node with authentication serves no monitoring port unless asked
    assert json.loads(kept.read_text()) == {"client": port_of(first["nats_url"]), "monitor": 0}
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600


def test_the_ports_given_to_up_are_used_and_remembered(nodes: Nodes) -> None:
    client_port, monitor_port = free_ports(2)
    first = nodes.start("--port", str(client_port), "--monitor-port", str(monitor_port))
    assert (first["nats_url"], first["monitor_url"]) == (
        f"nats://127.0.0.1:{client_port}",
        f"http://127.0.0.1:{monitor_port}",
    )
    nodes.stop()
    second = nodes.start()
    assert (second["nats_url"], second["monitor_url"]) == (first["nats_url"], first["monitor_url"])


def test_a_kept_port_taken_by_another_process_is_one_line_naming_the_port_the_holder_and_the_fix(
    nodes: Nodes,
) -> None:
    port = port_of(nodes.start()["nats_url"])
    nodes.stop()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        refused = epibus(nodes.home, "up", "--json", "--mirror", "off", check=False)
    assert refused.returncode == 1
    assert len(refused.stderr.strip().splitlines()) == 1
    error = error_json(refused)["error"]
    assert f"port 127.0.0.1:{port} is taken by pid {os.getpid()} (" in error
    assert "epibus up --port N" in error
    assert not (nodes.home / "node.json").exists()


# -- watchers across a restart ----------------------------------------------------------------------------


class Lines:
    """A process's stdout read line by line as it comes (a watcher's output, live)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def json(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.lines) if line.strip()]


def publish_online(home: Path, n: int, label: str) -> list[str]:
    """n findings published through the running node (a client that found it through node.json)."""

    async def go() -> list[str]:
        async with connect(agent="alice", home=home) as client:
            events = [client.event("finding", finding(i, text=f"{label} {i}"), project=PROJECT) for i in range(n)]
            receipts = await client.publish_many(events)
        assert {r.level.value for r in receipts} == {"published"}
        return [str(e.event_id) for e in events]

    return asyncio.run(go())


def publish_offline(home: Path, label: str) -> str:
    args = ["--text", label, "--impact", "0.5", "--confidence", "0.7", "--subject", "restart", "--json"]
    receipt = last_json(epibus(home, "publish", "finding", "-p", PROJECT, *args))
    assert (receipt["level"], receipt["stream_seq"]) == ("outboxed", None)
    return str(receipt["event_id"])


def propose(home: Path, title: str) -> str:
    args = ["mesh", "propose", "-p", PROJECT, "--title", title, "--summary", "s", "--to", "bob", "--agent", "alice"]
    return str(last_json(epibus(home, *args, "--json"))["task_id"])


def test_tail_inbox_and_coordinator_keep_receiving_across_a_node_restart_each_item_once(
    nodes: Nodes, tmp_path: Path
) -> None:
    home = nodes.home
    before = nodes.start()
    epibus(home, "mesh", "coordinators", "add", "coord", "-p", PROJECT, "--agent", "coord")
    policy = ["--policy", "auto-accept:operational", "--agent", "coord", "--json"]
    coordinator = spawn(home, "mesh", "coordinate", "-p", PROJECT, *policy)
    bob_log = tmp_path / "bob.jsonl"
    inbox = spawn(home, "mesh", "inbox", "--watch", "-p", PROJECT, "--agent", "bob", "--out", str(bob_log), "-n", "4")
    tail = spawn(home, "tail", "-p", PROJECT, "-k", "finding", "--from-start", "-n", "6", "--json")
    tailed = Lines(tail)
    try:
        assert first_line(coordinator)["status"] == "coordinating"
        events = publish_online(home, 2, "before the stop")
        tasks = [propose(home, "before the stop")]
        eventually_sync(lambda: len(tailed.json()) == 2 and len(lines(bob_log)) == 2, timeout_s=20)

        nodes.stop()
        events += [publish_offline(home, "while the node is down 1"), publish_offline(home, "while the node is down 2")]
        after = nodes.start()
        assert after["nats_url"] == before["nats_url"]
        events += publish_online(home, 2, "after the restart")
        tasks.append(propose(home, "after the restart"))

        assert tail.wait(timeout=30) == 0, tail.stderr.read() if tail.stderr else ""
        assert inbox.wait(timeout=30) == 0, inbox.stderr.read() if inbox.stderr else ""
    finally:
        for process in (tail, inbox):
            if process.poll() is None:
                stop(process)
        coordinated = stop(coordinator)
    shown = [line["event_id"] for line in tailed.json()]
    assert Counter(shown) == Counter(events)  # each exactly once, however the node's forwarder ordered the outbox
    notes = lines(bob_log)
    assert Counter((n["task_id"], n["action"], n["actor"]) for n in notes) == Counter(
        {(t, a, who): 1 for t in tasks for a, who in (("propose", "alice"), ("accept", "coord"))}
    )
    # Both accepts are coord's (the notes above, each once). Its own count may miss the last one: it is stopped
    # as soon as the inbox has seen the accept, which can be before the accept's event is published.
    assert '"status": "stopped"' in coordinated
    assert '"decided": {"accept": ' in coordinated


# -- publishing with no node ------------------------------------------------------------------------------


def test_a_finding_published_while_no_node_runs_is_outboxed_then_journaled_once_when_the_node_starts(
    nodes: Nodes,
) -> None:
    home = nodes.home
    args = ["--text", "written on a train", "--impact", "0.4", "--confidence", "0.9", "--subject", "offline"]
    receipt = last_json(epibus(home, "publish", "finding", "-p", "demo", *args, "--json"))
    assert (receipt["ok"], receipt["level"], receipt["stream_seq"]) == (True, "outboxed", None)
    with sqlite3.connect(home / "outbox.db") as db:  # durable on disk, read by another path
        (outboxed,) = db.execute("SELECT event_id, signature FROM outbox WHERE sent_at IS NULL").fetchall()
    assert outboxed[0] == receipt["event_id"]

    nodes.start()
    journal = f"sqlite:///{home / 'journal.db'}"
    eventually_sync(lambda: journal_event_ids(journal, "demo"), timeout_s=20)
    assert journal_event_ids(journal, "demo") == [receipt["event_id"]]
    engine = make_engine(journal)
    try:
        with engine.connect() as conn:
            (envelope,) = conn.execute(text("SELECT envelope FROM events WHERE project = 'demo'")).scalars()
    finally:
        engine.dispose()
    assert json.loads(envelope)["signature"] == outboxed[1]  # the event signed offline (its header's signature)
    assert last_json(epibus(home, "stats", "--json"))["streams"]["EPI"]["messages"] == 1


def test_with_no_node_running_reads_state_changes_and_waiting_for_the_journal_refuse_in_one_line(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    for command in (["stats"], ["resolve", "a-1", "-p", "demo", "--as", "stale"]):
        refused = epibus(home, *command, "--json", check=False)
        assert refused.returncode == 1
        assert len(refused.stderr.strip().splitlines()) == 1
        error = error_json(refused)["error"]
        assert f"no epibus node is running under {home}" in error
        assert "only `epibus publish` can wait in the outbox" in error
    args = ["--text", "t", "--impact", "0.4", "--confidence", "0.9", "--subject", "s", "--wait", "journaled"]
    waiting = epibus(home, "publish", "finding", "-p", "demo", *args, "--json", check=False)
    assert waiting.returncode == 1
    assert "'journaled' needs a running node" in error_json(waiting)["error"]
    outbox = home / "outbox.db"
    if outbox.exists():  # nothing written: no row, or no outbox at all
        with sqlite3.connect(outbox) as db:
            assert db.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


async def test_a_node_whose_crashed_server_finds_its_port_taken_keeps_trying_until_the_port_is_free(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with Node(NodeConfig(home=tmp_path / "home", mirror="off")) as node:
        server = node.server
        assert server is not None
        port = server.port
        with socket.socket() as squatter:
            server.kill()
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            refusal = f"port 127.0.0.1:{port} is taken by pid {os.getpid()}"
            await eventually(lambda: refusal in caplog.text, timeout_s=15)
            assert not server.running()
            assert all(not task.done() for task in node._tasks)  # the node runs on: nothing was raised out of it
        await eventually(server.running, timeout_s=20)
        assert server.port == port
