"""A cluster whose nodes run in network namespaces, cut apart by a real network partition: the namespaces alone
(an established TCP connection stalls across a partition and resumes after heal, the root namespace reaches every
side, nothing is left behind), then three nodes in them. An event published through node-1 is journaled on
node-3; with node-3 cut off, its server loses its routes, node-1 still acknowledges and node-3's journal does not
get the event until the partition heals. One cluster for the module; skipped where namespaces cannot be made."""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest

from bus.client.client import EpibusClient
from bus.identity.signing import AgentKey
from bus.model.vocab import Role
from bus.subjects import STREAM
from epibus.cluster.local import Member, Supervisor
from epibus.cluster.netns import Namespaces, netns_unavailable
from tests.conftest import finding
from tests.support import enrol_agent, eventually, eventually_sync, journal_event_ids, operator_credentials

UNAVAILABLE = netns_unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or ""),
]
QUIET_S = 3.0  # how long a cut-off side is watched for what must not reach it

ECHO_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
while True:
    conn, _ = server.accept()
    threading.Thread(target=echo, args=(conn,), daemon=True).start()
"""
LINE_CLIENT = """
import socket, sys, threading
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
conn.settimeout(None)
def show():
    while data := conn.recv(4096):
        sys.stdout.write(data.decode()); sys.stdout.flush()
threading.Thread(target=show, daemon=True).start()
for line in sys.stdin:
    conn.sendall(line.encode())
"""


class Lines:
    """A process in a namespace, its stdout read line by line into a queue."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.strip())

    def next(self, timeout_s: float) -> str:
        return self.lines.get(timeout=timeout_s)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


def ip_out(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=True).stdout


def leftovers(tag: str) -> list[str]:
    """The namespaces, and the links (bridge, veths) of the root namespace, of one set of Namespaces."""
    ours = re.compile(rf"(epibus|eb)-{re.escape(tag)}(-\d+)?")
    names = [line.split()[0] for line in ip_out("netns", "list").splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip_out("-o", "link").splitlines()]
    return [name for name in names + links if ours.fullmatch(name)]


def echo(host: str, port: int, text: str) -> str:
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.sendall(text.encode())
        return conn.recv(4096).decode()


def test_a_partition_stalls_an_established_connection_both_ways_and_heal_resumes_it() -> None:
    with Namespaces(2) as net:
        servers = [Lines([*net.exec_prefix(i), sys.executable, "-c", ECHO_SERVER, net.hosts[i]]) for i in (0, 1)]
        client: Lines | None = None
        try:
            ports = [int(server.next(timeout_s=10)) for server in servers]
            client = Lines([*net.exec_prefix(1), sys.executable, "-c", LINE_CLIENT, net.hosts[0], str(ports[0])])
            client.send("before")
            assert client.next(timeout_s=10) == "before"

            net.partition([0], [1])
            client.send("during")
            with pytest.raises(queue.Empty):  # neither the line to 0 nor an echo back to 1 crosses
                client.next(timeout_s=QUIET_S)
            for i in (0, 1):  # the root namespace reaches both sides
                assert echo(net.hosts[i], ports[i], f"root to {i}") == f"root to {i}"
            assert client.process.poll() is None, "the connection is stalled, not closed"

            net.heal()
            assert client.next(timeout_s=60) == "during"  # retransmitted once the path is back
            client.send("after")
            assert client.next(timeout_s=10) == "after"
        finally:
            for process in [*servers, *([client] if client else [])]:
                process.stop()


def test_close_leaves_no_namespace_bridge_or_veth_behind() -> None:
    net = Namespaces(3)
    assert len(leftovers(net.tag)) == 3 + 1 + 3, "three namespaces, a bridge and three veths"
    net.partition([0], [1, 2])
    net.close()
    assert leftovers(net.tag) == []
    net.close()  # a second close has nothing left to do


