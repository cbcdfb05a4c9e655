"""The node's embedded nats-server: started under home/nats on the ports it kept, with the node's authorization,
its system-account user (the node reads its clients' counts with it) and, in a fleet, its hub or leaf options."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from bus.host.ports import read_ports
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from epibus.node.config import CLUSTER_START_S, NodeConfig

SYSTEM_KEY_FILE = "system.nk"


def system_key(config: NodeConfig) -> AgentKey:
    """The key of the embedded server's system-account user: the node reads its clients' counts with it."""
    return AgentKey.load_or_create_at(config.home / "nats" / SYSTEM_KEY_FILE, "system")


def monitor_port(config: NodeConfig) -> int:
    """The embedded server's HTTP monitoring port: the one asked for; otherwise none on a server with
    authentication (its pages list every client's key and every consumer to any local user; the node asks
    the system account instead), a free one without authentication or in a cluster (which waits on it)."""
    if config.monitor_port is not None:
        return config.monitor_port
    if config.cluster is not None or not config.authenticate:
        return -1
    kept = read_ports(config.home / "nats")  # a port asked for once is kept for later starts
    return kept.monitor if kept is not None and kept.monitor > 0 else 0


async def start_server(
    config: NodeConfig,
    name: str,
    authorization: str | None,
    stack: contextlib.AsyncExitStack,
    fleet: dict[str, Any] | None = None,
) -> NatsServer:
    """The embedded nats-server under home/nats, stopped with `stack`; `fleet`: its options as a fleet's hub or
    leaf (epibus/node/fleet.py)."""
    server = NatsServer(
        config.home / "nats",
        # In a fleet only the hub's listener for joining nodes (mutual TLS) faces the network; clients stay local.
        host="127.0.0.1" if fleet else config.host,
        port=config.port or -1,
        monitor_port=monitor_port(config),
        system_user=system_key(config).public_key if authorization is not None else None,
        keep_ports=True,  # clients following this node find it where it was before a restart
        authorization=authorization,
        server_name=name if config.cluster or fleet else "epibus",  # unique in a cluster or a fleet, kept
        cluster=config.cluster,
        **(fleet or {}),
    )
    stack.callback(server.stop)  # first: a start that fails half-way still frees the store
    # A cluster's server waits for a majority of its peers, which start at the same time.
    await asyncio.to_thread(server.start, CLUSTER_START_S if config.cluster else 20.0)
    return server
