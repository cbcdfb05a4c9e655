"""A node's one NATS connection: opened with the node's key, its streams made sure of (again after a reconnect,
and checked for drift), and a close by the server told apart from the node's own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from bus.broker.loops import cancel_and_wait
from bus.broker.nats_errors import NATS_UNAVAILABLE
from bus.broker.streams import DRIFT_CHECK_EVERY_S, StreamLimits, ensure_streams
from bus.client.connection import open_nats
from bus.errors import StreamDrift, Unavailable
from bus.identity.signing import AgentKey

log = logging.getLogger(__name__)


async def settling(within_s: float, attempt: Callable[[], Awaitable[None]]) -> None:
    """Run `attempt`, again every second while it raises Unavailable, for up to within_s: a cluster elects
    its leaders while its servers come up (0: once)."""
    async for retry in AsyncRetrying(
        retry=retry_if_exception_type(Unavailable),
        stop=stop_after_delay(within_s),
        wait=wait_fixed(1.0),
        reraise=True,
    ):
        with retry:
            await attempt()


class NodeConnection:
    """The connection every service of the node shares. One object for the node's life: `open` makes a new
    connection at each (re)start of the services."""

    def __init__(self, *, replicas: int, limits: StreamLimits) -> None:
        self.replicas = replicas
        self.limits = limits
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.stream_drift: str | None = None  # the StreamDrift found at the last check, reported in health
        self.stopping = False  # the node closes its own connection: not a loss to recover from
        self._streams_ready = False
        self._streams_checked_at = 0.0
        self._lost = asyncio.Event()

    async def open(
        self, servers: list[str], *, name: str, key: AgentKey, stack: contextlib.AsyncExitStack, settle_s: float,
        repair: bool,
    ) -> NatsClient:  # fmt: skip
        """Connect (closed with `stack`) and make sure of the streams, waiting up to settle_s for a cluster."""
        nc = await open_nats(
            servers,
            name=name,
            timeout_s=10,
            key=key,
            reconnected_cb=self._on_reconnected,
            error_cb=self._on_error,
            closed_cb=self._on_closed,
        )
        self.nc, self.js = nc, nc.jetstream()
        stack.push_async_callback(self._close, nc)
        await settling(settle_s, lambda: self.ensure_streams(repair=repair))
        return nc

    def require_js(self) -> JetStreamContext:
        if self.js is None:
            raise Unavailable("nats", "the node is not connected")
        return self.js

    def jetstream_if_connected(self) -> JetStreamContext | None:
        return self.js if self.nc is not None and self.nc.is_connected else None

    def closed(self) -> bool:
        return self.nc is None or self.nc.is_closed

    async def ensure_streams(self, *, repair: bool = False) -> None:
        """Runs before every forwarder drain (at least once a second), so the streams come back within a
        second of a reconnect to a server that lost them, and the runner's consumer with them. It checks
        again every DRIFT_CHECK_EVERY_S: a stream changed behind the node's back stops the forwarding (the
        events wait in the outbox, the forwarder logs and counts it) and is a problem in the node's health."""
        now = asyncio.get_running_loop().time()
        if self._streams_ready and now - self._streams_checked_at < DRIFT_CHECK_EVERY_S:
            return
        try:
            await ensure_streams(self.require_js(), replicas=self.replicas, repair=repair, limits=self.limits)
        except StreamDrift as e:
            self.stream_drift = str(e)
            raise
        self.stream_drift = None
        self._streams_ready = True
        self._streams_checked_at = now

    async def wait_until_lost(self) -> None:
        """Until the server closes the connection for good. closed_cb sets the event; nats-py skips that
        callback when the server's -ERR arrives while the client is connecting, so the state is polled too."""
        while not self._closed_by_server():
            lost = asyncio.ensure_future(self._lost.wait())
            done, _ = await asyncio.wait({lost}, timeout=0.5)
            if not done:
                await cancel_and_wait([lost])
                continue
            break
        self._lost.clear()

    def _closed_by_server(self) -> bool:
        return self.nc is not None and self.nc.is_closed and not self.stopping

    async def _on_error(self, error: Exception) -> None:
        # One line, not nats-py's default traceback per reconnect attempt.
        log.warning("NATS: %s %s", type(error).__name__, error)

    async def _on_reconnected(self) -> None:
        self._streams_ready = False  # the server may be new or have lost its store

    async def _on_closed(self) -> None:
        """nats-py gives a connection up for good on some server errors (a protocol violation such as a
        message over the max payload); every service of the node shares it, so they are all restarted."""
        if not self.stopping:
            self._lost.set()

    async def _close(self, nc: NatsClient) -> None:
        try:
            await nc.close()
        except NATS_UNAVAILABLE as e:  # shutting down anyway: the server may be gone already
            log.warning("closing the NATS connection: %s %s", type(e).__name__, e)
