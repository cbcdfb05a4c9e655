"""What health, the metrics and the dashboard read of a running node: the seam between them and `epibus.node.node`,
so they depend on what they read, not on the node that wires everything (and the node imports them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient
    from nats.js import JetStreamContext

    from bus.host.home import NodeInfo
    from bus.intake.runner import ConsumerRunner
    from bus.outbox.forwarder import Forwarder
    from bus.services.consumer_slots import ConsumerSlots
    from bus.services.responder import Responder
    from epibus.monitoring.status import MeshView
    from epibus.node.budget import BudgetWatch
    from epibus.node.config import NodeConfig
    from epibus.node.fleet import FleetLink
    from epibus.node.upkeep import Upkeep
    from observers.journal import Journal
    from observers.mirror.embed import CachedEmbedder
    from observers.mirror.service import MirrorServices
    from observers.mirror.store import VectorStore
    from observers.watch.pusher import WatchPusher
    from observers.watch.registry import WatchRegistry


class NodeView(Protocol):
    """A running node, read only. A part that is not started (or not configured) is None."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> NodeConfig: ...
    @property
    def info(self) -> NodeInfo | None: ...
    @property
    def nats_url(self) -> str: ...
    @property
    def nc(self) -> NatsClient | None: ...
    @property
    def js(self) -> JetStreamContext | None: ...
    @property
    def journal(self) -> Journal | None: ...
    @property
    def runner(self) -> ConsumerRunner | None: ...
    @property
    def mirror_runner(self) -> ConsumerRunner | None: ...
    @property
    def store(self) -> VectorStore | None: ...
    @property
    def embedder(self) -> CachedEmbedder | None: ...
    @property
    def watches(self) -> tuple[WatchRegistry, WatchPusher] | None: ...
    @property
    def mirror_services(self) -> MirrorServices | None: ...
    @property
    def forwarder(self) -> Forwarder | None: ...
    @property
    def services(self) -> dict[str, Responder[Any, Any]]: ...
    @property
    def consumer_slots(self) -> ConsumerSlots | None: ...
    @property
    def budget(self) -> BudgetWatch | None: ...
    @property
    def fleet_link(self) -> FleetLink | None: ...
    @property
    def mesh_view(self) -> MeshView | None: ...
    @property
    def stream_drift(self) -> str | None: ...
    @property
    def connection_restarts(self) -> int: ...
    @property
    def server_restarts(self) -> int: ...
    @property
    def upkeep(self) -> Upkeep | None: ...
