"""A JetStream cluster on one machine: `epibus cluster up` runs N nodes (`epibus up` processes), each with its own
home under `<home>/cluster/node-<i>`, embedded nats-server, journal and mirror, their servers joined by routes
that present the cluster's route secret. The streams and buckets are kept at R3.

The nodes share one node key (`<home>/cluster/node.nk`, copied into each node's home): one operator runs
them all, so an agent enrolled through any node is an agent of the cluster (the registry bucket is
replicated, and each node's keeper applies it to its own server), and an admin request signed with the key is
answered by whichever node takes it. Ports are chosen free at the first start and kept in
`<home>/cluster/cluster.json`, which also says where each node runs. Every node process dies with the
supervisor (parent-death signal), and its nats-server dies with it; a node that exits is started again."""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.errors import ConfigError, Unavailable
from bus.host.home import PRIVATE_FILE, node_name, private_dir, write_private
from bus.host.ports import free_ports, port_taken
from bus.host.processes import alive
from bus.host.routes import ClusterRoutes, make_route_secret, read_route_secret, require_ipv4
from bus.host.server_guard import SPAWNER, die_with_parent
from bus.identity.signing import NODE_KEY_FILE, node_key

if TYPE_CHECKING:
    from epibus.cluster.netns import Namespaces

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
CLUSTER_DIR = "cluster"
CLUSTER_FILE = "cluster.json"
ROUTE_SECRET_FILE = "route.secret"
CLUSTER_REPLICAS = 3
MIN_NODES, MAX_NODES = 3, 5
NODE_START_S = 300.0  # a node loads its embedding model and waits for the cluster's meta leader
STOP_S = 60.0
RESTART_AFTER_S, MAX_RESTART_AFTER_S = 2.0, 60.0
# The node processes take their settings from the supervisor's arguments, never from these.
_NODE_ENV_DROPPED = ("EPIBUS_HOME", "EPIBUS_NATS_URL", "EPIBUS_JOURNAL_URL", "EPIBUS_NODE_NAME", "EPIBUS_REPLICAS")


def cluster_routes(
    cluster_port: int | None, routes: str | None, secret_file: Path | None, *, host: str = LOOPBACK
) -> ClusterRoutes | None:
    """`epibus up`'s route options as ClusterRoutes listening on `host`, None when none is given. A route is
    PORT (on loopback) or HOST:PORT. Raises ConfigError."""
    if cluster_port is None and routes is None and secret_file is None:
        return None
    if cluster_port is None or routes is None or secret_file is None:
        raise ConfigError("--cluster-port", "a cluster node needs --cluster-port, --routes and --route-secret-file")
    dialled = tuple(_route(part.strip(), routes) for part in routes.split(",") if part.strip())
    if not dialled:
        raise ConfigError("--routes", f"{routes!r} must list route ports, e.g. 6222,6223,6224")
    return ClusterRoutes(port=cluster_port, routes=dialled, secret=read_route_secret(secret_file), host=host)


def _route(part: str, routes: str) -> tuple[str, int]:
    host, _, port = part.rpartition(":")
    try:
        number = int(port)
    except ValueError as e:
        raise ConfigError("--routes", f"{routes!r} must be PORT or HOST:PORT items, e.g. 6222,6223,6224") from e
    if not 0 < number < 65536:
        raise ConfigError("--routes", f"{number} in {routes!r} is no port; give 1 to 65535")
    return require_ipv4(host or LOOPBACK, "--routes"), number


@dataclass(frozen=True)
class Member:
    """One node of the cluster: its name, home, the ports it keeps and the address its server listens on
    (loopback, or its network namespace's address)."""

    name: str
    home: str
    client: int
    monitor: int
    route: int
    host: str = LOOPBACK

    @property
    def nats_url(self) -> str:
        return f"nats://{self.host}:{self.client}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor}"


def cluster_root(home: Path) -> Path:
    return home / CLUSTER_DIR


def read_cluster(home: Path) -> dict[str, Any] | None:
    """The cluster file under home, None before the first `epibus cluster up`. Raises ConfigError."""
    path = cluster_root(home) / CLUSTER_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ConfigError("cluster", f"{path} is unreadable ({e}); restore it, or delete {path.parent}") from e
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise ConfigError("cluster", f"{path} lists no nodes; restore it, or delete {path.parent}")
    return data


