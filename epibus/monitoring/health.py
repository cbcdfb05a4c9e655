"""A node's health as the node itself sees it, kept in `<home>/health.json` (rewritten every few seconds) and
read by `epibus health` and `epibus stats`. A node whose NATS connection closed, whose observer stalled or is
waiting out a store outage, whose streams drifted from what epibus needs, or that stopped reporting, says so,
even while NATS itself still answers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.errors import ConfigError
from bus.host.disk import MIB, disk_space
from bus.host.home import NodeInfo, write_private
from epibus.node.supervise import service_failures

if TYPE_CHECKING:
    from epibus.node.view import NodeView
    from observers.mirror.edge import SealStats

log = logging.getLogger(__name__)
HEALTH_FILE = "health.json"
REPORT_EVERY_S = 2.0
# A report older than this means the node's event loop is stuck (or the node died without cleaning up).
STALE_AFTER_S = 20.0


def write_health(home: Path, snapshot: dict[str, Any]) -> None:
    """Atomic (a reader never sees half a report) and private to the node's user."""
    write_private(home / HEALTH_FILE, json.dumps(snapshot, default=_plain))


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return str(value)


def read_health(home: Path) -> dict[str, Any] | None:
    """The last report, or None when there is none. Raises ConfigError naming the file when it is unreadable."""
    path = home / HEALTH_FILE
    if not path.exists():
        return None
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("health", f"{path} is unreadable ({e}); it is rewritten by a running node") from e
    if not isinstance(report, dict):
        raise ConfigError("health", f"{path} holds no report; it is rewritten by a running node")
    return report


def problems(
    home: Path, info: NodeInfo | None, report: dict[str, Any] | None, *, now: datetime | None = None
) -> list[str]:
    """What is wrong with the local node, one line each; empty when it is healthy."""
    if info is None:
        return [f"no epibus node is running under {home}; start one with `epibus up`"]
    if report is None or report.get("pid") != info.pid:
        return [f"node {info.name or info.pid} has not reported its health yet; try again in a few seconds"]
    at = datetime.fromisoformat(str(report["at"]))
    age_s = ((now or datetime.now(UTC)) - at).total_seconds()
    if age_s > STALE_AFTER_S:
        space = disk_space(home)
        if space.full:  # the report itself could not be written
            return [
                f"node {report.get('name')} (pid {info.pid}) has not reported for {age_s:.0f}s: the disk under "
                f"{space.path} is full ({space.free_bytes // MIB} MiB free); free space there"
            ]
        return [f"node {report.get('name')} (pid {info.pid}) has not reported for {age_s:.0f}s: it may be hung"]
    found: list[str] = []
    nats = report.get("nats") or {}
    if not nats.get("connected"):
        found.append(f"the node's NATS connection is down ({nats.get('last_error') or 'no error recorded'})")
    for name, stats in sorted((report.get("observers") or {}).items()):
        if stats.get("stalled"):
            pending = stats.get("pending")
            # None: the server did not answer how far the consumer got (it may be frozen, or gone)
            waiting = "the server does not say what waits" if pending is None else f"{pending} messages wait"
            found.append(
                f"observer {name} stalled: {waiting} and nothing was acked for "
                f"{stats.get('stalled_for_s')}s (last error: {stats.get('last_error')})"
            )
        elif stats.get("degraded"):
            found.append(f"observer {name} degraded, holding events: {stats.get('last_error')}")
    found += storage_problems(report)
    refused = (report.get("fleet") or {}).get("refused")
    if refused:
        found.append(str(refused))
    drift = (report.get("streams") or {}).get("drift")
    if drift:
        found.append(f"{drift}; until then the node forwards nothing (its outbox keeps the events)")
    return found


def storage_problems(report: dict[str, Any]) -> list[str]:
    """A full disk and a damaged store, one line each, with what to do."""
    found: list[str] = []
    for role, space in sorted((report.get("disk") or {}).items()):
        if space.get("full"):
            found.append(
                f"disk full ({role}): {space['path']} has {space['free_bytes'] // MIB} MiB free, below the reserve "
                f"of {space['reserve_bytes'] // MIB} MiB: the node writes nothing there and refuses publishes; "
                "free space there and it resumes by itself"
            )
    for name, check in sorted((report.get("stores") or {}).items()):
        if check.get("state") == "damaged":
            found.append(f"{name} damaged: {check.get('problem')}; {check.get('remedy')}")
    return found


def node_health(node: NodeView) -> dict[str, Any]:
    """What the node reports about itself: its connection, each observer's runner, services and restarts."""
    nc = node.nc
    observers = {}
    for runner in (node.runner, node.mirror_runner):
        if runner is not None:
            observers[runner.observer.name] = runner.stats.as_dict()
    return {
        "name": node.name,
        "pid": os.getpid(),
        "at": datetime.now(UTC).isoformat(),
        "nats": {
            "url": node.nats_url if nc is not None else None,
            "connected": bool(nc is not None and nc.is_connected),
            "closed": bool(nc is None or nc.is_closed),
            "last_error": str(nc.last_error) if nc is not None and nc.last_error else None,
            "connection_restarts": node.connection_restarts,
            "server_restarts": node.server_restarts,
        },
        "observers": observers,
        "streams": {"drift": node.stream_drift},
        "fleet": {"refused": node.fleet_link.problem if node.fleet_link and node.fleet_link.refused else None},
        "mirror": _mirror(node),
        "forwarder": asdict(node.forwarder.stats) if node.forwarder is not None else None,
        "services": {subject: asdict(responder.counts) for subject, responder in node.services.items()},
        "service_failures": dict(service_failures),
        "budgets": node.budget.report() if node.budget is not None else None,
        "consumer_slots": asdict(node.consumer_slots.counts) if node.consumer_slots is not None else None,
        **(node.upkeep.report() if node.upkeep is not None else {"disk": {}, "stores": {}}),
    }


def _mirror(node: NodeView) -> dict[str, Any]:
    """The mirror's backend, the embedding model it was built for and, on the edge backend, its shards by state
    and how their seals went (`epibus status` shows them)."""
    embedder = node.embedder
    shown: dict[str, Any] = {
        "backend": node.config.mirror,
        "model": embedder.model_id if embedder is not None else None,
        "dimension": embedder.dimension if embedder is not None else None,
    }
    found = sealing(node)
    if found is not None:
        states, seals = found
        shown["shards"] = states
        shown["seals"] = {"sealed": seals.sealed, "failures": seals.failures, "last_error": seals.last_error}
        shown["engine_restarts"] = getattr(node.store, "restarts", 0)
    return shown


def sealing(node: NodeView) -> tuple[dict[str, int], SealStats] | None:
    """The edge mirror's shards by state and how its seals went; None for another backend or no mirror. Read
    without importing the edge backend: the CLI imports this module, and qdrant-edge is not for every command."""
    store: Any = node.store
    seals = getattr(store, "seals", None)
    return None if seals is None else (store.shard_states(), seals)


async def report_health(node: NodeView) -> None:
    """Write the node's health every REPORT_EVERY_S, until cancelled. A report that cannot be written (a full
    disk) is logged once per run of failures and tried again: the loop goes on."""
    failing = False
    while True:
        try:
            write_health(node.config.home, node_health(node))
        except OSError as e:
            if not failing:
                log.warning("cannot write the health report under %s: %s", node.config.home, e)
            failing = True
        else:
            failing = False
        await asyncio.sleep(REPORT_EVERY_S)
