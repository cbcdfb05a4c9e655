"""Serving HTTP from a node or a tool process (the dashboard, the metrics endpoint, the MCP server over HTTP): the
listening socket, bound before the server starts so a taken port is one line naming the option and who holds it,
and a uvicorn server that leaves the process's signals to the process."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator

import uvicorn

from bus.errors import ConfigError
from bus.host.ports import port_holder

BACKLOG = 128


def netloc(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int, *, option: str) -> socket.socket:
    """A non-blocking listening socket on (host, port); port 0 picks a free one. Raises ConfigError naming
    `option` (the command-line option that chose the port): a taken port names the process that holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            holder = port_holder(port)
            raise ConfigError(
                option,
                f"{netloc(host, port)} is taken by {holder or 'another process'}; stop it, or choose another port",
            ) from e
        raise ConfigError(option, f"cannot listen on {netloc(host, port)} ({e.strerror}); choose another port") from e
    sock.setblocking(False)
    return sock


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside a process that owns its signals: SIGINT and SIGTERM stop the process (and this
    server with it), so the server never installs handlers for them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