def plan_members(home: Path, size: int, *, standalone: bool = False) -> list[Member]:
    """The cluster's nodes: as kept in the cluster file, or new ones on free ports. `standalone` plans the one
    node of a supervised single node (no routes). Raises ConfigError."""
    if standalone and size != 1:
        raise ConfigError("SIZE", f"{size} nodes; a standalone node is one")
    if not standalone and not MIN_NODES <= size <= MAX_NODES:
        raise ConfigError("SIZE", f"{size} nodes; a cluster runs {MIN_NODES} to {MAX_NODES}")
    root = cluster_root(home)
    kept = read_cluster(home)
    if kept is not None:
        try:
            members = [
                Member(**{k: n[k] for k in ("name", "home", "client", "monitor", "route")}) for n in kept["nodes"]
            ]
        except (KeyError, TypeError) as e:
            raise ConfigError("cluster", f"{root / CLUSTER_FILE} has a bad node entry ({e}); restore it") from e
        if len(members) != size:
            raise ConfigError("SIZE", f"the cluster under {root} has {len(members)} nodes, not {size}; start it so")
        return members
    ports = free_ports(3 * size)
    return [
        Member(f"node-{i + 1}", str(root / f"node-{i + 1}"), ports[3 * i], ports[3 * i + 1], ports[3 * i + 2])
        for i in range(size)
    ]


def share_node_key(root: Path, member_home: Path) -> None:
    """Give a node's home the cluster's node key (made once). Raises ConfigError when it holds another one."""
    cluster_key = node_key(root)
    path = member_home / NODE_KEY_FILE
    if path.exists():
        if node_key(member_home).public_key != cluster_key.public_key:
            raise ConfigError(str(path), f"is not the cluster's node key {root / NODE_KEY_FILE}; move it away")
        return
    private_dir(member_home)
    write_private(path, (root / NODE_KEY_FILE).read_text(), durable=True)


@dataclass
class Child:
    """One node process and what the supervisor knows of it."""

    member: Member
    process: subprocess.Popen[bytes]
    status: dict[str, Any] | None = None
    restarts: int = 0
    restart_at: float | None = None
    failed_in_a_row: int = 0


