"""The node and stream commands: up, tail, events, replay, stats."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bus.admission import Admission, Rejected
from bus.errors import ConfigError, NotFound
from bus.follow import StreamFollower
from bus.home import default_agent, epibus_home, outbox_path, read_node_info, resolve_journal_url
from bus.outbox import Outbox
from bus.reader import replay, stream_figures
from bus.registry import AgentRegistry
from bus.routes import require_ipv4
from bus.server import MIN_SERVER_VERSION
from bus.subjects import DLQ_STREAM, STREAM, events_filter
from epibus.cli import ids, inputs
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    Target,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import shown
from epibus.cli.inputs import EventKindOpt, ProjectFilterOpt
from epibus.cluster import cluster_routes
from epibus.times import parse_time

# Loaded by the commands that use them, not at the top: the node (dashboard, metrics server, mirror), SQLAlchemy
# and the mesh store would otherwise cost every CLI start, `epibus --help` included.
if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

    from epibus.node import NodeConfig

# -- up ---------------------------------------------------------------------------------------------------


@handles_errors
def up(
    nats: NatsOpt = None,
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
    from epibus.metrics_http import MetricsSettings, check_host
    from epibus.node import NodeConfig

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
        ui_port=ui_port,
        ui_host=ui_host,
        ui_remote=ui_remote,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        metrics_remote=metrics_remote,
        host=require_ipv4(host, "--host"),
        cluster=cluster_routes(cluster_port, routes, route_secret_file, host=host),
        failpoints=failpoints,
    )
    run(_up(config, as_json))


async def _up(config: NodeConfig, as_json: bool) -> None:
    from epibus.node import Node

    home = config.home
    running = read_node_info(home)
    if running is not None:
        raise ConfigError("up", f"a node is already running under {home} (pid {running.pid}, {running.nats_url})")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with Node(config) as node:
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
        }
        if as_json:
            emit_json(where)
        else:
            rows = [[k, v] for k, v in where.items() if k not in ("ok", "dashboard")]
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


# -- tail -------------------------------------------------------------------------------------------------


@handles_errors
def tail(
    project: ProjectFilterOpt = None,
    kind: EventKindOpt = None,
    from_start: Annotated[bool, typer.Option("--from-start", help="Begin at the first event, not the next.")] = False,
    count: Annotated[
        int | None, typer.Option("--count", "-n", help="Stop after N events.", callback=inputs.at_least_one)
    ] = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Follow events live as they reach the stream (messages the nodes refuse are shown, marked, with the reason)."""
    run(_tail(project, kind, from_start, count, Target(nats, home, agent), as_json))


async def _tail_line(msg: Msg, admission: Admission, as_json: bool) -> None:
    """One line per message; what the nodes' admission refuses is shown with its reason, never as an event."""
    seq = msg.metadata.sequence.stream
    try:
        event = await admission.admit(msg.subject, msg.data, msg.metadata.timestamp, msg.headers)
    except Rejected as e:
        if as_json:
            emit_json({"stream_seq": seq, "subject": msg.subject, "rejected": e.reason.value, "error": e.error})
        else:
            console.print(shown(f"{seq:>7} ", (f"REJECTED {e.reason.value}", "red"), f" {msg.subject}: {e.error}"))
        return
    if as_json:
        emit_json({"stream_seq": seq, "subject": msg.subject, **event.model_dump(mode="json")})
        return
    console.print(
        shown(
            f"{seq:>7} {event.recorded_at:%H:%M:%S} ",
            (event.project, "cyan"),
            " ",
            (event.kind, "bold"),
            f" {event.artifact_id} ",
            (event.actor.agent_id, "green"),
            f" {event.body.content_text()[:100]}",  # one line: shown() turns newlines into spaces
        ),
        soft_wrap=True,
    )


async def _tail(
    project: str | None,
    kind: str | None,
    from_start: bool,
    count: int | None,
    target: Target,
    as_json: bool,
) -> None:
    nc = await target.connect()
    try:
        subject = events_filter(project, kind)
        # Rides out a node restart: resumes after the last event shown, so none is missed or shown twice.
        follower = StreamFollower(
            nc.jetstream(), STREAM, subject, start_seq=1 if from_start else None, closed=lambda: nc.is_closed
        )
        if not as_json:
            err_console.print(shown(f"following {subject} (Ctrl-C stops)"))
        seen = 0
        admission = Admission(AgentRegistry(nc.jetstream()))
        async with contextlib.aclosing(follower.messages()) as messages:
            async for msg in messages:
                await _tail_line(msg, admission, as_json)
                seen += 1
                if count is not None and seen >= count:
                    break
    finally:
        await nc.close()


# -- events -----------------------------------------------------------------------------------------------


