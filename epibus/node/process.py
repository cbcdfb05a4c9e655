"""The `epibus up` process of a home, found from `<home>/node.json` without trusting it: the pid must run an
`epibus up` command line and have started before the file was written (a reused pid starts later), and its
embedded nats-server comes from the store's lock record. `epibus status` reads it; `epibus down` stops it."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bus.errors import ConfigError
from bus.host.home import NODE_FILE, NodeInfo, default_agent, remove_node_info
from bus.host.processes import alive, start_time
from bus.host.server_guard import StoreLock, servers_on, terminate
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key

# node.json is written once the node runs; its process started earlier. Slack for clock-tick rounding.
START_SLACK_S = 2.0
KILL_WAIT_S = 10.0
POLL_S = 0.05


@dataclass(frozen=True)
class NodeProcess:
    """A live `epibus up` of this home, its start time (clock ticks, to tell a reused pid) and its servers."""

    info: NodeInfo
    raw: dict[str, Any]
    started: int
    servers: dict[int, int | None] = field(default_factory=dict)  # nats-server pid -> its start time


def recorded(home: Path) -> dict[str, Any] | None:
    """node.json as written, whether or not its process still runs. Raises ConfigError when unreadable."""
    path = home / NODE_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("node", f"{path} is unreadable ({e}); delete it if no node is running") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("pid"), int):
        raise ConfigError("node", f"{path} names no process; delete it if no node is running")
    return raw


def node_info(raw: dict[str, Any]) -> NodeInfo:
    """The fields this epibus knows (a newer node may record more: they stay in `raw`)."""
    known = {name: raw[name] for name in NodeInfo.__dataclass_fields__ if name in raw}
    try:
        return NodeInfo(**known)
    except TypeError as e:
        raise ConfigError("node", f"node.json lacks a field ({e}); delete it if no node is running") from e


def find(home: Path) -> tuple[dict[str, Any] | None, NodeProcess | None]:
    """node.json (None when there is none) and the live node it names (None when the file is stale)."""
    raw = recorded(home)
    if raw is None:
        return None, None
    info = node_info(raw)
    started = start_time(info.pid)
    if started is None or not _is_epibus_up(info.pid) or not _started_by(started, info.started_at):
        return raw, None
    return raw, NodeProcess(info, raw, started, _servers(home, info.pid))


def _is_epibus_up(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    names = [Path(arg).name for arg in argv]
    return "up" in argv and any(name == "epibus" or name.startswith("epibus.") for name in names)


def _started_by(ticks: int, recorded_at: str) -> bool:
    """Whether a process that started `ticks` after boot started before node.json's `started_at`."""
    boot = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
    )
    started_s = boot + ticks / os.sysconf("SC_CLK_TCK")
    try:
        written_s = datetime.fromisoformat(recorded_at).timestamp()
    except (ValueError, TypeError):  # not a time: not a file a node wrote
        return False
    return started_s <= written_s + START_SLACK_S


def _servers(home: Path, pid: int) -> dict[int, int | None]:
    """The node's embedded nats-server: its lock record names it; a server running on the store without one
    (between two records) is found by its command line."""
    store = home / "nats"
    holder = StoreLock(store).holder()
    if holder is not None and holder.owner_pid == pid and holder.server_alive() and holder.server_pid is not None:
        return {holder.server_pid: holder.server_started}
    return {server: start_time(server) for server in servers_on(store)} if store.is_dir() else {}


def connect_key(home: Path) -> AgentKey | None:
    """Who a read-only command connects as, without making a key: the node's, else the default agent's."""
    if (home / NODE_KEY_FILE).exists():
        return node_key(home)
    agent = default_agent()
    if (home / "keys" / f"{agent}.nk").exists():
        return AgentKey.load_or_create(home, agent)
    return None


@dataclass(frozen=True)
class Stopped:
    pid: int
    servers: list[int]
    killed: bool  # did not stop within the timeout: SIGKILL
    seconds: float


def stop(home: Path, node: NodeProcess, timeout_s: float) -> Stopped:
    """SIGTERM, wait up to timeout_s for the node (a node stops its own server), SIGKILL after it; then make
    sure its server is gone and node.json removed (a killed node cleans up nothing)."""
    began = time.monotonic()
    pid = node.info.pid
    _signal(pid, node.started, signal.SIGTERM)
    killed = not _wait_gone(pid, node.started, timeout_s)
    if killed:
        _signal(pid, node.started, signal.SIGKILL)
        if not _wait_gone(pid, node.started, KILL_WAIT_S):
            raise ConfigError("down", f"process {pid} survived SIGKILL for {KILL_WAIT_S:g}s; stop it by hand")
    for server, started in node.servers.items():
        # The server has a parent-death signal; one left running (by a stopped process) is stopped here.
        if not _wait_gone(server, started, KILL_WAIT_S if killed else timeout_s):
            terminate(server)
    remove_node_info(home, pid)
    return Stopped(pid, sorted(node.servers), killed, round(time.monotonic() - began, 2))


def _signal(pid: int, started: int, signum: int) -> None:
    if not alive(pid, started):
        return
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return
    except PermissionError as e:
        raise ConfigError("down", f"cannot signal process {pid} ({e}); stop it as the user who started it") from e


def _wait_gone(pid: int, started: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid, started):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True
