"""The nodes `epibus chaos` runs and breaks: one supervised node on its embedded server, or the one-machine
cluster (optionally in network namespaces), with the process handles each fault needs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from bus.errors import ConfigError, Unavailable
from bus.host.processes import alive
from bus.host.server_guard import StoreLock
from bus.identity.signing import AgentKey, node_key
from bus.subjects import STREAM
from epibus.cluster.local import Member, Supervisor, cluster_root, plan_members, read_cluster

log = logging.getLogger(__name__)
HEALTHY_S = 240.0  # a node restarted by a fault loads its model and, in a cluster, waits for its peers
POLL_S = 0.25


@dataclass(frozen=True)
class Processes:
    node: int | None
    server: int | None


class Topology:
    """`async with Topology(run_dir, size) as nodes:` runs `size` supervised nodes (1: alone at R1; 3 to 5: the
    cluster at R3) with failpoints on, until the block exits. A node that dies is started again."""

    def __init__(self, run_dir: Path, size: int, *, network: Any = None) -> None:
        self.run_dir = run_dir
        self.size = size
        self.network = network  # epibus.cluster.netns.Namespaces, or None: every server on loopback
        self.supervisor: Supervisor | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.operator: NatsClient | None = None

    @property
    def members(self) -> list[Member]:
        assert self.supervisor is not None
        return self.supervisor.members

    @property
    def clustered(self) -> bool:
        return self.size > 1

    @property
    def nats_urls(self) -> list[str]:
        return [m.nats_url for m in self.members]

    @property
    def admin(self) -> AgentKey:
        """The nodes' shared key: chaos enrols its publishers and reads the stream as the nodes' operator."""
        return node_key(cluster_root(self.run_dir))

    @property
    def owns_nodes(self) -> bool:
        """True: chaos started the nodes, and stops them before the audit reads their files."""
        return True

    async def start(self) -> None:
        self.supervisor = Supervisor(self.run_dir, self.size, node_args=("--failpoints",), network=self.network)
        await asyncio.to_thread(self.supervisor.start)
        self._watcher = threading.Thread(target=self.supervisor.watch, args=(self._stopping,), daemon=True)
        self._watcher.start()

    async def __aenter__(self) -> Topology:
        try:
            await self.start()
            self.operator = await nats.connect(
                self.nats_urls, connect_timeout=5, max_reconnect_attempts=-1, **self.admin.nats_credentials
            )
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop every node (SIGTERM, in order); idempotent. Continues any node a fault left paused."""
        if self.operator is not None and not self.operator.is_closed:
            await self.operator.close()
        self._stopping.set()
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.join, 30)
        if self.supervisor is not None:
            for member in self.members:
                self.signal(member, signal.SIGCONT)
            await asyncio.to_thread(self.supervisor.stop)

    def processes(self, member: Member) -> Processes:
        """The node's pid and its nats-server's (from the store lock), None for what does not run now."""
        node = self.node_pid(member)
        holder = StoreLock(Path(member.home) / "nats").holder()
        server = holder.server_pid if holder is not None and holder.server_alive() else None
        return Processes(node, server)

    def node_pid(self, member: Member) -> int | None:
        assert self.supervisor is not None
        child = self.supervisor.children.get(member.name)
        return child.process.pid if child is not None and child.process.poll() is None else None

    def signal(self, member: Member, signum: int, *, server: bool = False, group: bool = False) -> int | None:
        """Send a signal to a node (its process group with `group`) or to its server; the pid signalled."""
        found = self.processes(member)
        pid = found.server if server else found.node
        if pid is None or not alive(pid):
            return None
        try:
            if group:
                os.killpg(pid, signum)  # each node leads its own session (see Supervisor._spawn)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            return None
        return pid

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    async def stream_leader(self) -> Member:
        """The member whose server leads the event stream. Raises Unavailable when none does."""
        if not self.clustered:
            return self.members[0]
        assert self.operator is not None
        try:
            info = await self.operator.jetstream().stream_info(STREAM)
        except (nats.errors.Error, TimeoutError) as e:
            raise Unavailable("nats", f"no stream info ({type(e).__name__}): the stream has no leader now") from e
        leader = info.cluster.leader if info.cluster else None
        if leader is None:
            raise Unavailable("nats", "the event stream has no leader now")
        return self.member(leader)

    async def await_healthy(self, timeout_s: float = HEALTHY_S) -> float:
        """Wait until every node and server runs and the stream answers, current on every replica. Returns the
        seconds waited. Raises Unavailable after timeout_s."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            problem = await self._health_problem()
            if problem is None:
                return round(time.monotonic() - started, 2)
            if time.monotonic() > deadline:
                raise Unavailable("cluster", f"not healthy after {timeout_s:.0f}s: {problem}")
            await asyncio.sleep(POLL_S)

    async def _health_problem(self) -> str | None:
        assert self.operator is not None
        for member in self.members:
            if not self.node_ready(member):
                return f"{member.name} is not running"
            if self.processes(member).server is None:
                return f"{member.name}'s nats-server is not running"
            if self.clustered:
                peers = await self.routes_of(member)
                if peers is None or peers < len(self.members) - 1:
                    return f"{member.name}'s server has routes to {peers} of {len(self.members) - 1} peers"
        try:
            info = await self.operator.jetstream().stream_info(STREAM)
        except (nats.errors.Error, TimeoutError) as e:
            return f"the event stream does not answer ({type(e).__name__})"
        if self.clustered:
            replicas = info.cluster.replicas if info.cluster and info.cluster.replicas else []
            behind = [str(r.name) for r in replicas if not r.current]
            if info.cluster is None or info.cluster.leader is None or len(replicas) < 2 or behind:
                return f"the event stream's replicas are not current ({', '.join(behind) or 'no leader'})"
        return None

    def node_ready(self, member: Member) -> bool:
        """Whether the node runs and said so (its `up --json` status line)."""
        assert self.supervisor is not None
        child = self.supervisor.children.get(member.name)
        return child is not None and child.status is not None and child.process.poll() is None

    def failpoints_unavailable(self) -> str | None:
        """None: every node honours failpoints (chaos started them so)."""
        return None

    async def routes_of(self, member: Member) -> int | None:
        """How many other servers the member's server has routes to now (from its monitoring port), None when
        it does not answer."""
        return await asyncio.to_thread(_routes, member.monitor_url)


def _routes(monitor_url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{monitor_url}/routez", timeout=2) as response:
            routes = json.loads(response.read()).get("routes") or []
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None
    # A server may keep a pool of connections to each peer: count the peers.
    return len({route.get("remote_id") for route in routes if isinstance(route, dict)})


class AttachedCluster(Topology):
    """The cluster `epibus cluster up` runs under a home, attached to as it runs: its supervisor restarts the
    nodes faults kill, and chaos leaves them running when it is done."""

    def __init__(self, home: Path) -> None:
        info = read_cluster(home)
        if info is None or not isinstance(info.get("supervisor_pid"), int) or not alive(info["supervisor_pid"]):
            raise ConfigError(
                "--attach", f"no cluster runs under {cluster_root(home)}; start one with `epibus cluster up`"
            )
        super().__init__(home, len(info["nodes"]))
        self._members = plan_members(home, len(info["nodes"]))

    @property
    def members(self) -> list[Member]:
        return self._members

    @property
    def owns_nodes(self) -> bool:
        return False

    async def start(self) -> None:
        return None  # it runs already

    async def stop(self) -> None:
        if self.operator is not None and not self.operator.is_closed:
            await self.operator.close()
        for member in self.members:  # a fault interrupted mid-pause must not leave a node stopped
            self.signal(member, signal.SIGCONT)

    def node_pid(self, member: Member) -> int | None:
        info = read_cluster(self.run_dir) or {}
        node = next((n for n in info.get("nodes", []) if isinstance(n, dict) and n.get("name") == member.name), {})
        pid = node.get("pid")
        return pid if isinstance(pid, int) and alive(pid) else None

    def node_ready(self, member: Member) -> bool:
        return self.node_pid(member) is not None  # the supervisor records a pid once the node said it runs

    def failpoints_unavailable(self) -> str | None:
        for member in self.members:
            pid = self.node_pid(member)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid is not None else []
            if b"--failpoints" not in argv:
                return f"{member.name} runs without failpoints; start the cluster with `epibus cluster up --failpoints`"
        return None
