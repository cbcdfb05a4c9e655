"""The node's Prometheus endpoint: GET /metrics on the node's own event loop (uvicorn, in-process), bearer
token required. It listens on loopback unless told otherwise (and a non-loopback address must be asked for
explicitly); its port is chosen free at the first start and kept in `<home>/metrics.json`, like the nats-server's
ports, so a scrape configuration stays valid across restarts; its token is kept in `<home>/metrics.token`."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST

from bus.broker.loops import cancel_and_wait
from bus.errors import ConfigError, error_summary
from bus.host.home import owner_only, write_private
from epibus.monitoring.http_serving import EmbeddedServer, listen, netloc
from epibus.monitoring.metrics import NodeMetrics

if TYPE_CHECKING:
    from epibus.node.view import NodeView

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.json"
TOKEN_FILE = "metrics.token"
MIN_TOKEN_CHARS = 32
STOP_WITHIN_S = 5.0

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class MetricsSettings:
    port: int | None = None  # None: the port kept from an earlier start (a free one at the first); 0: off
    host: str = "127.0.0.1"
    remote: bool = False  # a non-loopback host must be asked for explicitly


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_host(settings: MetricsSettings) -> None:
    if not settings.remote and not is_loopback(settings.host):
        raise ConfigError(
            "--metrics-host",
            f"{settings.host!r} is not a loopback address; the endpoint shows every project's activity, so "
            "serving it beyond this machine must be asked for with --metrics-remote (the token is still required)",
        )


def metrics_token(home: Path) -> str:
    """The endpoint's bearer token: made once, owner-only; delete the file to rotate it."""
    path = home / TOKEN_FILE
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")
    owner_only(path)
    token = path.read_text().strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            "metrics token", f"{path} holds {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; delete it"
        )
    return token


def kept_port(home: Path) -> int | None:
    path = home / METRICS_FILE
    try:
        port = json.loads(path.read_text())["port"]
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError("metrics", f"{path} is unreadable ({e}); delete it, the next start picks a free port") from e
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError("metrics", f"{path} holds port {port!r}; delete it and the next start picks a free port")
    return port


class MetricsServer:
    """`await start()` listens and serves; `await stop()` closes the socket and waits for the server's task."""

    def __init__(self, node: NodeView, settings: MetricsSettings) -> None:
        self.node = node
        self.settings = settings
        self.metrics = NodeMetrics(node)
        self.token = metrics_token(node.config.home)
        self._expected = f"Bearer {self.token}".encode()
        self.url = ""
        self.port = 0
        self.scrapes = 0
        self.render_failures = 0
        self._socket: socket.socket | None = None
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        check_host(self.settings)
        home = self.node.config.home
        port = self.settings.port if self.settings.port is not None else kept_port(home)
        self._socket = listen(self.settings.host, port or 0, option="--metrics-port")
        self.port = int(self._socket.getsockname()[1])
        write_private(home / METRICS_FILE, json.dumps({"port": self.port}) + "\n")
        self.url = f"http://{netloc(self.settings.host, self.port)}/metrics"
        config = uvicorn.Config(
            self.app,
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,  # no proxy is trusted: a forwarded-for header changes nothing here
            server_header=False,
            limit_concurrency=32,  # past this many connections (a client holding them open), 503s, not memory
            timeout_graceful_shutdown=int(STOP_WITHIN_S) - 1,
            log_config=None,  # the node's logging stays as the node set it
            access_log=False,
            log_level="warning",
        )
        self._server = EmbeddedServer(config)
        # The socket already listens: a scrape that comes before the server runs waits in its backlog.
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="metrics endpoint")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            try:
                async with asyncio.timeout(STOP_WITHIN_S):
                    await asyncio.shield(self._task)
            except TimeoutError:
                log.warning("the metrics endpoint did not stop within %gs; cancelling it", STOP_WITHIN_S)
            await cancel_and_wait([self._task])
            self._task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _reply(send, 405, b"only GET /metrics is served\n")
        elif scope["path"] != "/metrics":
            await _reply(send, 404, b"not found: the metrics are at /metrics\n")
        elif not self._holds_token(scope):
            where = self.node.config.home / TOKEN_FILE
            body = f"missing or wrong bearer token: send `Authorization: Bearer <the token in {where}>`\n"
            await _reply(send, 401, body.encode(), [(b"www-authenticate", b"Bearer")])
        else:
            await self._scrape(send, head=scope["method"] == "HEAD")

    async def _scrape(self, send: Send, *, head: bool) -> None:
        try:
            body = await self.metrics.render()
        except Exception as e:  # noqa: BLE001 - a bug in one figure must not stop the endpoint: logged, counted, 500
            self.render_failures += 1
            log.error("metrics: rendering failed (%d so far): %s", self.render_failures, error_summary(e))
            await _reply(send, 500, f"rendering the metrics failed: {error_summary(e)}\n".encode())
            return
        self.scrapes += 1
        await _reply(send, 200, b"" if head else body, content_type=CONTENT_TYPE_LATEST.encode())

    def _holds_token(self, scope: Scope) -> bool:
        given = [value for name, value in scope.get("headers") or [] if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self._expected)


async def _reply(
    send: Send,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    start = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


async def start_metrics(node: NodeView, settings: MetricsSettings) -> MetricsServer | None:
    """The node's endpoint, serving; None when it is off (port 0)."""
    if settings.port == 0:
        return None
    server = MetricsServer(node, settings)
    await server.start()
    return server
