"""`epibus up`: run a node on this machine (an embedded nats-server, or a URL to join), until Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bus.broker.streams import GIB, MIB, StreamLimits
from bus.errors import ConfigError
from bus.host.home import default_agent, epibus_home, read_node_info
from bus.host.routes import require_ipv4
from bus.host.server import MIN_SERVER_VERSION
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NodeNatsOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cluster.local import cluster_routes
from epibus.node.budget import PublishBudget

# Loaded by the commands that use them, not at the top: the node (dashboard, metrics server, mirror), SQLAlchemy
# and the mesh store would otherwise cost every CLI start, `epibus --help` included.
if TYPE_CHECKING:
    from epibus.node.node import NodeConfig


@handles_errors
def up(
    nats: NodeNatsOpt = None,
    port: Annotated[
        int | None,
        typer.Option("--port", min=1, max=65535, help="The embedded nats-server's client port; kept for later starts."),
    ] = None,
    monitor_port: Annotated[
        int | None,
        typer.Option("--monitor-port", min=1, max=65535, help="Its monitoring port; kept for later starts."),
    ] = None,
    journal: JournalOpt = None,
    replicas: Annotated[
        int,
        typer.Option("--replicas", envvar="EPIBUS_REPLICAS", min=1, max=5, help="Stream replicas (3 in a cluster)."),
    ] = 1,
    mirror: Annotated[
        str,
        typer.Option("--mirror", envvar="EPIBUS_MIRROR", help="edge (embedded Qdrant) | server (--qdrant-url) | off"),
    ] = "edge",
    qdrant_url: Annotated[str | None, typer.Option("--qdrant-url", envvar="QDRANT_URL")] = None,
    coordinate: Annotated[
        list[str] | None,
        typer.Option(
            "--coordinate",
            help="PROJECT=POLICY: run a mesh coordinator for PROJECT as --agent (repeatable); POLICY is manual, "
            "auto-accept:<categories> or capability-match.",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", envvar="EPIBUS_NODE_NAME", help="The node's name in replies; kept for later starts."),
    ] = None,
    authenticate: Annotated[
        bool,
        typer.Option(
            "--auth/--no-auth",
            envvar="EPIBUS_AUTH",
            help="The embedded server admits only the node and enrolled agents, each confined by the broker.",
        ),
    ] = True,
    auto_enrol: Annotated[
        bool,
        typer.Option(
            "--auto-enrol/--no-auto-enrol",
            envvar="EPIBUS_AUTO_ENROL",
            help="Agents created under this home are enrolled with the node's key on first connect.",
        ),
    ] = True,
    repair_streams: Annotated[
        bool,
        typer.Option(
            "--repair-streams",
            help="Restore streams whose settings drifted from what epibus needs, instead of refusing to start.",
        ),
    ] = False,
    rebuild_journal: Annotated[
        bool,
        typer.Option(
            "--rebuild-journal",
            help="Keep a damaged SQLite journal aside and rebuild it from the stream as the node runs.",
        ),
    ] = False,
    ui_port: Annotated[
        int | None,
        typer.Option(
            "--ui-port",
            envvar="EPIBUS_UI_PORT",
            min=0,
            max=65535,
            help="Serve the live dashboard on this port (0: a free one); its URL, with the token, is printed.",
        ),
    ] = None,
    ui_host: Annotated[
        str, typer.Option("--ui-host", envvar="EPIBUS_UI_HOST", help="The dashboard's address (loopback by default).")
    ] = "127.0.0.1",
    ui_remote: Annotated[
        bool, typer.Option("--ui-remote", help="Allow a non-loopback --ui-host (plain HTTP: use a trusted network).")
    ] = False,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            envvar="EPIBUS_METRICS_PORT",
            min=0,
            max=65535,
            help="The Prometheus endpoint's port (kept for later starts; a free one at the first); 0 turns it off.",
        ),
    ] = None,
    metrics_host: Annotated[
        str,
        typer.Option("--metrics-host", envvar="EPIBUS_METRICS_HOST", help="The address /metrics listens on."),
    ] = "127.0.0.1",
    metrics_remote: Annotated[
        bool,
        typer.Option("--metrics-remote", help="Allow a --metrics-host that is not loopback (the token still applies)."),
    ] = False,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="The embedded server's IPv4 address (clients, monitoring, routes). Beyond loopback it is open to "
            "that network: nkeys and the route secret still apply.",
        ),
    ] = "127.0.0.1",
    cluster_port: Annotated[
        int | None,
        typer.Option("--cluster-port", min=1, max=65535, help="Listen for cluster routes here (on --host)."),
    ] = None,
    routes: Annotated[
        str | None,
        typer.Option(
            "--routes", help="PORT,... (on loopback) or HOST:PORT,...: the cluster's route ports (with --cluster-port)."
        ),
    ] = None,
    route_secret_file: Annotated[
        Path | None,
        typer.Option("--route-secret-file", help="The cluster's route secret (0600); routes must present it."),
    ] = None,
    fleet_port: Annotated[
        int | None,
        typer.Option(
            "--fleet-port",
            min=1,
            max=65535,
            help="Be a fleet's hub: listen here (on --host) for nodes joining from other machines "
            "(mutual TLS with the fleet's CA, each node its own key).",
        ),
    ] = None,
    join: Annotated[
        str | None,
        typer.Option("--join", help="Join the fleet of this invite token (`epibus fleet invite` on its hub)."),
    ] = None,
    events_max_gib: Annotated[
        float,
        typer.Option(
            "--events-max-gib",
            min=0.001,
            help="The event stream's size limit; when full it refuses new "
            "events (they wait in the publishers' outboxes).",
        ),
    ] = 8.0,
    events_max_msgs: Annotated[
        int, typer.Option("--events-max-msgs", min=-1, help="The event stream's message limit (-1: none).")
    ] = -1,
    dlq_max_mib: Annotated[
        float, typer.Option("--dlq-max-mib", min=0.001, help="The dead-letter stream's size (oldest dropped first).")
    ] = 256.0,
    dlq_max_age_days: Annotated[
        float, typer.Option("--dlq-max-age-days", min=0.001, help="How long a dead letter is kept.")
    ] = 30.0,
    vectors_max_mib: Annotated[
        float,
        typer.Option("--vectors-max-mib", min=0.001, help="The shared vectors' stream size (oldest dropped first)."),
    ] = 1024.0,
    notices_max_mib: Annotated[
        float,
        typer.Option("--notices-max-mib", min=0.001, help="The watch notices' stream size (oldest dropped first)."),
    ] = 256.0,
    max_consumers: Annotated[
        int, typer.Option("--max-consumers", min=1, help="Consumers per stream, every node's and agent's.")
    ] = 1024,
    budget_msgs: Annotated[
        int, typer.Option("--budget-msgs", min=1, help="Messages one agent may send per minute (events, requests).")
    ] = 30_000,
    budget_mib: Annotated[
        float, typer.Option("--budget-mib", min=0.001, help="MiB one agent may send per minute.")
    ] = 64.0,
    agent_consumers: Annotated[
        int, typer.Option("--agent-consumers", min=1, max=64, help="Consumers one agent may hold open per stream.")
    ] = 8,
    failpoints: Annotated[
        bool,
        typer.Option("--failpoints", hidden=True, help="Honour failpoints armed in <home>/failpoints."),
    ] = False,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a node: an embedded nats-server (unless --nats), the journal observer, the outbox forwarder, the
    vector mirror with its recall service (unless --mirror off), any mesh coordinators (--coordinate) and the
    live dashboard (--ui-port).
    The embedded server listens on the same ports at every start (free ones at the first, or --port). A stream
    whose settings drifted from what epibus needs stops the start (--repair-streams restores it)."""
    if mirror not in ("edge", "server", "off"):
        raise ConfigError("--mirror", f"{mirror!r} is unknown", allowed=["edge", "server", "off"])
    from epibus.monitoring.metrics_http import MetricsSettings, check_host
    from epibus.node.node import NodeConfig

    check_host(MetricsSettings(metrics_port, metrics_host, metrics_remote))  # before anything starts
    pairs = [c.partition("=") for c in coordinate or []]
    if bad := [p for p, sep, policy in pairs if not (p and sep and policy)]:
        raise ConfigError("--coordinate", f"{bad[0]!r} must be PROJECT=POLICY, e.g. fleet=auto-accept:operational")
    config = NodeConfig(
        home=epibus_home(home),
        nats_url=nats,
        port=port,
        monitor_port=monitor_port,
        journal_url=journal,
        replicas=replicas,
        agent=agent or default_agent(),
        name=name,
        mirror=mirror,
        qdrant_url=qdrant_url,
        coordinate=tuple((project, policy) for project, _, policy in pairs),
        authenticate=authenticate,
        auto_enrol=auto_enrol,
        repair_streams=repair_streams,
        rebuild_journal=rebuild_journal,
        ui_port=ui_port,
        ui_host=ui_host,
        ui_remote=ui_remote,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        metrics_remote=metrics_remote,
        host=require_ipv4(host, "--host"),
        cluster=cluster_routes(cluster_port, routes, route_secret_file, host=host),
        limits=StreamLimits(
            events_max_bytes=int(events_max_gib * GIB),
            events_max_msgs=events_max_msgs,
            dlq_max_bytes=int(dlq_max_mib * MIB),
            dlq_max_age_s=dlq_max_age_days * 86400.0,
            max_consumers=max_consumers,
            vectors_max_bytes=int(vectors_max_mib * MIB),
            notices_max_bytes=int(notices_max_mib * MIB),
        ),
        agent_consumers=agent_consumers,
        budget=PublishBudget(msgs_per_window=budget_msgs, bytes_per_window=int(budget_mib * MIB)),
        failpoints=failpoints,
        fleet_port=fleet_port,
        join=join,
    )
    run(_up(config, as_json))