@handles_errors
def events(
    project: ProjectFilterOpt = None,
    kind: EventKindOpt = None,
    actor: Annotated[str | None, typer.Option("--actor", help="Agent id.", callback=inputs.agent)] = None,
    artifact_id: Annotated[
        str | None, typer.Option("--artifact-id", help="Its id or a unique prefix of it (4+ hex characters).")
    ] = None,
    since: Annotated[str | None, typer.Option("--since", help="ISO time or age (30m, 2h, 7d).")] = None,
    until: Annotated[str | None, typer.Option("--until", help="ISO time or age (30m, 2h, 7d).")] = None,
    limit: Annotated[int, typer.Option("--limit", callback=inputs.limit(100_000))] = 50,
    oldest_first: Annotated[bool, typer.Option("--oldest-first")] = False,
    journal: JournalOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Query the journal."""
    from observers.journal import EventQuery, Journal

    query = EventQuery(
        project=project,
        kind=kind,
        actor=actor,
        artifact_id=ids.optional_artifact_id(
            artifact_id, field="--artifact-id", project=project, journal=journal, home=home
        ),
        since=parse_time(since, "--since"),
        until=parse_time(until, "--until"),
        limit=limit,
        newest_first=not oldest_first,
    )
    store = Journal(resolve_journal_url(journal, epibus_home(home)))
    try:
        store.migrate()
        rows = store.query(query)
    finally:
        store.close()
    if as_json:
        emit_json([row.as_dict() for row in rows])
        return
    console.print(
        table(
            f"{len(rows)} event(s)",
            ["seq", "recorded_at", "project", "kind", "artifact", "actor", "text"],
            [
                [
                    r.stream_seq,
                    f"{r.recorded_at:%Y-%m-%d %H:%M:%S}",
                    r.project,
                    r.kind,
                    r.artifact_id,
                    r.actor_id,
                    ("[forgotten]" if r.status == "forgotten" else r.event().body.content_text()[:80]),
                ]
                for r in rows
            ],
        )
    )


# -- replay -----------------------------------------------------------------------------------------------


@handles_errors
def replay_command(
    from_seq: Annotated[int, typer.Option("--from-seq", min=1, help="First stream sequence to replay.")] = 1,
    rebuild_state: Annotated[
        bool, typer.Option("--rebuild-state", help="Then recompute the state projection from the journal's events.")
    ] = False,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Rebuild the journal from the stream. Safe to repeat: rows already present are left as they are."""
    run(_replay(from_seq, rebuild_state, journal, Target(nats, home, agent), as_json))


async def _replay(from_seq: int, rebuild_state: bool, journal: str | None, target: Target, as_json: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from observers.journal import Journal, JournalObserver

    store = Journal(resolve_journal_url(journal, epibus_home(target.home)))
    nc = await target.connect()
    try:
        await asyncio.to_thread(store.migrate)
        observer = JournalObserver(store, name="replay")
        with Progress(
            TextColumn("replaying EPI"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=err_console,
            disable=as_json,
        ) as progress:
            task = progress.add_task("replay", total=None)

            def advance(seq: int, end: int) -> None:
                progress.update(task, completed=seq, total=end)

            report = await replay(nc.jetstream(), observer, start_seq=from_seq, progress=advance)
        rebuilt = await asyncio.to_thread(store.rebuild_projection) if rebuild_state else None
    finally:
        await nc.close()
        store.close()
    summary = {
        "ok": True,
        "read": report.read,
        "inserted": observer.inserted,
        "already_present": observer.already_present,
        "rejected": len(report.rejected),
        "last_seq": report.last_seq,
        "state_rebuilt_from_events": rebuilt,
        "journal": store.safe_url,
    }
    if as_json:
        emit_json(summary | {"rejected_details": report.rejected})
        return
    console.print(table("replay", ["what", "count"], [[k, v] for k, v in summary.items() if k != "ok"]))
    for seq, reason, error in report.rejected[:20]:
        console.print(shown(f"  rejected seq {seq}: {reason}: {error}"), soft_wrap=True)


# -- stats ------------------------------------------------------------------------------------------------


@handles_errors
def stats(nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Stream and consumer figures: messages, bytes, pending, redelivered, DLQ depth, outbox depth."""
    figures = run(_stats(Target(nats, home, agent)))
    if as_json:
        emit_json({"ok": True, **figures})
        return
    epi, dlq = figures["streams"].get(STREAM), figures["streams"].get(DLQ_STREAM)
    rows: list[list[Any]] = [
        ["server", figures["server_version"]],
        ["EPI messages", epi and epi["messages"]],
        ["EPI bytes", epi and epi["bytes"]],
        ["DLQ depth", dlq and dlq["messages"]],
        ["outbox depth", figures["outbox_depth"]],
        ["outbox parked", figures["outbox_parked"]],
        ["mesh pending acks", sum(figures["mesh_pending"].values())],
        ["mesh records quarantined", figures["mesh_quarantined"]],
    ]
    for project, n in sorted(figures["mesh_pending"].items()):
        rows.append([f"mesh pending in {project}", n])
    for name, c in (epi or {}).get("consumers", {}).items():
        rows.append(
            [
                f"consumer {name}",
                f"pending {c['pending']}, ack pending {c['ack_pending']}, redelivered {c['redelivered']}",
            ]
        )
    console.print(table("epibus stats", ["figure", "value"], rows))


async def _stats(target: Target) -> dict[str, Any]:
    home = epibus_home(target.home)
    nc = await target.connect()
    try:
        streams = await stream_figures(nc.jetstream())
        pending, quarantined = await _mesh_pending(nc.jetstream())
        v = nc.connected_server_version
        version = f"{v.major}.{v.minor}.{v.patch}"
    finally:
        await nc.close()
    depth, parked = 0, 0
    if outbox_path(home).exists():
        outbox = await Outbox(outbox_path(home)).open()
        try:
            depth, parked = await outbox.depth(), len(await outbox.parked())
        finally:
            await outbox.close()
    return {
        "server_version": version,
        "streams": streams,
        "outbox_depth": depth,
        "outbox_parked": parked,
        "mesh_pending": pending,
        "mesh_quarantined": quarantined,
    }


async def _mesh_pending(js: JetStreamContext) -> tuple[dict[str, int], int]:
    """Completed-but-unacknowledged mesh tasks per project (open handshakes), and how many task records
    could not be read (quarantined, left out)."""
    from mesh.protocol import awaits_acknowledgement
    from mesh.store import MeshStore

    store = MeshStore(js, create=False)
    try:
        entries = await store.tasks()
    except NotFound:
        return {}, 0
    pending = Counter(e.record.proposal.project for e in entries if awaits_acknowledgement(e.record))
    return dict(pending), store.quarantine.count