class Supervisor:
    """`with Supervisor(home, 3) as cluster:` runs the cluster until the block exits; `watch(stop)` keeps every
    node running (a node that exits is started again, the wait doubling with each failure in a row).

    With a `network`, node i runs in network namespace i and its server listens (clients, monitoring, routes)
    on that namespace's address, which the cluster file then names; the ports are kept as without one."""

    def __init__(
        self,
        home: Path,
        size: int = 3,
        *,
        mirror: str = "edge",
        network: Namespaces | None = None,
        node_args: tuple[str, ...] = (),
    ) -> None:
        self.home = home
        self.root = cluster_root(home)
        self.mirror = mirror
        self.network = network
        # One supervised node runs alone (R1, no routes): `epibus chaos` restarts it the way a cluster's are.
        self.standalone = size == 1
        self.replicas = 1 if self.standalone else CLUSTER_REPLICAS
        self.node_args = node_args  # more `epibus up` options for every node (e.g. --failpoints)
        self.members = plan_members(home, size, standalone=self.standalone)
        if network is not None:
            if network.size < len(self.members):
                raise ConfigError("network", f"{network.size} namespaces for {len(self.members)} nodes; make one each")
            self.members = [replace(m, host=network.hosts[i]) for i, m in enumerate(self.members)]
        self.children: dict[str, Child] = {}

    def __enter__(self) -> Supervisor:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every node and return once each runs. Raises ConfigError (a port is taken, a home is wrong)
        or Unavailable (a node exited, or did not start in time), naming the node and its log."""
        kept = read_cluster(self.home)
        holder = kept.get("supervisor_pid") if kept else None
        if isinstance(holder, int) and holder != os.getpid() and alive(holder):
            raise ConfigError("cluster", f"a cluster already runs under {self.root} (pid {holder}); stop it first")
        private_dir(self.root)
        make_route_secret(self.root / ROUTE_SECRET_FILE)
        for member in self.members:
            share_node_key(self.root, Path(member.home))
            node_name(Path(member.home), member.name)
        self.write_info()  # the ports are kept from the first start on, whatever happens next
        for member in self.members:
            self.children[member.name] = Child(member, self._spawn(member))
        deadline = time.monotonic() + NODE_START_S
        for child in self.children.values():
            self._await_status(child, deadline)
        self.write_info()

    def _spawn(self, member: Member) -> subprocess.Popen[bytes]:
        # In a namespace of its own a node's ports are its own: the root namespace's say nothing of them.
        ports = (member.client, member.monitor, member.route) if self.network is None else ()
        taken = [p for p in ports if port_taken(LOOPBACK, p)]
        if taken:
            raise ConfigError(
                "cluster",
                f"{member.name}'s port {taken[0]} is taken; stop what holds it (the ports are kept in "
                f"{self.root / CLUSTER_FILE})",
            )
        env = {k: v for k, v in os.environ.items() if k not in _NODE_ENV_DROPPED}
        routes = ",".join(str(m.route) if self.network is None else f"{m.host}:{m.route}" for m in self.members)
        argv = [
            sys.executable, "-m", "epibus", "up", "--json", "--home", member.home, "--name", member.name,
            "--port", str(member.client), "--monitor-port", str(member.monitor),
            "--replicas", str(self.replicas), "--mirror", self.mirror, *self.node_args,
        ]  # fmt: skip
        if not self.standalone:
            argv += [
                "--cluster-port", str(member.route), "--routes", routes,
                "--route-secret-file", str(self.root / ROUTE_SECRET_FILE),
            ]  # fmt: skip
        if self.network is not None:
            argv = [*self.network.exec_prefix(self.members.index(member)), *argv, "--host", member.host]
        log_path = Path(member.home) / "node.log"
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        with os.fdopen(log_fd, "ab") as log_out:
            # Forked from the spawner thread, which lives as long as this process: the parent-death signal
            # fires when the forking thread ends. A session of its own: Ctrl-C reaches the supervisor only.
            return SPAWNER.run(
                lambda: subprocess.Popen(
                    argv,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=log_out,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
            )

    def _await_status(self, child: Child, deadline: float) -> None:
        """Read the node's `up --json` status line. Raises Unavailable (or the node's own error)."""
        stdout = child.process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise Unavailable(child.member.name, f"not running after {NODE_START_S:.0f}s; {self._tail(child)}")
        line = stdout.readline()
        try:
            status = json.loads(line) if line else {}
        except json.JSONDecodeError:
            status = {}
        if not isinstance(status, dict) or status.get("ok") is not True:
            error = status.get("error") if isinstance(status, dict) else None
            try:
                child.process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:  # it said it failed but goes on: it is not one of the cluster's
                child.process.kill()
                child.process.wait(timeout=10)
            raise Unavailable(
                child.member.name, f"exited with {child.process.returncode}: {error or self._tail(child)}"
            )
        child.status = status

    def _tail(self, child: Child) -> str:
        path = Path(child.member.home) / "node.log"
        lines = path.read_text(errors="replace").splitlines()[-3:] if path.exists() else []
        return f"see {path}: " + " | ".join(lines)

    def write_info(self) -> None:
        """The cluster file: the kept ports, and where each node runs (`--nats` takes `nats_urls`)."""
        nodes = []
        for member in self.members:
            child = self.children.get(member.name)
            running = child is not None and child.status is not None and child.process.poll() is None
            nodes.append(
                asdict(member)
                | {
                    "nats_url": member.nats_url,
                    "monitor_url": member.monitor_url,
                    "pid": child.process.pid if child is not None and running else None,
                    "restarts": child.restarts if child is not None else 0,
                }
            )
        info = {
            "name": "epibus",
            "replicas": self.replicas,
            "supervisor_pid": os.getpid(),
            "route_secret_file": str(self.root / ROUTE_SECRET_FILE),
            "nats_urls": ",".join(m.nats_url for m in self.members),
            "nodes": nodes,
        }
        write_private(self.root / CLUSTER_FILE, json.dumps(info, indent=2) + "\n", durable=True)

    def watch(self, stopping: Any) -> None:
        """Until `stopping.is_set()`: start again every node that exited, after a growing wait."""
        while not stopping.wait(0.5):
            for child in self.children.values():
                self._tend(child)

    def _tend(self, child: Child) -> None:
        now = time.monotonic()
        if child.restart_at is None:
            if child.process.poll() is None:
                if child.status is None:
                    self._check_started(child)
                return
            child.failed_in_a_row = child.failed_in_a_row + 1 if child.status is None else 1
            delay_s = min(MAX_RESTART_AFTER_S, RESTART_AFTER_S * 2 ** (child.failed_in_a_row - 1))
            log.error(
                "%s exited with %s; starting it again in %gs", child.member.name, child.process.returncode, delay_s
            )
            child.status = None
            child.restart_at = now + delay_s
            self.write_info()
            return
        if now >= child.restart_at:
            child.restart_at = None
            child.restarts += 1
            try:
                child.process = self._spawn(child.member)
            except ConfigError as e:  # its port is still held (its old server dying) or was taken: tried again
                child.failed_in_a_row += 1
                delay_s = min(MAX_RESTART_AFTER_S, RESTART_AFTER_S * 2 ** (child.failed_in_a_row - 1))
                log.error("%s did not start: %s; trying again in %gs", child.member.name, e, delay_s)
                child.restart_at = now + delay_s

    def _check_started(self, child: Child) -> None:
        stdout = child.process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(timeout=0):
                return
        try:
            self._await_status(child, time.monotonic() + 1.0)
        except Unavailable as e:
            log.error("%s", e)
            return
        log.warning("%s runs again (pid %d)", child.member.name, child.process.pid)
        self.write_info()

    def stop(self) -> None:
        """SIGTERM to every node at once (each stops its services and server in order), SIGKILL after STOP_S."""
        running = [c.process for c in self.children.values() if c.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("node pid %d did not stop in %.0fs; killing it", process.pid, STOP_S)
                process.kill()
                process.wait(timeout=10)
        for child in self.children.values():
            child.status = None
        if self.children:  # a start refused before any node ran leaves the running cluster's file alone
            self.write_info()