async def _up(config: NodeConfig, as_json: bool) -> None:
    from epibus.node.node import Node

    home = config.home
    running = read_node_info(home)
    if running is not None:
        raise ConfigError("up", f"a node is already running under {home} (pid {running.pid}, {running.nats_url})")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with Node(config) as node:
        node.freeze_heap()
        assert node.info is not None
        version = node.nc.connected_server_version if node.nc else None
        release = f"{version.major}.{version.minor}.{version.patch}" if version else None
        where = {
            "ok": True,
            "status": "running",
            "name": node.name,
            "home": str(home),
            "pid": node.info.pid,
            "nats_url": node.info.nats_url,
            "monitor_url": node.info.monitor_url,
            "metrics_url": node.info.metrics_url,
            "journal": node.journal.safe_url if node.journal else None,
            "outbox": node.info.outbox_path,
            "embedded_server": node.info.embedded_server,
            "mirror": f"{config.mirror} ({node.store.__class__.__name__})" if node.store else "off",
            "embedding_model": node.embedder.model_id if node.embedder else None,
            "server_version": release,
            "coordinating": [f"{c.project} ({c.policy.name})" for c in node.coordinators],
            # The one place the token is shown: opening this URL trades it for a cookie (docs/dashboard.md).
            "dashboard": node.dashboard.url_with_token if node.dashboard else None,
            "startup_s": node.startup,  # seconds per part of the start: server, journal, mirror, ...
        }
        if as_json:
            emit_json(where)
        else:
            rows = [[k, v] for k, v in where.items() if k not in ("ok", "dashboard", "startup_s")]
            console.print(table("epibus node", ["what", "where"], rows))
            if node.dashboard:  # on a line of its own: a wrapped token could not be copied
                console.print(shown("dashboard: ", (node.dashboard.url_with_token, "bold")), soft_wrap=True)
            console.print(shown("Ctrl-C stops the node."))
        if version is not None and (version.major, version.minor) < MIN_SERVER_VERSION[:2]:
            err_console.print(
                shown(
                    ("warning:", "yellow"),
                    f" nats-server {version} is older than 2.11; "
                    "per-artifact compare-and-set and other features need 2.11+",
                )
            )
        await stop.wait()
    if as_json:
        emit_json({"ok": True, "status": "stopped"})
    else:
        console.print(shown("epibus node stopped"))