def test_the_namespaces_of_a_killed_run_are_removed_by_the_next_run() -> None:
    code = (
        "from epibus.cluster.netns import Namespaces; import time; n = Namespaces(2); "
        "print(n.tag, flush=True); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    tag = process.stdout.readline().strip()
    try:
        assert len(leftovers(tag)) == 5, leftovers(tag)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    assert len(leftovers(tag)) == 5, "a killed process cannot clean up"
    with Namespaces(1):
        assert leftovers(tag) == []


# -- a cluster in the namespaces -------------------------------------------------------------------------


class NetCluster:
    def __init__(self, supervisor: Supervisor, net: Namespaces) -> None:
        self.supervisor = supervisor
        self.net = net

    def member(self, i: int) -> Member:
        return self.supervisor.members[i]

    def journaled(self, i: int, event_id: str) -> bool:
        return event_id in journal_event_ids(f"sqlite:///{Path(self.member(i).home) / 'journal.db'}", "netns")

    def routes(self, i: int) -> set[str]:
        """The servers node i's server has a route to, as its monitoring port tells the root namespace."""
        with urllib.request.urlopen(f"{self.member(i).monitor_url}/routez", timeout=5) as response:
            routez = json.loads(response.read())
        return {str(r.get("remote_name")) for r in routez.get("routes") or []}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    home = tmp_path_factory.mktemp("netns") / "home"
    with Namespaces(3) as net, Supervisor(home, 3, mirror="off", network=net) as supervisor:
        yield NetCluster(supervisor, net)


@pytest.fixture(scope="module")
def agent() -> AgentKey:
    return AgentKey.generate("netns-agent")


@pytest.fixture
async def publisher(cluster: NetCluster, agent: AgentKey) -> AsyncIterator[EpibusClient]:
    """The agent, enrolled through node-1 and connected to it, from the root namespace."""
    node_1 = cluster.member(0)
    await enrol_agent(node_1.nats_url, Path(node_1.home), agent, roles=[Role.agent], projects=["netns"])
    client = EpibusClient([node_1.nats_url], agent, outbox=None)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def publish(client: EpibusClient, text: str) -> str:
    event = client.event("finding", finding(text=text), project="netns")
    receipt = await client.publish(event)
    assert receipt.level == "published", receipt
    return str(event.event_id)


async def stream_leader(cluster: NetCluster, i: int) -> str | None:
    member = cluster.member(i)
    nc = await nats.connect(member.nats_url, connect_timeout=5, **operator_credentials(Path(member.home)))
    try:
        info = await nc.jetstream().stream_info(STREAM)
    except (nats.errors.Error, TimeoutError):
        return None
    finally:
        await nc.close()
    return info.cluster.leader if info.cluster else None


def test_every_node_listens_on_its_namespace_address(cluster: NetCluster) -> None:
    info = json.loads((cluster.supervisor.root / "cluster.json").read_text())
    members = cluster.supervisor.members
    assert [n["nats_url"] for n in info["nodes"]] == [f"nats://{cluster.net.hosts[i]}:{m.client}" for i, m in
                                                      enumerate(members)]  # fmt: skip
    for i in range(3):
        assert cluster.routes(i) == {f"node-{j + 1}" for j in range(3) if j != i}


async def test_an_event_published_through_node_1_is_journaled_on_node_3(
    cluster: NetCluster, publisher: EpibusClient
) -> None:
    event_id = await publish(publisher, "three nodes in three network namespaces")
    await eventually(lambda: cluster.journaled(2, event_id), timeout_s=30)


async def test_cut_off_node_3_loses_its_routes_misses_what_the_majority_acknowledges_and_catches_up_on_heal(
    cluster: NetCluster, publisher: EpibusClient
) -> None:
    cluster.net.partition([2], [0, 1])
    try:
        await eventually(lambda: cluster.routes(2) == set(), timeout_s=60, interval_s=0.5)
        await eventually(lambda: cluster.routes(0) == {"node-2"}, timeout_s=60, interval_s=0.5)
        # If node-3 led the stream, the majority elects another leader first (this client has no outbox).
        leader = await eventually(lambda: stream_leader(cluster, 0), timeout_s=60, interval_s=0.5)
        assert leader in ("node-1", "node-2"), leader
        event_id = await publish(publisher, "acknowledged by the majority while node three was cut off")
        for i in (0, 1):
            await eventually(functools.partial(cluster.journaled, i, event_id), timeout_s=30)
        with pytest.raises(AssertionError):  # node-3 stays without it for as long as it is watched
            await eventually(lambda: cluster.journaled(2, event_id), timeout_s=QUIET_S, interval_s=0.25)
    finally:
        cluster.net.heal()
    await eventually(lambda: cluster.routes(2) == {"node-1", "node-2"}, timeout_s=60, interval_s=0.5)
    await eventually(lambda: cluster.journaled(2, event_id), timeout_s=60, interval_s=0.25)


def test_stopping_the_cluster_and_closing_the_namespaces_leaves_nothing_behind(cluster: NetCluster) -> None:
    cluster.supervisor.stop()
    for name in cluster.net.names:  # the node processes and their servers are gone from the namespaces
        eventually_sync(lambda n=name: ip_out("netns", "pids", n).split() == [], timeout_s=30)  # type: ignore[misc]
    cluster.net.close()
    assert leftovers(cluster.net.tag) == []
