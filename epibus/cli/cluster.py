"""`epibus cluster up [SIZE]` runs a JetStream cluster of nodes on this machine; `epibus cluster info` says where
its nodes run (from `<home>/cluster/cluster.json`)."""

from __future__ import annotations

import signal
import threading
from typing import Annotated, Any

import typer

from bus.errors import ConfigError
from bus.host.home import epibus_home
from bus.host.processes import alive
from epibus.cli.common import HomeOpt, JsonOpt, console, emit_json, handles_errors, table
from epibus.cli.display import shown
from epibus.cluster.local import MAX_NODES, MIN_NODES, Supervisor, cluster_root, read_cluster

cluster_app = typer.Typer(help="A JetStream cluster of epibus nodes on this machine (streams at R3).")
NODE_COLUMNS = ("name", "nats_url", "monitor_url", "route", "pid", "restarts", "home")


@cluster_app.command("up")
@handles_errors
def cluster_up(
    size: Annotated[int, typer.Argument(help=f"How many nodes ({MIN_NODES} to {MAX_NODES}); kept.")] = 3,
    mirror: Annotated[str, typer.Option("--mirror", help="Each node's mirror: edge | off.")] = "edge",
    failpoints: Annotated[
        bool, typer.Option("--failpoints", help="Nodes honour the failpoints `epibus chaos --attach` arms.")
    ] = False,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run SIZE nodes on loopback, each with its own home under <home>/cluster, embedded nats-server (routes
    authenticated by a route secret), journal and mirror. Ports are kept for later starts, and so is the data.
    A node that exits is started again; Ctrl-C stops them all, and they never outlive this command."""
    if mirror not in ("edge", "off"):
        raise ConfigError("--mirror", f"{mirror!r} is unknown", allowed=["edge", "off"])
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    node_args = ("--failpoints",) if failpoints else ()
    with Supervisor(epibus_home(home), size, mirror=mirror, node_args=node_args) as cluster:
        info = read_cluster(cluster.home) or {}
        if as_json:
            emit_json({"ok": True, "status": "running", "cluster": info})
        else:
            _print(info)
            console.print(shown("Ctrl-C stops the cluster."))
        cluster.watch(stopping)
    if as_json:
        emit_json({"ok": True, "status": "stopped"})
    else:
        console.print(shown("epibus cluster stopped"))


@cluster_app.command("info")
@handles_errors
def cluster_info(home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Where the cluster's nodes run: name, NATS URL, ports, pid (none when stopped) and home."""
    where = epibus_home(home)
    info = read_cluster(where)
    if info is None:
        raise ConfigError("cluster", f"no cluster under {cluster_root(where)}; start one with `epibus cluster up`")
    for node in info["nodes"]:  # a supervisor killed with -9 could not say its nodes went with it
        if isinstance(node, dict) and isinstance(node.get("pid"), int) and not alive(node["pid"]):
            node["pid"] = None
    if as_json:
        emit_json({"ok": True, "cluster": info})
    else:
        _print(info)


def _print(info: dict[str, Any]) -> None:
    rows = [[node.get(c) for c in NODE_COLUMNS] for node in info.get("nodes", [])]
    console.print(table(f"epibus cluster (streams at R{info.get('replicas')})", list(NODE_COLUMNS), rows))
    console.print(shown(f"--nats {info.get('nats_urls')}"))
