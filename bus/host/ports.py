"""The embedded nats-server's ports: chosen once, kept in `<store>/ports.json` so every later start of the node
listens where its clients already connect, and checked free before a start (naming who holds one that is not)."""

from __future__ import annotations

import errno
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

from bus.errors import ConfigError
from bus.host.home import write_private

PORTS_FILE = "ports.json"
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


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


def port_holder(port: int) -> str | None:
    """'pid N (name)' of the process listening on a TCP port, read from /proc; None when it cannot be seen
    (another user's process, or not Linux)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and any(target[8:-1] in inodes for target in _socket_fds(entry)):
            try:
                return f"pid {entry.name} ({(entry / 'comm').read_text().strip()})"
            except (FileNotFoundError, ProcessLookupError):
                return f"pid {entry.name}"  # it exited just now
    return None


def _socket_fds(process: Path) -> list[str]:
    """The `socket:[inode]` targets of a process's open files. An fd closed while it is read is skipped on its
    own: a busy process (the node itself, reconnecting) closes fds all the time, and skipping the whole process
    on one of them would hide the very holder being looked for."""
    found: list[str] = []
    try:
        fds = list((process / "fd").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return found  # gone meanwhile, or not ours to look at
    for fd in fds:
        try:
            target = os.readlink(fd)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # closed between the listing and the read
        if target.startswith("socket:["):
            found.append(target)
    return found


def _listening_inodes(port: int) -> set[str]:
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(inode)
    return found


def raise_for_taken_port(role: str, host: str, port: int, option: str) -> NoReturn:
    """The one-line error for a port another process holds: which port, who holds it, how to fix it."""
    holder = port_holder(port)
    by = f"by {holder}" if holder else "by another process"
    raise ConfigError(
        option,
        f"the nats-server {role} port {host}:{port} is taken {by}; stop that process, or start the node on "
        f"another port with `epibus up {option} N` (it is remembered)",
    )
