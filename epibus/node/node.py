"""The node: the composition root. It wires a nats-server (embedded, or joined by URL), the journal and the
mirror with their observers, the outbox forwarder, the request services, the mesh service and recorder, the
health, status and metrics reports, and optionally coordinators and the dashboard. `epibus up` runs one."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.loops import cancel_and_wait
from bus.broker.presence import Presence
from bus.enrolment.service_rules import enrolled_rule
from bus.errors import ConfigError, StoreDamaged
from bus.host.disk import require_room
from bus.host.home import (
    NodeInfo,
    default_journal_url,
    node_name,
    outbox_path,
    private_dir,
    remove_node_info,
    write_node_info,
)
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey, node_key
from bus.intake.consumers import drop_durable
from bus.intake.cursor import FileCursor
from bus.intake.runner import ConsumerRunner
from bus.outbox.forwarder import Forwarder
from bus.outbox.outbox import Outbox
from bus.services.consumer_slots import ConsumerSlots
from bus.services.enrolments import Enrolments, starting_authorization
from bus.services.erase import erase_service
from bus.services.responder import Responder, Service, serve_services
from bus.services.tombstone_registry import TombstoneRegistry
from bus.subjects import (
    JOURNAL_LOOKUP,
    STREAM,
)
from epibus.dashboard import Dashboard
from epibus.fleet.hub import FleetHub
from epibus.monitoring.health import report_health
from epibus.monitoring.metrics_http import MetricsServer, MetricsSettings, start_metrics
from epibus.monitoring.status import MeshView, StatusWriter
from epibus.node.budget import BudgetWatch
from epibus.node.config import CLUSTER_START_S, NodeConfig, check_config, settle_s
from epibus.node.connection import NodeConnection, settling
from epibus.node.coordinating import start_coordinators
from epibus.node.embedded import start_server, system_key
from epibus.node.failpoints import observed
from epibus.node.fleet import FleetLink, FleetPlace, fleet_place, join_if_invited, serve_hub
from epibus.node.mirror import NodeMirror, open_mirror
from epibus.node.recovery import Recovery
from epibus.node.supervise import Loops, service_failures, supervised
from epibus.node.upkeep import Upkeep
from mesh import events as mesh_events
from mesh.coordinator import Coordinator
from mesh.recorder import MeshRecorder
from mesh.service import MeshService
from observers.journal import Journal, JournalObserver
from observers.journal_rebuild import START_REMEDY, rebuild_service, set_aside
from observers.mirror.embed import CachedEmbedder
from observers.mirror.fleet_vectors import FleetEmbedder
from observers.mirror.observer import MirrorObserver
from observers.mirror.reindex import Progress, ReindexCounts
from observers.mirror.service import MirrorServices
from observers.mirror.store import VectorStore
from observers.read_service import journal_read_service
from observers.residue import NodeFiles, forget_proof_service
from observers.verify import verify_service
from observers.watch.pusher import WatchPusher
from observers.watch.registry import WatchRegistry

__all__ = ["CLUSTER_START_S", "MESH_KINDS", "Node", "NodeConfig", "service_failures", "supervised"]

log = logging.getLogger(__name__)
# Importing mesh.events registered these kinds, so this node's observers admit the mesh's events.
MESH_KINDS = (mesh_events.TASK_KIND, mesh_events.COORDINATORS_KIND)


class Node:
    """`async with Node(config) as node:` runs everything until the block exits (or the task is cancelled)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.server: NatsServer | None = None
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.journal: Journal | None = None
        self.observer: JournalObserver | None = None
        self.runner: ConsumerRunner | None = None
        self.forwarder: Forwarder | None = None
        self.info: NodeInfo | None = None
        self.live_mirror: NodeMirror | None = None  # None: started with --mirror off (or not started yet)
        self.mirror_services: MirrorServices | None = None
        self.services: dict[str, Responder[Any, Any]] = {}  # request subject -> its responder (and counts)
        self.startup: dict[str, float] = {}  # seconds each part of the start took (`epibus up --json` shows them)
        self.coordinators: list[Coordinator] = []
        self.recorder: MeshRecorder | None = None
        self.mesh_service: MeshService | None = None
        self.fleet = FleetPlace(None, None)  # alone, a fleet's hub or a joined node (epibus/node/fleet.py)
        self.fleet_hub: FleetHub | None = None
        self.fleet_link: FleetLink | None = None  # a joined node's link to its hub
        self._system: NatsClient | None = None
        self.consumer_slots: ConsumerSlots | None = None  # opens agents' consumers (bus/services/consumer_slots.py)
        self.budget: BudgetWatch | None = None  # agents' publish budgets on the embedded server
        self.name = config.name or ""  # settled at start (node_name)
        self.key = AgentKey.generate("node")  # replaced at start by the key kept in home (node_key)
        self.enrolments: Enrolments | None = None
        self._froze_heap = False
        self.dashboard: Dashboard | None = None
        self.status: StatusWriter | None = None
        self.metrics: MetricsServer | None = None
        self.presence: Presence | None = None
        self._journal_set_aside = False
        self.upkeep: Upkeep | None = None  # free disk space and the stores' checks (epibus/node/upkeep.py)
        self.connection = NodeConnection(replicas=config.replicas, limits=config.limits)
        self.recovery = Recovery(self.connection, self._stop_services, self._start)
        self.loops = Loops()
        self._tasks = self.loops.tasks  # the running loops: the same list for the node's life
        self._stack = contextlib.AsyncExitStack()
        self._recovery: asyncio.Task[None] | None = None

    @property
    def authenticated(self) -> bool:
        """Whether this node runs its server with authentication (the embedded server, unless turned off)."""
        return self.config.nats_url is None and self.config.authenticate

    @property
    def mesh_view(self) -> MeshView | None:
        """The status snapshot's fold of the mesh (record=True), shared by the dashboard and the metrics."""
        return self.status.view if self.status is not None else None

    @property
    def nats_url(self) -> str:
        if self.config.nats_url:
            return self.config.nats_url
        assert self.server is not None
        return self.server.url

    # The mirror as it stands (a reindex swaps store, observer and runner); None without one.
    @property
    def store(self) -> VectorStore | None:
        return self.live_mirror.store if self.live_mirror else None

    @property
    def embedder(self) -> CachedEmbedder | None:
        return self.live_mirror.embedder if self.live_mirror else None

    @property
    def mirror(self) -> MirrorObserver | None:
        return self.live_mirror.observer if self.live_mirror else None

    @property
    def mirror_runner(self) -> ConsumerRunner | None:
        return self.live_mirror.runner if self.live_mirror else None

    @property
    def watches(self) -> tuple[WatchRegistry, WatchPusher] | None:
        return (self.live_mirror.watches, self.live_mirror.pusher) if self.live_mirror else None

    # What the node's health reports, kept by the parts that know it.
    @property
    def stream_drift(self) -> str | None:
        return self.connection.stream_drift

    @property
    def connection_restarts(self) -> int:
        return self.recovery.connection_restarts

    @property
    def server_restarts(self) -> int:
        return self.recovery.server_restarts

    async def __aenter__(self) -> Node:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        recover = self.recovery.recover_lost_connections()
        self._recovery = asyncio.create_task(recover, name="connection recovery")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _start(self) -> None:
        config, home = self.config, self.config.home
        check_config(config)
        if (was := private_dir(home)) is not None:
            log.info("%s was mode %04o and is now 0700: a fleet's memory is readable by its owner only", home, was)
        self.fleet = fleet_place(config)
        self.name = node_name(home, config.name or self.fleet.joining_as)
        self.key = node_key(home)
        require_room(home, "node")  # a node on a full disk says so in one line (qdrant-edge would die of SIGBUS)
        if config.nats_url is None:
            with self._timed("server"):  # nats-server up and ready: it reads its streams back first
                authorization = starting_authorization(home / "nats", self.key) if self.authenticated else None
                options = self.fleet.server_options(home, self.name, config.host, self.key)
                self.server = await start_server(config, self.name, authorization, self._stack, options)
                self.fleet = await join_if_invited(self.fleet, self.server, self.key, host=config.host)
        with self._timed("journal"):
            self.journal = Journal(config.journal_url or default_journal_url(home))
            self._stack.callback(self.journal.close)
            old_consumer = None
            if config.rebuild_journal and not self._journal_set_aside:  # once, not again at a recovery's restart
                _, old_consumer = await asyncio.to_thread(set_aside, self.journal)
                self._journal_set_aside = True
            try:
                await asyncio.to_thread(self.journal.migrate)
            except StoreDamaged as e:  # a running node could rebuild it; this one cannot start on it
                raise StoreDamaged(e.store, e.path, e.damage, START_REMEDY) from e
        servers = [u.strip() for u in self.nats_url.split(",") if u.strip()]
        with self._timed("connect"):
            self.nc = await self.connection.open(
                servers,
                name=f"epibus-node:{self.name}",
                key=self.key,
                stack=self._stack,
                settle_s=max(settle_s(config), self.fleet.settle_s),
                repair=config.repair_streams,
            )
            self.js = self.connection.require_js()
        with self._timed("authority"):
            enrolments = await self._start_authority(self.nc, self.js)
            self.fleet_hub = await serve_hub(
                self.fleet, home=home, nc=self.nc, js=self.js, name=self.name, key=self.key, host=config.host,
                enrolments=enrolments, system=self._system_connection,
            )  # fmt: skip
        await self._start_stores(self.nc, self.js, self.journal)
        with self._timed("services"):
            if old_consumer is not None:
                await drop_durable(self.js, STREAM, old_consumer)
            await self._serve_requests(self.nc, self.js, self.journal, enrolments)
        with self._timed("loops"):
            await self._start_loops(enrolments)
        with self._timed("extras"):
            await self._start_extras(servers)

    @contextlib.contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        """Add the seconds this part of the start takes to `startup` (a recovery's restart adds to it)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.startup[part] = round(self.startup.get(part, 0.0) + time.perf_counter() - started, 3)

    async def _start_authority(self, nc: NatsClient, js: JetStreamContext) -> Enrolments:
        """The enrolment services (keeping the server's authorization in step) and the mesh bucket's writer."""
        local_keys = self.config.home / "keys" if self.authenticated and self.config.auto_enrol else None
        server = self.server if self.authenticated else None
        enrolments = Enrolments(
            js, self.key, server, node_name=self.name, local_keys=local_keys, consumer_slots=self.config.agent_consumers
        )
        self.enrolments = enrolments
        await enrolments.start()
        self.services |= await enrolments.serve(nc)
        if self.authenticated:
            await enrolments.registry.close()
            await enrolments.apply()
        # The mesh bucket's only writer: agents ask it (epibus.mesh.*); it records this node's key as a node's.
        self.mesh_service = MeshService(js, self.key, node=self.name, replicas=self.config.replicas)
        self.services |= await self.mesh_service.serve(nc)
        return enrolments

    async def _start_stores(self, nc: NatsClient, js: JetStreamContext, journal: Journal) -> None:
        """The journal's observer and runner, the outbox and its forwarder, and the mirror (when on)."""
        config = self.config
        with self._timed("outbox"):
            self.observer = JournalObserver(journal, tombstones=TombstoneRegistry(js))
            fed = observed(self.observer, config.home, honour=config.failpoints)
            self.runner = ConsumerRunner(nc, fed, batch_size=config.batch_size)
            outbox = await Outbox(outbox_path(config.home)).open()
            self._stack.push_async_callback(outbox.close)
            connection = self.connection
            self.forwarder = Forwarder(outbox, connection.jetstream_if_connected, before_send=connection.ensure_streams)
        if config.mirror == "off":
            return
        with self._timed("mirror"):  # the model, the vector engine and its shards
            assert self.enrolments is not None  # started before the stores: the mirror asks it whose vectors to take
            self.live_mirror = await open_mirror(
                nc,
                js,
                journal,
                self._stack,
                kind=config.mirror,
                qdrant_url=config.qdrant_url,
                home=config.home,
                node=self.name,
                failpoints=config.failpoints,
                key=self.key,
                is_node_key=self.enrolments.registry.is_node_key,
                replicas=config.replicas,
                closed=self.connection.closed,
            )

    async def _serve_requests(
        self, nc: NatsClient, js: JetStreamContext, journal: Journal, enrolments: Enrolments
    ) -> None:
        """The request services, each stated beside what it serves; who may ask each is its rule."""
        assert self.observer is not None
        lookups = enrolments.guard.authorizer(enrolled_rule)
        self.services[JOURNAL_LOOKUP] = await self.observer.serve_lookups(nc, authorize=lookups)
        self.mirror_services = MirrorServices(
            self.live_mirror, journal, node=self.name, publish=nc.publish, after_reindex=self._check_stores
        )
        self.consumer_slots = ConsumerSlots(nc, js, slots=self.config.agent_consumers)
        requests: list[Service[Any]] = [
            forget_proof_service(lambda: node_files(self, journal), node=self.name),
            journal_read_service(journal, node=self.name),
            verify_service(js, journal, lambda: self.mirror, node=self.name),
            erase_service(js, enrolments.registry, node=self.name),
            rebuild_service(js, journal, lambda: self.observer, node=self.name, after=self._check_stores),
            self.consumer_slots.service(node=self.name),
            TombstoneRegistry(js).service(node=self.name),
            enrolments.view_service(),
            *self.mirror_services.services(),
            *(self.live_mirror.watches.services() if self.live_mirror is not None else []),
        ]
        self.services |= await serve_services(nc, requests, node=self.name, guard=enrolments.guard)

    async def _watch_budgets(self, server: NatsServer, enrolments: Enrolments) -> BudgetWatch:
        """Every agent's publish budget, counted by the embedded server, read as its system account's user."""
        system = await self._system_connection()
        return BudgetWatch(system, self.config.budget, agents=enrolments.agent_keys, apply=enrolments.suspend)

    async def _system_connection(self) -> NatsClient:
        """The node's one connection as its server's system-account user (budgets, the fleet's leaf links)."""
        if self._system is None:
            assert self.server is not None
            self._system = await nats.connect(
                self.server.url,
                name=f"epibus-system:{self.name}",
                max_reconnect_attempts=-1,
                **system_key(self.config).nats_credentials,
            )
            self._stack.push_async_callback(self._system.close)
        return self._system

    async def _start_loops(self, enrolments: Enrolments) -> None:
        """Every loop of the node, announced first; each runs supervised: one that fails is logged, counted and
        restarted, and never takes the task group (and with it every other service of the node) down."""
        assert self.runner is not None
        assert self.forwarder is not None
        assert self.journal is not None
        connection, home = self.connection, self.config.home
        # Announced once every service is subscribed; withdrawn when the node stops, before its services do.
        runner = self.runner
        self.presence = Presence(
            connection.require_js, self.key, self.name, lambda: self.services, lambda: runner.stats.pending
        )
        # The nodes bucket may have no leader yet when a peer has just made it: the same bounded wait.
        await settling(settle_s(self.config), self.presence.beat)
        self._stack.push_async_callback(self.presence.withdraw)
        loops = self.loops
        await loops.open(self._stack)
        loops.supervise("journal observer", self.runner.run)
        loops.supervise("journal progress", self.runner.watch_progress)
        loops.supervise("outbox forwarder", self.forwarder.run)
        loops.supervise("health report", lambda: report_health(self))
        # Below the disk's reserve no agent publishes events through this node; reads through it go on.
        hold = enrolments.hold_events if self.server is not None and self.authenticated else None
        self.upkeep = Upkeep(home, self.journal, server=self.server, mirror=self._mirror_store, hold_events=hold)
        loops.supervise("disk watch", self.upkeep.watch_disk)
        loops.supervise("store checks", self.upkeep.watch_stores)
        loops.supervise("authorization", enrolments.keep_in_step)
        loops.supervise("heartbeat", self.presence.run)
        if self.server is not None and self.fleet.leaf is not None:
            self.fleet_link = FleetLink(self.server, self.fleet.leaf)
            loops.supervise("fleet link", self.fleet_link.watch)
        if self.server is not None and self.authenticated:
            self.budget = await self._watch_budgets(self.server, enrolments)
            loops.supervise("publish budget", self.budget.run)
        if self.live_mirror is not None:
            self.live_mirror.start(loops)
        if self.server is not None:
            loops.start("server watch", self.recovery.watch_server(self.server))
        cursor = FileCursor(home / "mesh" / "recorder.cursor")
        self.recorder = MeshRecorder(connection.require_js, cursor=cursor, closed=connection.closed)
        loops.supervise("mesh recorder", self.recorder.run)
        if self.config.record:  # the statusline's snapshot, beside node.json
            connected = lambda: connection.jetstream_if_connected() is not None  # noqa: E731
            status = StatusWriter(
                home, self.name, connection.require_js, self.journal, connected=connected, closed=connection.closed
            )
            self.status = status
            # Two loops: the view follows the mesh, the writer writes what it shows.
            loops.supervise("status mesh view", status.view.watcher.run)
            loops.supervise("status snapshot", status.run)

    async def _check_stores(self) -> None:
        if self.upkeep is not None:
            await self.upkeep.check_stores()

    def _mirror_store(self) -> tuple[VectorStore, int] | None:
        store, embedder = self.store, self.embedder
        return (store, embedder.dimension) if store is not None and embedder is not None else None

    async def _start_extras(self, servers: list[str]) -> None:
        """Coordinators, the dashboard and the metrics endpoint when configured, then node.json."""
        config = self.config
        if config.coordinate:
            self.coordinators = await start_coordinators(
                servers, self._stack, home=config.home, agent=config.agent, coordinate=config.coordinate,
                replicas=config.replicas,
            )  # fmt: skip
            for service in self.coordinators:
                self.loops.supervise(f"coordinator {config.agent} of {service.project}", service.run)
        if config.ui_port is not None:
            # A restart of the node's services serves the dashboard where it was, so open pages reconnect.
            port = self.dashboard.port if self.dashboard is not None else config.ui_port
            dashboard = Dashboard(self, host=config.ui_host, port=port, allow_remote=config.ui_remote)
            self._stack.push_async_callback(dashboard.stop)  # first: a start that fails half-way frees the port
            await dashboard.start()
            self.dashboard = dashboard
            self.loops.supervise("dashboard feed", dashboard.feed.run)
        settings = MetricsSettings(config.metrics_port, config.metrics_host, config.metrics_remote)
        if (metrics := await start_metrics(self, settings)) is not None:
            self._stack.push_async_callback(metrics.stop)
        self.metrics = metrics
        if config.record:
            self.info = node_info(self)
            write_node_info(config.home, self.info)
            self._stack.callback(remove_node_info, config.home, os.getpid())

    async def reindex_mirror(self, progress: Progress | None = None) -> ReindexCounts:
        """Rebuild the mirror from the stream into a new collection while the old one keeps answering, swap
        it in, and continue with a new durable consumer right after the rebuilt part."""
        if self.live_mirror is None:
            raise ConfigError("reindex", "this node runs no mirror (started with --mirror off)")
        return await self.live_mirror.reindex(progress)

    async def _stop_services(self) -> None:
        self.connection.stopping = True
        try:
            await self.loops.stop()
            self.services = {}
            self.coordinators = []
            await self._stack.aclose()
        finally:
            self._stack = contextlib.AsyncExitStack()
            self.connection.stopping = False

    async def close(self) -> None:
        self.connection.stopping = True
        if self._recovery is not None:
            await cancel_and_wait([self._recovery])
        await self._stop_services()
        self.connection.stopping = True
        if self._froze_heap:
            gc.unfreeze()
            self._froze_heap = False

    def freeze_heap(self) -> None:
        """For a process that exists to run this node (`epibus up`): what the node built to start (modules,
        schemas, validators) lives as long as it does, and out of the collector's reach a full collection no
        longer walks it, nor pauses the event loop for 80-170 ms while the mirror indexes (the longest gap while
        5,000 events were indexed: 191 -> 53 ms). Garbage is collected first, so none is frozen; close() hands
        everything back to the collector."""
        gc.collect()
        gc.freeze()
        self._froze_heap = True

    async def run_forever(self) -> None:
        await asyncio.Event().wait()


def node_files(node: Node, journal: Journal) -> NodeFiles:
    """The node's stores as they stand, for a forget's proof."""
    return NodeFiles(
        node.config.home,
        journal,
        outbox=node.forwarder.outbox if node.forwarder else None,
        cache=node.embedder,
        shared=node.embedder.inner if node.embedder and isinstance(node.embedder.inner, FleetEmbedder) else None,
        store=node.store,
        notices=node.live_mirror.pusher if node.live_mirror else None,
        nats_store=node.server.store_dir if node.server else None,
        nats_url=node.nats_url,
    )


def node_info(node: Node) -> NodeInfo:
    """What node.json says, for the commands that look for this node."""
    assert node.journal is not None
    assert node.forwarder is not None
    return NodeInfo(
        pid=os.getpid(),
        nats_url=node.nats_url,
        monitor_url=node.server.monitor_url if node.server and node.server.monitoring else None,
        journal_url=node.journal.url,
        outbox_path=str(node.forwarder.outbox.path),
        embedded_server=node.server is not None,
        started_at=datetime.now(UTC).isoformat(),
        name=node.name,
        authenticated=node.authenticated,
        auto_enrol=node.authenticated and node.config.auto_enrol,
        ui_url=node.dashboard.url if node.dashboard is not None else None,
        metrics_url=node.metrics.url if node.metrics is not None else None,
    )
