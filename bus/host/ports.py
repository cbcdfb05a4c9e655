"""The embedded nats-server's ports: chosen once, kept in `<store>/ports.json` so every later start of the node
listens where its clients already connect, and checked free before a start (naming who holds one that is not)."""

from __future__ import annotations

import errno
import json
import random
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

from bus.errors import ConfigError
from bus.host.home import write_private

PORTS_FILE = "ports.json"
LOWEST_CHOSEN_PORT = 10000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@dataclass(frozen=True)
class ServerPorts:
    client: int
    monitor: int


def read_ports(store_dir: Path) -> ServerPorts | None:
    """The ports kept for this store directory, or None before its first start. Raises ConfigError naming the
    file when it is unreadable."""
    path = store_dir / PORTS_FILE
    try:
        return ServerPorts(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, TypeError) as e:
        raise ConfigError("ports", f"{path} is unreadable ({e}); delete it and the next start picks free ports") from e


def keep_ports(store_dir: Path, ports: ServerPorts) -> None:
    """Record the ports (mode 0600, replaced atomically: a reader never sees half a file)."""
    write_private(store_dir / PORTS_FILE, json.dumps(asdict(ports)) + "\n")


def port_taken(host: str, port: int) -> bool:
    """True when something listens on (host, port). SO_REUSEADDR as nats-server sets it: a port that only
    lingers in TIME_WAIT after a stop is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise ConfigError("port", f"cannot bind {host}:{port} ({e}); choose another port") from e
    return False


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports nothing listens on, for servers whose ports must be known before they start (a cluster's
    routes). Chosen below the kernel's ephemeral range: a port from bind(0) lies inside it, where any outgoing
    connection of a busy machine may take it before the server listens. Raises ConfigError if none is free."""
    low, high = LOWEST_CHOSEN_PORT, _ephemeral_low() - 1
    if high - low < 16 * n:  # a kernel that lends out nearly every port: take what bind(0) gives
        return _bound_ports(n, host)
    chosen: list[int] = []
    for port in random.sample(range(low, high + 1), min(high - low + 1, 64 * n)):
        if not port_taken(host, port):
            chosen.append(port)
            if len(chosen) == n:
                return chosen
    raise ConfigError("port", f"no {n} free ports on {host} between {low} and {high}; stop idle servers")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def _bound_ports(n: int, host: str) -> list[int]:
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:  # all bound at once, so none repeats
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_holder(port: int) -> str | None:
    """'pid N (name)' of the process listening on a TCP port (psutil); None when it cannot be seen (another
    user's process)."""
    import psutil  # only when a port is taken: the command line starts without it

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
            except psutil.NoSuchProcess:
                return f"pid {conn.pid}"  # it exited just now
    return None


def raise_for_taken_port(role: str, host: str, port: int, option: str) -> NoReturn:
    """The one-line error for a port another process holds: which port, who holds it, how to fix it."""
    holder = port_holder(port)
    by = f"by {holder}" if holder else "by another process"
    raise ConfigError(
        option,
        f"the nats-server {role} port {host}:{port} is taken {by}; stop that process, or start the node on "
        f"another port with `epibus up {option} N` (it is remembered)",
    )
