"""One agent's NATS connection: connecting (enrolling once when the server refuses an unknown key), staying
connected across reconnects, the JetStream context, and preparing the server (streams, the key registered,
this agent's enrolment read) before the first send after each (re)connect."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from bus.auth import Enrolment
from bus.errors import Forbidden, Unavailable
from bus.home import NodeFollower
from bus.jetstream import NATS_UNAVAILABLE, ensure_streams, open_nats, requires_authentication
from bus.registry import AgentRegistry
from bus.signing import AgentKey

log = logging.getLogger(__name__)
ENROLLED_CONNECT_S = 10.0  # how long a just-enrolled agent is refused by a cluster node that has not applied it yet


class Connection:
    """The connection of the agent whose key is `key`. `nc` is None until connected; `on_ready` is called
    when a connection is (re)made, so whoever waits to send can go on."""

    def __init__(
        self,
        servers: Sequence[str],
        key: AgentKey,
        *,
        follow: NodeFollower | None,
        enrol: Callable[[], Awaitable[object]] | None,
        connect_timeout_s: float,
        publish_timeout_s: float,
        replicas: int | None,
    ) -> None:
        self.servers = list(servers)
        self.key = key
        self.follow = follow  # the servers came from node.json: find the node again if it moves
        # Called once when the server refuses this agent's key (not enrolled yet), then connecting is retried.
        self.enrol = enrol
        self.connect_timeout_s = connect_timeout_s
        self.publish_timeout_s = publish_timeout_s  # a publish's, and the JetStream context's
        self.replicas = replicas
        self.on_ready: Callable[[], None] = lambda: None  # set by whoever waits to send (the delivery)
        self.nc: NatsClient | None = None
        self.enrolment: Enrolment | None = None  # this agent's, once connected: its projects and roles
        self.closing = False
        self._js: JetStreamContext | None = None
        self._registry: AgentRegistry | None = None
        self._streams_ready = False

    async def open(self) -> NatsClient:
        """Connect; a server that refuses this agent's key has it enrolled first (once), then is asked again
        while a cluster node catches up with the enrolment. Raises Unavailable, Forbidden."""
        try:
            self.nc = await self._open_nats()
            return self.nc
        except Forbidden:
            if self.enrol is None:
                raise
            enrolment = await self.enrol()
            self.enrol = None
        revoked = isinstance(enrolment, dict) and enrolment.get("revoked_at") is not None
        # Another node of a cluster may have answered the enrolment: this server lets the agent in once its own
        # keeper has applied the replicated registry (every few seconds). A revoked agent is refused at once.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Forbidden),
            stop=stop_after_delay(0 if revoked else ENROLLED_CONNECT_S),
            wait=wait_fixed(0.25),
            reraise=True,
        ):
            with attempt:
                self.nc = await self._open_nats()
                return self.nc
        raise AssertionError("unreachable: tenacity re-raises the last Forbidden")

    async def _open_nats(self) -> NatsClient:
        return await open_nats(
            self.servers,
            name=f"epibus:{self.key.agent_id}",
            timeout_s=self.connect_timeout_s,
            follow=self.follow,
            key=self.key,
            reconnected_cb=self._on_reconnected,
            disconnected_cb=self._on_disconnected,
            error_cb=self._on_error,
        )

    async def keep_opening(self) -> None:
        """Connect in the background, however long NATS stays unreachable (cancel to stop)."""
        while self.nc is None:
            try:
                await self.open()
            except Unavailable as e:
                log.info("still offline: %s", e)
                continue
            self.on_ready()

    async def _on_reconnected(self) -> None:
        self._streams_ready = False  # the server may be new or may have lost its store
        self.on_ready()

    async def _on_disconnected(self) -> None:
        if self.closing:
            return
        log.warning("disconnected from NATS; publishing continues into the outbox")

    async def _on_error(self, error: Exception) -> None:
        log.warning("NATS connection error: %s %s", type(error).__name__, error)

    async def close(self) -> None:
        self.closing = True
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.close()
            except NATS_UNAVAILABLE as e:  # the connection was already failing; unsent rows stay in the outbox
                log.info("closing a failing NATS connection: %s %s", type(e).__name__, e)

    @property
    def closed(self) -> bool:
        return self.closing or (self.nc is not None and self.nc.is_closed)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def js(self) -> JetStreamContext:
        """One context per connection: each context owns the reply subscription of its async publishes."""
        if self.nc is None:
            where = ", ".join(self.servers) or "a node: none was running, so this client only outboxes"
            raise Unavailable("nats", f"not connected to {where}")
        if self._js is None:
            self._js = self.nc.jetstream(timeout=self.publish_timeout_s)
        return self._js

    def js_if_connected(self) -> JetStreamContext | None:
        return self.js if self.connected else None

    def nc_if_connected(self) -> NatsClient | None:
        return self.nc if self.connected else None

    def require_nc(self) -> NatsClient:
        if self.nc is None or not self.connected:
            raise Unavailable("nats", f"not connected to {', '.join(self.servers)}")
        return self.nc

    @property
    def registry(self) -> AgentRegistry:
        """The agent-key registry, made on first use."""
        self._registry = self._registry or AgentRegistry(self.js)
        return self._registry

    async def prepare(self) -> None:
        """Streams exist and this agent's key is registered; re-run after every reconnect."""
        if self._streams_ready:
            return
        if not requires_authentication(self.require_nc()):  # with authentication the node keeps the streams
            await ensure_streams(self.js, replicas=self.replicas)
        await self.registry.bind(self.key.actor)
        self.enrolment = await self.registry.get(self.key.agent_id)
        self._streams_ready = True
