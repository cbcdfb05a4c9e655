"""What a node is started with (`NodeConfig`), and the checks made before anything of it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bus.broker.streams import StreamLimits
from bus.errors import ConfigError
from bus.host.routes import ClusterRoutes
from bus.model.auth import DEFAULT_CONSUMER_SLOTS
from epibus.dashboard.security import check_bind_host
from epibus.node.budget import PublishBudget

CLUSTER_START_S = 120.0
MAX_CONSUMER_SLOTS = 64  # each slot is three permission subjects per stream in every agent's broker entry


@dataclass(frozen=True)
class NodeConfig:
    home: Path
    nats_url: str | None = None  # None: run the embedded nats-server under home/nats
    # The embedded server's address and ports; None: the ports kept from an earlier start (free ones at the first)
    host: str = "127.0.0.1"
    port: int | None = None
    monitor_port: int | None = None
    journal_url: str | None = None  # None: SQLite file under home
    replicas: int = 1
    agent: str = "node"  # the agent the node's coordinators decide as
    name: str | None = None  # the node's name in replies; None: the one kept in home (a unique one at first)
    mirror: str = "edge"  # edge (qdrant-edge under home/mirror) | server (qdrant_url) | off
    qdrant_url: str | None = None
    batch_size: int = 256
    record: bool = True  # write home/node.json so other commands find this node
    # (project, policy) pairs: mesh coordinator services run as `agent`, which must coordinate each project
    coordinate: tuple[tuple[str, str], ...] = ()
    # The embedded server admits only the node and enrolled agents (their nkeys), each confined by the broker.
    authenticate: bool = True
    # Local clients enrol their agents with the node's key on first connect (see bus/client/client.py connect).
    auto_enrol: bool = True
    repair_streams: bool = False  # restore drifted streams at start instead of refusing to start
    rebuild_journal: bool = False  # keep the journal file aside and rebuild it from the stream (a damaged one)
    # The live web dashboard (docs/dashboard.md): None serves none; 0 a free port, kept across service restarts.
    ui_port: int | None = None
    ui_host: str = "127.0.0.1"
    ui_remote: bool = False  # serve the dashboard on a non-loopback ui_host
    # The Prometheus endpoint (epibus/monitoring/metrics_http.py): None, the port kept from an earlier start (a free one
    # at the first); 0, off. It binds metrics_host, which must be loopback unless metrics_remote.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_remote: bool = False
    cluster: ClusterRoutes | None = None  # the embedded server's routes to the other servers of a cluster
    limits: StreamLimits = field(default_factory=StreamLimits)  # what the streams may hold
    budget: PublishBudget = field(default_factory=PublishBudget)  # what one agent may send per minute
    agent_consumers: int = DEFAULT_CONSUMER_SLOTS  # consumers one agent may hold open per stream it reads
    # A fleet across machines: listen for joining nodes here (on `host`, mutual TLS): this node is the hub.
    fleet_port: int | None = None
    join: str | None = None  # an invite token: join the fleet it names (kept in home; later starts need none)
    # Honour the failpoints `epibus chaos` arms under home/failpoints (epibus/node/failpoints.py).
    failpoints: bool = False


def check_config(config: NodeConfig) -> None:
    """Refuse, before anything runs, what the node cannot start with."""
    own_server = (config.port, config.monitor_port, config.cluster, config.host != "127.0.0.1")
    if config.nats_url is not None and any(own_server):
        raise ConfigError("--port", "only the embedded server has a host, ports and routes; drop them, or --nats")
    if not 1 <= config.agent_consumers <= MAX_CONSUMER_SLOTS:
        raise ConfigError("--agent-consumers", f"{config.agent_consumers} is not between 1 and {MAX_CONSUMER_SLOTS}")
    if config.ui_port is not None:  # a refused address stops the start before anything runs
        check_bind_host(config.ui_host, allow_remote=config.ui_remote)


def settle_s(config: NodeConfig) -> float:
    """How long a start waits for a cluster's leaders (elected while its servers come up); alone, not at all."""
    return CLUSTER_START_S if config.cluster else 0
