"""`epibus status`: is a node running for this home, and how is it. Nothing in node.json or health.json is taken
on trust: the pid must be this home's `epibus up` (epibus/node/process.py), its health report fresh, and its
NATS server must answer now. (`epibus/monitoring/status.py` is something else: the snapshot the statusline reads.)"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR
from bus.client.connection import open_nats
from bus.errors import EpibusError
from bus.host.home import split_servers
from bus.outbox.outbox import Outbox
from epibus.monitoring.health import STALE_AFTER_S, problems, read_health
from epibus.node.process import NodeProcess, connect_key, find

START_HINT = "start one with `epibus up`"
PING_TIMEOUT_S = 5.0
# URLs a node may record in node.json; the ones it has are shown (newer nodes record more).
URL_FIELDS = ("nats_url", "monitor_url", "metrics_url", "ui_url")


async def node_status(home: Path) -> dict[str, Any]:
    """What `epibus status --json` prints. `running` is False when no live node of this home is found;
    `answering` is False when one runs but its report is stale or its server does not answer."""
    raw, node = find(home)
    if node is None:
        why = (
            f"no epibus node is running under {home}"
            if raw is None
            else f"no epibus node is running under {home} (node.json names pid {raw['pid']}, which is gone "
            "or is not this home's `epibus up`)"
        )
        return {"running": False, "home": str(home), "reason": why, "hint": START_HINT}
    report = read_health(home)
    nats = await ping(home, node.info.nats_url)
    found = problems(home, node.info, report)
    if not nats["reachable"]:
        found.append(f"its NATS server does not answer: {nats['error']}")
    return {
        "running": True,
        "answering": not found,
        "home": str(home),
        "name": node.info.name,
        "pid": node.info.pid,
        "server_pids": sorted(node.servers),
        "started_at": node.info.started_at,
        "uptime_s": round((datetime.now(UTC) - datetime.fromisoformat(node.info.started_at)).total_seconds()),
        "urls": {name.removesuffix("_url"): node.raw[name] for name in URL_FIELDS if node.raw.get(name)},
        "authenticated": node.info.authenticated,
        "auto_enrol": node.info.auto_enrol,
        "nats": nats,
        "observers": _observers(report, node),
        "mirror": (report or {}).get("mirror") if _fresh(report, node) else None,
        "outbox": await outbox_figures(Path(node.info.outbox_path)),
        "disk": (report or {}).get("disk") if _fresh(report, node) else None,
        "stores": (report or {}).get("stores") if _fresh(report, node) else None,
        "problems": found,
    }


def _fresh(report: dict[str, Any] | None, node: NodeProcess) -> bool:
    if report is None or report.get("pid") != node.info.pid:
        return False
    age_s = (datetime.now(UTC) - datetime.fromisoformat(str(report["at"]))).total_seconds()
    return age_s <= STALE_AFTER_S


def _observers(report: dict[str, Any] | None, node: NodeProcess) -> dict[str, dict[str, Any]] | None:
    """Each observer's lag as the node last reported it; None while it has reported nothing fresh."""
    if not _fresh(report, node):
        return None
    assert report is not None
    return {
        name: {
            "pending": stats.get("pending"),
            "stalled": bool(stats.get("stalled")),
            "degraded": bool(stats.get("degraded")),
            "handled": stats.get("handled"),
            "last_error": stats.get("last_error"),
        }
        for name, stats in sorted((report.get("observers") or {}).items())
    }


async def ping(home: Path, url: str) -> dict[str, Any]:
    """Connect to the node's server now (as the home's key) and time a round trip."""
    try:
        nc = await open_nats(split_servers(url), name="epibus-status", timeout_s=PING_TIMEOUT_S, key=connect_key(home))
    except EpibusError as e:
        return {"reachable": False, "error": str(e)}
    try:
        began = time.monotonic()
        async with asyncio.timeout(JS_TIMEOUT_S):
            await nc.flush()
        v = nc.connected_server_version
        return {
            "reachable": True,
            "rtt_ms": round((time.monotonic() - began) * 1000, 2),
            "server_version": f"{v.major}.{v.minor}.{v.patch}",
        }
    except NATS_OR_API_ERROR as e:
        return {"reachable": False, "error": f"no answer to a ping within {JS_TIMEOUT_S:g}s ({type(e).__name__})"}
    finally:
        await nc.close()


async def outbox_figures(path: Path) -> dict[str, Any]:
    """Events waiting in the node's outbox, and those parked (refused by the server, kept for a person)."""
    if not await asyncio.to_thread(path.exists):
        return {"depth": 0, "parked": 0}
    outbox = await Outbox(path).open()
    try:
        return {"depth": await outbox.depth(), "parked": len(await outbox.parked())}
    finally:
        await outbox.close()
