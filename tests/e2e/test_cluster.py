"""`epibus cluster up 3` as a user runs it: three node processes, one JetStream cluster at R3 with authenticated
routes. An event published on node-1 is journaled on node-2 (read by SQL) and recalled by every node's mirror
through node-3; a node killed with SIGKILL is started again and catches up; `kill -9` of the supervisor leaves no
process behind, and the cluster started again keeps its ports and its data. One cluster for the module."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from bus.broker.ask import fan_out
from bus.client.client import EpibusClient
from bus.client.recall import recall_request
from bus.host.processes import alive
from bus.identity.signing import AgentKey
from bus.model.requests import RecallReply
from bus.model.vocab import Role
from bus.subjects import AGENT_KEYS_BUCKET, DLQ_STREAM, RECALL, STREAM
from tests.conftest import finding
from tests.support import enrol_agent, eventually, journal_event_ids, operator_credentials

pytestmark = pytest.mark.slow
START_S = 180.0  # three nodes load their model and elect a meta leader on a loaded 2-core machine


class Cluster:
    """`epibus cluster up 3 --json` in a session of its own, and what its cluster file says."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.root = home / "cluster"
        self.process: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(self.home)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "epibus", "cluster", "up", "3", "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        line = self.process.stdout.readline()
        assert line, f"`epibus cluster up` exited with {self.process.poll()}: {self.process.stderr.read()}"
        status = json.loads(line)
        assert status["status"] == "running", status
        self.info = status["cluster"]
        return self.info

    def node(self, name: str) -> dict[str, Any]:
        return next(n for n in self.read()["nodes"] if n["name"] == name)

    def read(self) -> dict[str, Any]:
        return dict(json.loads((self.root / "cluster.json").read_text()))

    def journal(self, name: str) -> str:
        return f"sqlite:///{self.root / name / 'journal.db'}"

    def processes(self) -> list[int]:
        """Every process whose command line names the cluster's directory (node processes, nats-servers)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if str(self.root) in argv and alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)
        for pid in self.processes():  # left behind only by a failing run
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    running = Cluster(tmp_path_factory.mktemp("cluster") / "home")
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def agent() -> AgentKey:
    return AgentKey.generate("cluster-agent")


@pytest.fixture
async def publisher(cluster: Cluster, agent: AgentKey) -> AsyncIterator[EpibusClient]:
    """The agent, enrolled through node-1 with the cluster's node key, connected to node-1."""
    node_1 = cluster.node("node-1")
    await enrol_agent(node_1["nats_url"], Path(node_1["home"]), agent, roles=[Role.agent], projects=["cluster"])
    client = EpibusClient([node_1["nats_url"]], agent, outbox=None)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def epibus_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPIBUS_")} | {"EPIBUS_HOME": str(cluster.home)}
    out = subprocess.run(
        [sys.executable, "-m", "epibus", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    # a result is the first line on stdout; a failure is one JSON object on stderr
    return dict(json.loads(out.stdout.splitlines()[0] if out.stdout else out.stderr.strip().splitlines()[-1]))


async def publish(client: EpibusClient, text: str) -> str:
    event = client.event("finding", finding(text=text), project="cluster")
    receipt = await client.publish(event)
    assert receipt.level == "published", receipt
    return str(event.event_id)


async def operator(cluster: Cluster, name: str) -> NatsClient:
    node = cluster.node(name)
    return await nats.connect(node["nats_url"], connect_timeout=5, **operator_credentials(Path(node["home"])))


async def stream_leader(cluster: Cluster, name: str, *, not_on: str) -> str | None:
    """The event stream's leader as the named node's server knows it, None while it has none but `not_on`."""
    nc = await operator(cluster, name)
    try:
        info = await nc.jetstream().stream_info(STREAM)
    except (nats.errors.Error, TimeoutError):
        return None
    finally:
        await nc.close()
    leader = info.cluster.leader if info.cluster else None
    return leader if leader and leader != not_on else None


def journaled(cluster: Cluster, name: str, event_id: str) -> bool:
    return event_id in journal_event_ids(cluster.journal(name), "cluster")


async def test_streams_and_buckets_are_replicated_on_three_servers(cluster: Cluster) -> None:
    nc = await operator(cluster, "node-2")
    try:
        js = nc.jetstream()
        for stream in (STREAM, DLQ_STREAM, f"KV_{AGENT_KEYS_BUCKET}"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, (stream, info.config.num_replicas)
            assert info.cluster is not None
            peers = {info.cluster.leader, *(r.name for r in info.cluster.replicas or [])}
            assert peers == {"node-1", "node-2", "node-3"}, (stream, info.cluster)
    finally:
        await nc.close()


def route_reply(port: int, password: str) -> bytes:
    """What a route port answers a route CONNECT with this password, then PING."""
    connect = {
        "verbose": False,
        "pedantic": False,
        "user": "route",
        "pass": password,
        "name": "probe",
        "cluster": "epibus",
    }
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert sock.recv(4096).startswith(b"INFO ")
        sock.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        deadline, reply = time.monotonic() + 5, b""
        while b"\r\n" not in reply and time.monotonic() < deadline:
            reply += sock.recv(4096)
        return reply


def test_a_route_port_refuses_a_connection_without_the_route_secret(cluster: Cluster) -> None:
    secret_file = cluster.root / "route.secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = secret_file.read_text().strip()
    port = cluster.node("node-1")["route"]
    assert route_reply(port, "0" * 64).startswith(b"-ERR 'Authorization Violation'")
    assert route_reply(port, "").startswith(b"-ERR 'Authorization Violation'")
    assert route_reply(port, secret).startswith(b"PONG"), "the secret itself should be let in"
    monitor = cluster.node("node-1")["monitor_url"]
    for path in ("/varz", "/routez"):  # the monitoring port answers anyone on the machine
        with urllib.request.urlopen(f"{monitor}{path}", timeout=5) as response:
            assert secret not in response.read().decode(), f"{path} shows the route secret"


async def test_published_on_node_1_journaled_on_node_2_recalled_from_node_3(
    cluster: Cluster, publisher: EpibusClient, agent: AgentKey
) -> None:
    event_id = await publish(publisher, "the cluster replicates every acknowledged event to three servers")
    await eventually(lambda: journaled(cluster, "node-2", event_id), timeout_s=30)

    # Enrolled through node-1; node-3's keeper applies the replicated registry to node-3's server.
    async def on_node_3() -> NatsClient | None:
        try:
            return await nats.connect(cluster.node("node-3")["nats_url"], connect_timeout=2, allow_reconnect=False,
                                      **agent.nats_credentials)  # fmt: skip
        except (nats.errors.Error, OSError, TimeoutError):
            return None

    nc = await eventually(on_node_3, timeout_s=15)
    try:
        request = recall_request(
            "replicated acknowledged event", "cluster", k=5, kinds=None, include_resolved=False, as_of=None,
            audit=False,
        )  # fmt: skip

        async def every_mirror_has_it() -> dict[str, list[str]]:
            replies = await fan_out(nc, RECALL, request, RecallReply, signer=agent, timeout_s=5)
            hits = {r.node: [h.event_id for h in r.hits] for r in replies.answers if isinstance(r, RecallReply)}
            return hits if set(hits) == {"node-1", "node-2", "node-3"} and all(
                event_id in ids for ids in hits.values()
            ) else {}  # fmt: skip

        await eventually(every_mirror_has_it, timeout_s=30, interval_s=0.5)
    finally:
        await nc.close()


async def test_a_killed_node_is_started_again_and_catches_up(cluster: Cluster, publisher: EpibusClient) -> None:
    assert cluster.process is not None
    before = cluster.node("node-3")
    # The supervisor is held (SIGSTOP) while node-3 is down, so the event is surely published without it.
    os.kill(cluster.process.pid, signal.SIGSTOP)
    try:
        os.kill(before["pid"], signal.SIGKILL)
        await eventually(lambda: not alive(before["pid"]), timeout_s=10)
        await eventually(lambda: not node_processes(cluster, "node-3"), timeout_s=10)  # its server went with it
        # If node-3 led the stream, the other two elect a leader first (a client with an outbox keeps its events
        # meanwhile; this one has none, so it publishes once they have).
        await eventually(lambda: stream_leader(cluster, "node-1", not_on="node-3"), timeout_s=30, interval_s=0.25)
        event_id = await publish(publisher, "published while node three was down")
        for name in ("node-1", "node-2"):
            await eventually(functools.partial(journaled, cluster, name, event_id), timeout_s=30)
        assert not journaled(cluster, "node-3", event_id)
    finally:
        os.kill(cluster.process.pid, signal.SIGCONT)

    def started_again() -> dict[str, Any] | None:
        node = cluster.node("node-3")
        return node if node["pid"] not in (None, before["pid"]) else None

    after = await eventually(started_again, timeout_s=START_S, interval_s=0.5)
    assert after["restarts"] == 1, after
    assert after["nats_url"] == before["nats_url"], after
    await eventually(lambda: journaled(cluster, "node-3", event_id), timeout_s=60, interval_s=0.25)


def node_processes(cluster: Cluster, name: str) -> list[int]:
    """The running processes (node, nats-server) whose command line names this node's home."""
    home, found = str(cluster.root / name), []
    for pid in cluster.processes():
        try:
            if home in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
    return found


async def test_kill_9_of_the_supervisor_leaves_no_process_and_a_restart_keeps_ports_and_data(
    cluster: Cluster,
) -> None:
    assert cluster.process is not None
    journaled_before = set(journal_event_ids(cluster.journal("node-1"), "cluster"))
    assert len(journaled_before) == 2, journaled_before
    ports = [(n["client"], n["monitor"], n["route"]) for n in cluster.read()["nodes"]]
    assert len(cluster.processes()) == 6, "three node processes and their three nats-servers"

    os.kill(cluster.process.pid, signal.SIGKILL)
    cluster.process.wait(timeout=10)
    await eventually(lambda: cluster.processes() == [], timeout_s=20, interval_s=0.2)

    info = await asyncio.to_thread(cluster.start)
    assert [(n["client"], n["monitor"], n["route"]) for n in info["nodes"]] == ports
    second = await asyncio.to_thread(epibus_json, cluster, "cluster", "up", "--json")
    assert second["ok"] is False
    assert "already runs" in second["error"]
    shown = await asyncio.to_thread(epibus_json, cluster, "cluster", "info", "--json")
    assert [n["pid"] for n in shown["cluster"]["nodes"]] == [n["pid"] for n in info["nodes"]]
    nc = await operator(cluster, "node-3")
    try:
        stream = await nc.jetstream().stream_info(STREAM)
        assert stream.config.num_replicas == 3
        assert set(journal_event_ids(cluster.journal("node-3"), "cluster")) == journaled_before
    finally:
        await nc.close()
