"""An agent's NATS connection: opening one (`open_nats`: reconnecting forever, following a local node that moved,
authenticating with the agent's nkey, failing fast with Forbidden when the server refuses the key), and keeping
one (`Connection`: enrolling once when the server refuses an unknown key, staying connected across reconnects,
the JetStream context, and preparing the server, streams, key and enrolment, before the first send after each
(re)connect)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from bus.broker.loops import cancel_and_wait
from bus.broker.nats_errors import (
    CONNECT_ERRORS,
    CONNECT_OR_REFUSED,
    NATS_UNAVAILABLE,
    is_authorization_error,
    name_connection,
    remember_violation,
)
from bus.broker.streams import ensure_streams
from bus.enrolment.registry import AgentRegistry
from bus.errors import Forbidden, Unavailable
from bus.host.home import NodeFollower
from bus.host.tls import nats_tls_context
from bus.identity.confinement import confine
from bus.identity.signing import NODE_IDENTITY, AgentKey
from bus.model.auth import Enrolment

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
        if revoked:
            assert isinstance(enrolment, dict)
            raise Forbidden(
                self.key.agent_id,
                "connect to",
                ", ".join(self.servers),
                f"its enrolment was revoked at {enrolment['revoked_at']}; its past events stay valid, and only an "
                f"admin can enrol it again (`epibus agent add {self.key.agent_id} --key {self.key.public_key} …`)",
            )
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
        nc = await open_nats(
            self.servers,
            name=f"epibus:{self.key.agent_id}",
            timeout_s=self.connect_timeout_s,
            follow=self.follow,
            key=self.key,
            reconnected_cb=self._on_reconnected,
            disconnected_cb=self._on_disconnected,
            error_cb=self._on_error,
        )
        if requires_authentication(nc):  # the broker lets this agent read only through consumers a node opens
            confine(nc, self.key)
        return nc

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
        if self.nc is None:
            # Still connecting: open() raises what stops it (Forbidden, Unavailable naming the last error), and a
            # first use's refusal is expected (the agent is enrolled, then let in), so nothing is logged here.
            return
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


async def open_nats(
    servers: Sequence[str],
    *,
    name: str,
    timeout_s: float,
    follow: NodeFollower | None = None,
    key: AgentKey | None = None,
    **callbacks: Any,
) -> NatsClient:
    """A reconnecting NATS connection, or Unavailable (naming the last connection error) if none is made
    within timeout_s. Connection errors go to `error_cb` if given, never to nats-py's traceback logging.
    With `follow`, every failed attempt asks where the local node runs now and reconnects there if it moved.
    With `key`, the connection authenticates with that nkey and receives on its own inboxes only; a server that
    does not know the key raises Forbidden. TLS (CA, client certificate) comes from the environment: see
    `bus.host.tls.nats_tls_context`."""
    tls = nats_tls_context()
    nc = NatsClient()
    errors: list[BaseException] = []  # only the last: an outage of hours fails an attempt every second
    user_error_cb = callbacks.pop("error_cb", None)

    async def remember(error: Exception) -> None:
        errors[:] = [error]
        remember_violation(nc, error)
        moved = follow.moved() if follow is not None and not nc.is_closed else None
        if moved:
            log.warning("the local node now runs at %s; reconnecting there", ", ".join(moved))
            nc.set_server_pool(moved)  # the next reconnect attempt uses it
        if user_error_cb is not None:
            await user_error_cb(error)

    credentials = key.nats_credentials if key is not None else {}
    if key is not None:
        name_connection(nc, key.agent_id)
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=list(servers),
            name=name,
            connect_timeout=max(1, int(timeout_s)),
            reconnect_time_wait=1,
            max_reconnect_attempts=-1,  # keep trying; the outbox holds events meanwhile
            error_cb=remember,
            tls=tls,
            **credentials,
            **callbacks,
        )
    )
    try:
        async with asyncio.timeout(timeout_s):
            while not connecting.done():
                # A refused key is not an outage: stop at once instead of retrying until the timeout.
                await asyncio.wait({connecting}, timeout=0.05)
                if not nc.is_connected and errors and is_authorization_error(errors[-1]):
                    await cancel_and_wait([connecting])
                    raise errors[-1]
            await connecting
    except CONNECT_OR_REFUSED as e:
        with contextlib.suppress(*CONNECT_OR_REFUSED):  # closing a half-open client; nothing to lose
            await nc.close()
        last = errors[-1] if errors else e
        if is_authorization_error(last) or is_authorization_error(e):
            raise refused_connection(key, servers) from e
        if not isinstance(e, CONNECT_ERRORS):
            raise
        raise Unavailable(
            "nats", f"cannot connect to {', '.join(servers)}: {type(last).__name__} {last}; is the server running?"
        ) from e
    return nc


def refused_connection(key: AgentKey | None, servers: Sequence[str]) -> Forbidden:
    """The server refused this key: how an agent gets in (an admin enrols it), or a node (it joins by invite)."""
    who = key.agent_id if key is not None else "(no key)"
    where = ", ".join(servers)
    if key is not None and key.agent_id == NODE_IDENTITY:
        return Forbidden(
            "this node", "connect to", where,
            "another node's server admits a node only once it joined that node's fleet: an admin runs "
            "`epibus fleet invite NAME` on the fleet's hub, and this host runs `epibus up --join TOKEN`, with its "
            "own embedded server (no --nats); see docs/cluster.md",
        )  # fmt: skip
    return Forbidden(
        who,
        "connect to",
        where,
        "the server admits enrolled keys only and refused this one (never enrolled, or revoked: "
        "`epibus agent list` on the node tells); an admin enrols it: "
        f"epibus agent add {who} --key {key.public_key if key else 'PUBLIC_KEY'} --project P",
    )


def requires_authentication(nc: NatsClient) -> bool:
    """Whether the server this connection reached authenticates its clients (a node manages its streams then)."""
    return bool(nc._server_info.get("auth_required"))
