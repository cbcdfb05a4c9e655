"""Cluster routes of the embedded nats-server: the `cluster {...}` block that joins it to the other servers of a
cluster on this machine, authenticated by a route secret only their owner can read, and the wait for the
cluster's JetStream meta group to elect a leader."""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bus.errors import ConfigError, Unavailable
from bus.host.home import write_private

ROUTE_USER = "route"
CLUSTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
SECRET_PATTERN = re.compile(r"[0-9a-f]{64}")
ROUTE_PING_INTERVAL_S, ROUTE_PING_MAX = 2, 3


def require_ipv4(host: str, setting: str) -> str:
    """`host` when it is an IPv4 address (what goes into the server's configuration). Raises ConfigError."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError as e:
        raise ConfigError(setting, f"{host!r} is not an IPv4 address; give one such as 127.0.0.1") from e
    return host


def make_route_secret(path: Path) -> str:
    """The route secret kept at `path` (0600), made once: 32 random bytes, hex. Raises ConfigError when the
    file holds anything else."""
    if not path.exists():
        write_private(path, secrets.token_hex(32) + "\n", durable=True)
    return read_route_secret(path)


def read_route_secret(path: Path) -> str:
    try:
        secret = path.read_text().strip()
    except OSError as e:
        raise ConfigError("--route-secret-file", f"cannot read {path} ({e}); give the cluster's route secret") from e
    if not SECRET_PATTERN.fullmatch(secret):
        raise ConfigError("--route-secret-file", f"{path} holds no route secret (64 hex digits); delete it")
    if path.stat().st_mode & 0o077:
        raise ConfigError("--route-secret-file", f"{path} is readable by others; `chmod 600 {path}`")
    return secret


@dataclass(frozen=True)
class ClusterRoutes:
    """Where this server listens for routes (`host`:`port`) and which routes it dials, as (host, port) pairs
    (every server of the cluster may be listed, itself included: nats-server drops the route to itself)."""

    port: int
    routes: tuple[tuple[str, int], ...]
    secret: str
    name: str = "epibus"
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not CLUSTER_NAME_PATTERN.fullmatch(self.name):
            raise ConfigError("cluster name", f"{self.name!r} must match {CLUSTER_NAME_PATTERN.pattern}")
        if not SECRET_PATTERN.fullmatch(self.secret):
            raise ConfigError("route secret", "must be 64 hex digits (see make_route_secret)")
        for host in (self.host, *(h for h, _ in self.routes)):
            require_ipv4(host, "--routes")

    def config_block(self) -> str:
        """nats-server's `cluster` block: a route must present the secret, and presents it when it dials."""
        routes = "\n".join(f"    nats-route://{ROUTE_USER}:{self.secret}@{host}:{port}" for host, port in self.routes)
        return (
            "cluster {\n"
            f'  name: "{self.name}"\n'
            f'  listen: "{self.host}:{self.port}"\n'
            # A peer cut off by the network is dropped within seconds (the default waits minutes), so the
            # cluster's view of its routes follows a partition.
            f'  ping_interval: "{ROUTE_PING_INTERVAL_S}s"\n'
            f"  ping_max: {ROUTE_PING_MAX}\n"
            f'  authorization {{\n    user: "{ROUTE_USER}"\n    password: "{self.secret}"\n    timeout: 2\n  }}\n'
            f"  routes: [\n{routes}\n  ]\n"
            "}\n"
        )


def meta_leader(monitor_url: str) -> str | None:
    """The JetStream meta group's leader as this server sees it, None before one is elected."""
    try:
        with urllib.request.urlopen(f"{monitor_url}/jsz", timeout=2) as response:
            meta = json.loads(response.read()).get("meta_cluster") or {}
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None
    leader = meta.get("leader")
    return str(leader) if leader else None


def wait_for_meta_leader(monitor_url: str, timeout_s: float) -> str:
    """Block until the cluster has a JetStream meta leader (a majority of its servers run). Raises Unavailable."""
    deadline = time.monotonic() + timeout_s
    while (leader := meta_leader(monitor_url)) is None:
        if time.monotonic() > deadline:
            raise Unavailable(
                "nats-server",
                f"no JetStream meta leader after {timeout_s:.0f}s: fewer than a majority of the "
                "cluster's servers run; start the others",
            )
        time.sleep(0.2)
    return leader
