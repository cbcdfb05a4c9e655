"""The dashboard served by a node: uvicorn on the node's own event loop, started and stopped with the node."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

import uvicorn

from bus.broker.loops import cancel_and_wait
from bus.errors import ConfigError, Unavailable
from bus.model.requests import RecallRequest
from bus.model.state import vouched_text
from epibus.dashboard.app import build_app
from epibus.dashboard.feed import Feed
from epibus.dashboard.security import TokenGate, allowed_hosts, check_bind_host, ui_token
from epibus.dashboard.snapshot import node_snapshot
from epibus.monitoring.http_serving import EmbeddedServer, listen, netloc
from observers.reads import review_policy
from observers.recall import recall

if TYPE_CHECKING:
    from epibus.node.view import NodeView

log = logging.getLogger(__name__)
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
RECALL_TIMEOUT_S = 15.0
MAX_CONNECTIONS = 64


class Dashboard:
    """`await start()`, then `url_with_token` is what the operator opens; `await stop()` closes the port."""

    def __init__(self, node: NodeView, *, host: str, port: int, allow_remote: bool = False) -> None:
        check_bind_host(host, allow_remote=allow_remote)
        self.node = node
        self.host = host
        self.port = port
        self.feed = Feed(lambda: node.journal, lambda: node_snapshot(node))
        self.gate: TokenGate | None = None
        self._token = ""
        self._server: EmbeddedServer | None = None
        self._serving: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{netloc(self.host, self.port)}/"

    @property
    def url_with_token(self) -> str:
        return f"{self.url}?token={self._token}"

    async def start(self) -> None:
        """Listen (a taken port is a ConfigError naming --ui-port) and serve. Raises Unavailable when uvicorn
        does not start within START_TIMEOUT_S."""
        self._token = ui_token(self.node.config.home)
        self._socket = listen(self.host, self.port, option="--ui-port")
        self.port = self._socket.getsockname()[1]
        self.gate = TokenGate(build_app(self.feed, self._recall), self._token, self._hosts())
        config = uvicorn.Config(
            self.gate,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            proxy_headers=False,  # nothing stands in front of it: no X-Forwarded-* is believed
            limit_concurrency=MAX_CONNECTIONS,  # beyond it, 503: a flood of connections cannot exhaust the node
            timeout_graceful_shutdown=1,
        )
        self._server = EmbeddedServer(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="dashboard")
        async with asyncio.timeout(START_TIMEOUT_S):
            while not self._server.started:
                if self._serving.done():
                    raise Unavailable("dashboard", f"uvicorn stopped at start on {self.url}: {self._serving!r}")
                await asyncio.sleep(0.02)
        log.info("dashboard serving on %s", self.url)

    def _hosts(self) -> frozenset[str]:
        return allowed_hosts(self.host, self.port)

    async def stop(self) -> None:
        """Ends every page's stream, stops uvicorn (cancelled after STOP_TIMEOUT_S) and closes the port."""
        self.feed.close()
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            done, _ = await asyncio.wait({self._serving}, timeout=STOP_TIMEOUT_S)
            if not done:
                log.warning("dashboard did not stop within %ss; cancelling it", STOP_TIMEOUT_S)
            await cancel_and_wait([self._serving])
        if self._socket is not None:
            self._socket.close()

    async def _recall(self, request: RecallRequest) -> list[dict[str, Any]]:
        """The node's recall, through the safe door: never contradicted, rolled back, retracted or mistyped."""
        store, embedder = self.node.store, self.node.embedder
        if store is None or embedder is None:
            raise ConfigError("recall", "this node runs no mirror (started with --mirror off); use a node with one")
        try:
            async with asyncio.timeout(RECALL_TIMEOUT_S):
                journal = self.node.journal
                policy = None if journal is None else await asyncio.to_thread(review_policy, journal, request.project)
                found = await recall(store, embedder, request.query, request.project, k=request.k, policy=policy)
        except TimeoutError as e:
            raise Unavailable("recall", f"no answer within {RECALL_TIMEOUT_S:g}s; the node is busy, try again") from e
        return [hit.as_dict() | {"vouched_text": vouched_text(hit.vouched)} for hit in found.hits]
