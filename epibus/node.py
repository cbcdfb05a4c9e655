"""The node: the composition root that wires a nats-server (embedded, or joined by URL), the journal observer,
its lookup service and the outbox forwarder together. `epibus up` runs one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from bus.client import EpibusClient
from bus.connection import open_nats
from bus.enrol import enrol_locally
from bus.errors import ConfigError, EpibusError, StreamDrift, Unavailable, error_summary
from bus.forwarder import Forwarder
from bus.home import (
    NodeInfo,
    default_journal_url,
    node_name,
    outbox_path,
    private_dir,
    remove_node_info,
    write_node_info,
)
from bus.loops import cancel_and_wait, run_together
from bus.nats_errors import NATS_OR_API_ERROR, NATS_UNAVAILABLE
from bus.outbox import Outbox
from bus.presence import Presence
from bus.requests import (
    EraseReply,
    EraseRequest,
    ForgetProofReply,
    ForgetProofRequest,
    IndexedReply,
    LookupRequest,
    RecallReply,
    RecallRequest,
    ReindexProgress,
    ReindexReply,
    ReindexRequest,
    VerifyReply,
    VerifyRequest,
)
from bus.responder import Handler, Req, Responder, serve
from bus.routes import ClusterRoutes
from bus.runner import ConsumerRunner, Observer
from bus.server import AUTHORIZATION_FILE, NatsServer
from bus.service_rules import (
    Rule,
    enrolled_rule,
    erase_rule,
    forget_proof_rule,
    recall_rule,
    reindex_rule,
    verify_rule,
)
from bus.signing import AgentKey, node_key
from bus.streams import DRIFT_CHECK_EVERY_S, ensure_streams
from bus.subjects import (
    ADMIN_QUEUE,
    FORGET_ERASE,
    JOURNAL_LOOKUP,
    MIRROR_LOOKUP,
    PROVE_FORGOTTEN,
    RECALL,
    REINDEX,
    STREAM,
    VERIFY,
)
from bus.tombstones import TombstoneRegistry
from epibus.dashboard import Dashboard
from epibus.dashboard.security import check_bind_host
from epibus.enrolment import Enrolments, initial_authorization
from epibus.erase import erase_forgotten
from epibus.failpoints import KilledMidBatch, UnavailableWhenArmed
from epibus.health import REPORT_EVERY_S, node_health, write_health
from epibus.metrics_http import MetricsServer, MetricsSettings, start_metrics
from epibus.status import MeshView, StatusWriter
from mesh import events as mesh_events
from mesh.agent import MeshAgent
from mesh.coordinator import Coordinator, parse_policy
from mesh.recorder import MeshRecorder
from mesh.service import MeshService
from mesh.watch import FileCursor
from observers.journal import Journal, JournalObserver
from observers.mirror.backends import open_store
from observers.mirror.embed import CachedEmbedder, FastEmbedder
from observers.mirror.lookup import indexed_events
from observers.mirror.observer import MirrorObserver
from observers.mirror.reindex import Progress, rebuild
from observers.mirror.store import VectorStore
from observers.recall import audit_recall, recall
from observers.residue import NodeFiles, prove_forgotten
from observers.verify import verify

log = logging.getLogger(__name__)
# Importing mesh.events registered these kinds, so this node's observers admit the mesh's events.
MESH_KINDS = (mesh_events.TASK_KIND, mesh_events.COORDINATORS_KIND)
CLUSTER_START_S = 120.0


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
    # Local clients enrol their agents with the node's key on first connect (see bus/client.py connect).
    auto_enrol: bool = True
    repair_streams: bool = False  # restore drifted streams at start instead of refusing to start
    # The live web dashboard (docs/dashboard.md): None serves none; 0 a free port, kept across service restarts.
    ui_port: int | None = None
    ui_host: str = "127.0.0.1"
    ui_remote: bool = False  # serve the dashboard on a non-loopback ui_host
    # The Prometheus endpoint (epibus/metrics_http.py): None, the port kept from an earlier start (a free one
    # at the first); 0, off. It binds metrics_host, which must be loopback unless metrics_remote.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_remote: bool = False
    cluster: ClusterRoutes | None = None  # the embedded server's routes to the other servers of a cluster
    failpoints: bool = False  # honour the failpoints `epibus chaos` arms under home/failpoints (epibus/failpoints.py)


# How often each supervised service failed since the process started (each failure is also logged).
service_failures: Counter[str] = Counter()


async def supervised(
    name: str, run: Callable[[], Awaitable[None]], *, restart_after_s: float = 5.0, max_backoff_s: float = 300.0
) -> None:
    """Run a service loop; if it fails, with an epibus error or a bug, log it loudly (where it was raised),
    count it in `service_failures` and start it again, so one service's failure never takes the node's other
    services (journal, forwarder, mirror) down with it. The wait doubles with each failure in a row, up to
    max_backoff_s; a run that lasted longer than that starts the count again. Cancellation is not caught."""
    loop = asyncio.get_running_loop()
    in_a_row = 0
    while True:
        started = loop.time()
        try:
            await run()
            return
        except EpibusError as e:
            failure = str(e)
        except Exception as e:  # noqa: BLE001 - a bug in one service must not stop the node: logged, counted, restarted
            failure = error_summary(e)
        in_a_row = 1 if loop.time() - started > max_backoff_s else in_a_row + 1
        delay_s = min(max_backoff_s, restart_after_s * 2 ** (in_a_row - 1))
        service_failures[name] += 1
        log.error("%s failed: %s; restarting in %gs", name, failure, delay_s)
        await asyncio.sleep(delay_s)


class Node:
    """`async with Node(config) as node:` runs everything until the block exits (or the task is cancelled)."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.server: NatsServer | None = None
        self.nc: NatsClient | None = None
        self.journal: Journal | None = None
        self.observer: JournalObserver | None = None
        self.runner: ConsumerRunner | None = None
        self.forwarder: Forwarder | None = None
        self.info: NodeInfo | None = None
        self.embedder: CachedEmbedder | None = None
        self.store: VectorStore | None = None
        self.mirror: MirrorObserver | None = None
        self.mirror_runner: ConsumerRunner | None = None
        self._mirror_task: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        self._reindexing = asyncio.Lock()
        self.services: dict[str, Responder[Any, Any]] = {}  # request subject -> its responder (and counts)
        self.js: JetStreamContext | None = None
        self._streams_ready = False
        self._streams_checked_at = 0.0
        self.stream_drift: str | None = None  # the StreamDrift found at the last check, reported in health
        self.server_restarts = 0
        self.coordinators: list[Coordinator] = []
        self.recorder: MeshRecorder | None = None
        self.mesh_service: MeshService | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[Any]] = []
        self.name = config.name or ""  # settled at start (node_name)
        self.connection_restarts = 0
        self._connection_lost = asyncio.Event()
        self._stopping = False  # the node closes its own connection: not a loss to recover from
        self._recovery: asyncio.Task[None] | None = None
        self.key = AgentKey.generate("node")  # replaced at start by the key kept in home (node_key)
        self.enrolments: Enrolments | None = None
        self.dashboard: Dashboard | None = None
        self.status: StatusWriter | None = None
        self.metrics: MetricsServer | None = None
        self.presence: Presence | None = None

    @property
    def authenticated(self) -> bool:
        """Whether this node runs its server with authentication (the embedded server, unless turned off)."""
        return self.config.nats_url is None and self.config.authenticate

    def _starting_authorization(self, store: Path) -> str | None:
        if not self.authenticated:
            return None
        kept = store / AUTHORIZATION_FILE
        # A restart starts with the enrolments it last applied, so agents reconnect at once.
        return kept.read_text() if kept.exists() else initial_authorization(self.key)

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

    async def __aenter__(self) -> Node:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        self._recovery = asyncio.create_task(self._recover_lost_connections(), name="connection recovery")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _start(self) -> None:
        home = self.config.home
        own_server = (self.config.port, self.config.monitor_port, self.config.cluster, self.config.host != "127.0.0.1")
        if self.config.nats_url is not None and any(own_server):
            raise ConfigError("--port", "only the embedded server has a host, ports and routes; drop them, or --nats")
        if self.config.ui_port is not None:  # a refused address stops the start before anything runs
            check_bind_host(self.config.ui_host, allow_remote=self.config.ui_remote)
        if (was := private_dir(home)) is not None:
            log.info("%s was mode %04o and is now 0700: a fleet's memory is readable by its owner only", home, was)
        self.name = node_name(home, self.config.name)
        self.key = node_key(home)
        if self.config.nats_url is None:
            self.server = NatsServer(
                home / "nats",
                host=self.config.host,
                port=self.config.port or -1,
                monitor_port=self.config.monitor_port or -1,
                keep_ports=True,  # clients following this node find it where it was before a restart
                authorization=self._starting_authorization(home / "nats"),
                server_name=self.name if self.config.cluster else "epibus",  # unique in a cluster, kept
                cluster=self.config.cluster,
            )
            self._stack.callback(self.server.stop)  # first: a start that fails half-way still frees the store
            # A cluster's server waits for a majority of its peers, which start at the same time.
            await asyncio.to_thread(self.server.start, CLUSTER_START_S if self.config.cluster else 20.0)
        self.journal = Journal(self.config.journal_url or default_journal_url(home))
        self._stack.callback(self.journal.close)
        await asyncio.to_thread(self.journal.migrate)
        servers = [u.strip() for u in self.nats_url.split(",") if u.strip()]
        self.nc = await open_nats(
            servers,
            name=f"epibus-node:{self.name}",
            timeout_s=10,
            key=self.key,
            reconnected_cb=self._on_reconnected,
            error_cb=self._on_nats_error,
            closed_cb=self._on_closed,
        )
        self._stack.push_async_callback(self._close_nats)
        self.js = self.nc.jetstream()
        # A cluster elects its leaders while its servers come up: retried (bounded) until they settle.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Unavailable),
            stop=stop_after_delay(CLUSTER_START_S if self.config.cluster else 0),
            wait=wait_fixed(1.0),
            reraise=True,
        ):
            with attempt:
                await self._ensure_streams(repair=self.config.repair_streams)
        local_keys = home / "keys" if self.authenticated and self.config.auto_enrol else None
        server = self.server if self.authenticated else None
        enrolments = Enrolments(self.js, self.key, server, node_name=self.name, local_keys=local_keys)
        self.enrolments = enrolments
        await enrolments.start()
        self.services |= await enrolments.serve(self.nc)
        if self.authenticated:
            await enrolments.registry.close()
            await enrolments.apply()
        # The mesh bucket's only writer: agents ask it (epibus.mesh.*); it records this node's key as a node's.
        self.mesh_service = MeshService(self.js, self.key, node=self.name, replicas=self.config.replicas)
        self.services |= await self.mesh_service.serve(self.nc)

        self.observer = JournalObserver(self.journal, tombstones=TombstoneRegistry(self.js))
        await self._serve(
            PROVE_FORGOTTEN, ForgetProofRequest, ForgetProofReply, self._prove_forgotten, forget_proof_rule
        )
        await self._serve(VERIFY, VerifyRequest, VerifyReply, self._verify, verify_rule)
        await self._serve(REINDEX, ReindexRequest, ReindexReply, self._answer_reindex, reindex_rule)
        await self._serve(FORGET_ERASE, EraseRequest, EraseReply, self._erase, erase_rule, queue=ADMIN_QUEUE)
        lookups = enrolments.guard.authorizer(enrolled_rule)
        self.services[JOURNAL_LOOKUP] = await self.observer.serve_lookups(self.nc, authorize=lookups)
        await self._serve(MIRROR_LOOKUP, LookupRequest, IndexedReply, self._answer_indexed, enrolled_rule)
        self.runner = ConsumerRunner(self.nc, self._observed(self.observer), batch_size=self.config.batch_size)
        outbox = await Outbox(outbox_path(home)).open()
        self._stack.push_async_callback(outbox.close)
        self.forwarder = Forwarder(outbox, self._jetstream_if_connected, before_send=self._ensure_streams)

        if self.config.mirror != "off":
            await self._start_mirror()

        # Announced once every service is subscribed; withdrawn when the node stops, before its services do.
        self.presence = Presence(self._require_js, self.key, self.name, lambda: self.services)
        # The nodes bucket may have no leader yet when a peer has just made it: the same bounded wait.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Unavailable),
            stop=stop_after_delay(CLUSTER_START_S if self.config.cluster else 0),
            wait=wait_fixed(1.0),
            reraise=True,
        ):
            with attempt:
                await self.presence.beat()
        self._stack.push_async_callback(self.presence.withdraw)
        group = await self._stack.enter_async_context(asyncio.TaskGroup())
        # Every loop runs supervised: one that fails is logged, counted and restarted, and never takes the
        # task group (and with it every other service of the node) down.
        self._tasks = [
            group.create_task(supervised("journal observer", self.runner.run), name="journal observer"),
            group.create_task(supervised("journal progress", self.runner.watch_progress), name="journal progress"),
            group.create_task(supervised("outbox forwarder", self.forwarder.run), name="outbox forwarder"),
            group.create_task(supervised("health report", self._report_health), name="health report"),
            group.create_task(supervised("authorization", enrolments.keep_in_step), name="authorization"),
            group.create_task(supervised("heartbeat", self.presence.run), name="heartbeat"),
        ]
        self._group = group
        if self.mirror_runner is not None:
            self._mirror_task = group.create_task(self._run_mirror(self.mirror_runner), name="mirror")
            self._tasks.append(self._mirror_task)
        if self.server is not None:
            self._tasks.append(group.create_task(self._watch_server(self.server), name="server watch"))
        self.recorder = MeshRecorder(
            self._require_js,
            cursor=FileCursor(home / "mesh" / "recorder.cursor"),
            closed=lambda: self.nc is None or self.nc.is_closed,
        )
        self._tasks.append(group.create_task(supervised("mesh recorder", self.recorder.run), name="mesh recorder"))
        if self.config.record:  # the statusline's snapshot, beside node.json
            self.status = status = StatusWriter(
                home,
                self.name,
                self._require_js,
                self.journal,
                connected=lambda: self._jetstream_if_connected() is not None,
                closed=lambda: self.nc is None or self.nc.is_closed,
            )
            # Two loops, each supervised (and so stopped for sure) like every other: the view follows the mesh,
            # the writer writes what it shows.
            self._tasks.append(
                group.create_task(supervised("status mesh view", status.view.watcher.run), name="status mesh view")
            )
            self._tasks.append(group.create_task(supervised("status snapshot", status.run), name="status snapshot"))
        if self.config.coordinate:
            await self._start_coordinators(group, servers)
        if self.config.ui_port is not None:
            await self._start_dashboard(group, self.config.ui_port)
        settings = MetricsSettings(self.config.metrics_port, self.config.metrics_host, self.config.metrics_remote)
        if (metrics := await start_metrics(self, settings)) is not None:
            self._stack.push_async_callback(metrics.stop)
        self.metrics = metrics
        if self.config.record:
            self.info = NodeInfo(
                pid=os.getpid(),
                nats_url=self.nats_url,
                monitor_url=self.server.monitor_url if self.server else None,
                journal_url=self.journal.url,
                outbox_path=str(outbox.path),
                embedded_server=self.server is not None,
                started_at=datetime.now(UTC).isoformat(),
                name=self.name,
                authenticated=self.authenticated,
                auto_enrol=self.authenticated and self.config.auto_enrol,
                ui_url=self.dashboard.url if self.dashboard is not None else None,
                metrics_url=metrics.url if metrics is not None else None,
            )
            write_node_info(home, self.info)
            self._stack.callback(remove_node_info, home, os.getpid())

    async def _start_coordinators(self, group: asyncio.TaskGroup, servers: list[str]) -> None:
        """Mesh coordinator services, deciding as the node's agent. A policy that does not exist or
        an agent that is not a coordinator of the project is a start-up error."""
        policies = [(project, parse_policy(spec)) for project, spec in self.config.coordinate]
        key = AgentKey.load_or_create(self.config.home, self.config.agent)
        home = self.config.home
        client = EpibusClient(
            servers, key, outbox=None, replicas=self.config.replicas, enrol=lambda: enrol_locally(servers, home, key)
        )
        await client.start()
        self._stack.push_async_callback(client.close)
        mesh = MeshAgent(client)
        for project, policy in policies:
            cursor = FileCursor(self.config.home / "mesh" / f"coordinator-{self.config.agent}-{project}.cursor")
            service = Coordinator(mesh, project, policy, cursor=cursor)
            await service.check()
            self.coordinators.append(service)
        for service in self.coordinators:
            name = f"coordinator {self.config.agent} of {service.project}"
            self._tasks.append(group.create_task(supervised(name, service.run), name=name))

    async def _start_dashboard(self, group: asyncio.TaskGroup, port: int) -> None:
        # A restart of the node's services serves the dashboard where it was, so open pages reconnect.
        port = self.dashboard.port if self.dashboard is not None else port
        dashboard = Dashboard(self, host=self.config.ui_host, port=port, allow_remote=self.config.ui_remote)
        self._stack.push_async_callback(dashboard.stop)  # first: a start that fails half-way still frees the port
        await dashboard.start()
        self.dashboard = dashboard
        self._tasks.append(group.create_task(supervised("dashboard feed", dashboard.feed.run), name="dashboard feed"))

    def _require_js(self) -> JetStreamContext:
        if self.js is None:
            raise Unavailable("nats", "the node is not connected")
        return self.js

    def _jetstream_if_connected(self) -> JetStreamContext | None:
        return self.js if self.nc is not None and self.nc.is_connected else None

    async def _start_mirror(self) -> None:
        """The embedding model loads now: a model that cannot load is a start-up error, not a silent outage."""
        assert self.nc is not None
        home = self.config.home
        model = await FastEmbedder(home).load()
        self._stack.callback(model.close)
        self.embedder = CachedEmbedder(model, home / "embed-cache.db")
        self._stack.callback(self.embedder.close)
        if self.config.mirror == "edge":
            location: str | Path = home / "mirror"
        elif self.config.qdrant_url:
            location = self.config.qdrant_url
        else:
            raise ConfigError("mirror", "'server' needs QDRANT_URL (or --qdrant-url)")
        self.store = await open_store(self.config.mirror, location, self.embedder.model_id, self.embedder.dimension)
        if self.config.failpoints:
            self.store = UnavailableWhenArmed(self.store, home)
        self._stack.push_async_callback(self._close_store)
        info = await self.store.describe()
        assert self.journal is not None
        self.mirror = MirrorObserver(
            self.store, self.embedder, name=f"mirror-{info.store_id[:8]}", journal=self.journal, node=self.name
        )
        self.mirror_runner = ConsumerRunner(self.nc, self._observed(self.mirror), batch_size=64)
        await self._serve(RECALL, RecallRequest, RecallReply, self._answer_recall, recall_rule)

    def _observed(self, observer: Observer) -> Observer:
        """What a runner feeds: the observer, wrapped by the observer-kill failpoint when the node honours them."""
        return KilledMidBatch(observer, self.config.home) if self.config.failpoints else observer

    async def _close_store(self) -> None:
        if self.store is not None:
            await self.store.close()

    async def _serve(
        self,
        subject: str,
        request_model: type[Req],
        reply_model: type[BaseModel],
        handle: Handler[Req],
        rule: Rule[Req],
        *,
        queue: str = "",
    ) -> None:
        """Answer a request subject through the one responder: every request gets a reply, counted per service;
        who may ask is the service's rule (bus/service_rules.py)."""
        assert self.nc is not None
        assert self.enrolments is not None
        authorize = self.enrolments.guard.authorizer(rule)
        self.services[subject] = await serve(
            self.nc, subject, request_model, reply_model, handle, node=self.name, authorize=authorize, queue=queue
        )

    async def _answer_reindex(self, request: ReindexRequest) -> dict[str, Any]:
        node = self.name

        async def progress(done: int, total: int) -> None:
            if request.progress and self.nc is not None:
                update = ReindexProgress(node=node, done=done, total=total)
                await self.nc.publish(request.progress, update.model_dump_json().encode())

        return await self.reindex_mirror(progress)

    async def reindex_mirror(self, progress: Progress | None = None) -> dict[str, Any]:
        """Rebuild the mirror from the stream into a new collection while the old one keeps answering, swap
        it in, and continue with a new durable consumer right after the rebuilt part."""
        if self.store is None or self.embedder is None or self.js is None or self.nc is None or self.journal is None:
            raise ConfigError("reindex", "this node runs no mirror (started with --mirror off)")
        async with self._reindexing:
            rebuilt = await rebuild(
                self.config.mirror,
                self.store,
                self.js,
                self.embedder,
                journal=self.journal,
                home=self.config.home,
                node=self.name,
                progress=progress,
            )
            old_name = self.mirror.name if self.mirror else None
            if self._mirror_task is not None:
                await cancel_and_wait([self._mirror_task])
            self.store = await rebuilt.swap()
            self.mirror = MirrorObserver(
                self.store, self.embedder, name=rebuilt.consumer_name, journal=self.journal, node=self.name
            )
            counted = self.mirror_runner.tally if self.mirror_runner else None  # the metrics keep counting on
            self.mirror_runner = ConsumerRunner(
                self.nc, self.mirror, batch_size=64, start_seq=rebuilt.last_seq + 1, tally=counted
            )
            assert self._group is not None
            self._mirror_task = self._group.create_task(self._run_mirror(self.mirror_runner), name="mirror")
            self._tasks.append(self._mirror_task)
            if old_name and old_name != rebuilt.consumer_name:
                try:
                    await self.js.delete_consumer(STREAM, old_name)
                except NATS_OR_API_ERROR as e:  # the old consumer only wastes server memory; say so
                    log.warning("old mirror consumer %s not deleted: %s", old_name, e)
            return {"points": rebuilt.points, "last_seq": rebuilt.last_seq, "rejected": rebuilt.rejected}

    async def _verify(self, request: VerifyRequest) -> dict[str, Any]:
        """Reconcile this node's journal and mirror against the stream (and repair, when asked)."""
        assert self.journal is not None
        assert self.js is not None
        report = await verify(self.js, self.journal, self.mirror, project=request.project, repair=request.repair)
        return report.as_dict()

    async def _erase(self, request: EraseRequest) -> dict[str, Any]:
        """Erase a forgotten artifact's messages from the stream (an admin asked; see epibus/erase.py)."""
        assert self.enrolments is not None
        return await erase_forgotten(self._require_js(), self.enrolments.registry, request)

    async def _prove_forgotten(self, request: ForgetProofRequest) -> dict[str, Any]:
        """Finish a forget on this node's files (when asked) and prove it: rows, points and bytes."""
        assert self.journal is not None
        files = NodeFiles(
            self.config.home,
            self.journal,
            outbox=self.forwarder.outbox if self.forwarder else None,
            cache=self.embedder,
            store=self.store,
            nats_store=self.server.store_dir if self.server else None,
            nats_url=self.nats_url,
        )
        return await prove_forgotten(files, request.model_dump())

    async def _answer_indexed(self, request: LookupRequest) -> dict[str, Any]:
        """Which of these events this node's mirror has indexed; a node without a mirror says so."""
        runner, store = self.mirror_runner, self.store
        if runner is None or store is None or self.journal is None:
            return {"mirror": False, "indexed": []}
        return {
            "mirror": True,
            "indexed": await indexed_events(store, self.journal, runner.acked_through, request.root),
        }

    async def _answer_recall(self, request: RecallRequest) -> dict[str, Any]:
        """Answer a recall request from this node's mirror."""
        assert self.store is not None
        assert self.embedder is not None
        if request.audit:
            result = await audit_recall(
                self.store, self.embedder, request.query, request.project, k=request.k, kinds=request.kinds
            )
        else:
            result = await recall(
                self.store,
                self.embedder,
                request.query,
                request.project,
                k=request.k,
                kinds=request.kinds,
                include_resolved=request.include_resolved,
                as_of=request.as_of,
                journal=self.journal,
            )
        return {"hits": [h.as_dict() for h in result.hits]}

    async def _watch_server(self, server: NatsServer) -> None:
        """The embedded server is ours: if it exits, say so once and start it again on the same ports
        (its file store keeps what was fsynced; clients reconnect to the same URL)."""
        while True:
            await asyncio.sleep(1.0)
            if server.running():
                continue
            self.server_restarts += 1
            log.error("embedded nats-server exited (%s); restarting it on %s", server.exit_code, server.url)
            try:
                await asyncio.to_thread(server.start)
            except (Unavailable, ConfigError) as e:  # ConfigError: another process took its port meanwhile
                log.error("embedded nats-server did not restart: %s; trying again", e)

    async def _on_nats_error(self, error: Exception) -> None:
        # One line, not nats-py's default traceback per reconnect attempt.
        log.warning("NATS: %s %s", type(error).__name__, error)

    async def _close_nats(self) -> None:
        assert self.nc is not None
        try:
            await self.nc.close()
        except NATS_UNAVAILABLE as e:  # shutting down anyway: the server may be gone already
            log.warning("closing the NATS connection: %s %s", type(e).__name__, e)

    async def _on_reconnected(self) -> None:
        self._streams_ready = False  # the server may be new or have lost its store

    async def _ensure_streams(self, *, repair: bool = False) -> None:
        """Runs before every forwarder drain (at least once a second), so the streams come back within a
        second of a reconnect to a server that lost them, and the runner's consumer with them. It checks
        again every DRIFT_CHECK_EVERY_S: a stream changed behind the node's back stops the forwarding (the
        events wait in the outbox, the forwarder logs and counts it) and is a problem in the node's health."""
        now = asyncio.get_running_loop().time()
        if self._streams_ready and now - self._streams_checked_at < DRIFT_CHECK_EVERY_S:
            return
        assert self.js is not None
        try:
            await ensure_streams(self.js, replicas=self.config.replicas, repair=repair)
        except StreamDrift as e:
            self.stream_drift = str(e)
            raise
        self.stream_drift = None
        self._streams_ready = True
        self._streams_checked_at = now

    async def _run_mirror(self, runner: ConsumerRunner) -> None:
        """The mirror's runner and its progress watch, replaced together when a reindex swaps the mirror."""
        await run_together(
            {
                "mirror observer": supervised("mirror observer", runner.run),
                "mirror progress": supervised("mirror progress", runner.watch_progress),
            }
        )

    async def _report_health(self) -> None:
        while True:
            write_health(self.config.home, node_health(self))
            await asyncio.sleep(REPORT_EVERY_S)

    async def _on_closed(self) -> None:
        """nats-py gives a connection up for good on some server errors (a protocol violation such as a
        message over the max payload); every service of the node shares it, so they are all restarted."""
        if not self._stopping:
            self._connection_lost.set()

    async def _recover_lost_connections(self) -> None:
        delay_s = 1.0
        while True:
            await self._wait_for_lost_connection()
            self.connection_restarts += 1
            reason = self.nc.last_error if self.nc is not None else None
            log.error("the node's NATS connection closed for good (%s); restarting its services", reason)
            while True:
                try:
                    await self._stop_services()
                    await self._start()
                    delay_s = 1.0
                    break
                except Exception as e:  # noqa: BLE001 - the node must come back: logged, retried with backoff
                    log.error("restarting the node's services failed: %s; retrying in %.0fs", error_summary(e), delay_s)
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, 30.0)

    async def _wait_for_lost_connection(self) -> None:
        """closed_cb sets the event; nats-py skips that callback when the server's -ERR arrives while the
        client is connecting, so the connection's state is polled as well."""
        while not self._closed_by_server():
            lost = asyncio.ensure_future(self._connection_lost.wait())
            done, _ = await asyncio.wait({lost}, timeout=0.5)
            if not done:
                await cancel_and_wait([lost])
                continue
            break
        self._connection_lost.clear()

    def _closed_by_server(self) -> bool:
        return self.nc is not None and self.nc.is_closed and not self._stopping

    async def _stop_services(self) -> None:
        self._stopping = True
        try:
            await cancel_and_wait(self._tasks)
            self._tasks = []
            self.services = {}
            self.coordinators = []
            await self._stack.aclose()
        finally:
            self._stack = contextlib.AsyncExitStack()
            self._stopping = False

    async def close(self) -> None:
        self._stopping = True
        if self._recovery is not None:
            await cancel_and_wait([self._recovery])
        await self._stop_services()
        self._stopping = True

    async def run_forever(self) -> None:
        await asyncio.Event().wait()
