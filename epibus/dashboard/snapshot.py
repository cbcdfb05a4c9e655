"""The dashboard's health snapshot of the node it runs in: the node's own health report (epibus/monitoring/health.py)
and what it names as problems, each observer's lag, the dead-letter and outbox depths, and the mesh's tasks and
open acknowledgements as the node's MeshView folds them, and the standing watches it matches claims against with
what matching them costs. A figure that cannot be had now is null, with the
reason among `problems`: a slow or broken part never hides the others."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bus.broker.nats_errors import NATS_OR_API_ERROR
from bus.errors import EpibusError
from bus.subjects import DLQ_STREAM
from epibus.monitoring.health import node_health, problems
from epibus.monitoring.status import MeshView
from mesh.protocol import awaits_acknowledgement
from mesh.task import TaskRecord

if TYPE_CHECKING:
    from epibus.node.view import NodeView
    from observers.watch.pusher import WatchPusher
    from observers.watch.registry import WatchRegistry

READ_TIMEOUT_S = 2.0
MESH_TASKS_SHOWN = 30
WATCHES_SHOWN = 30
ABOUT_CHARS = 300  # of each watch's words, on the page
STREAM_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *NATS_OR_API_ERROR)


async def node_snapshot(node: NodeView) -> dict[str, Any]:
    report = node_health(node)
    found = problems(node.config.home, node.info, report) if node.info is not None else []
    snapshot: dict[str, Any] = {
        "node": {"name": node.name, "pid": report["pid"], "at": report["at"], "nats": report["nats"]},
        "observers": {name: _observer(stats) for name, stats in report["observers"].items()},
        "forwarder": report["forwarder"],
        "service_failures": report["service_failures"],
        "budgets": report["budgets"],  # each agent's publish budget on this node's server (epibus/node/budget.py)
    }
    snapshot["dlq_depth"] = await _dlq_depth(node, found)
    snapshot["outbox"] = await _outbox(node, found)
    snapshot["mesh"] = mesh_figures(node.mesh_view, found)
    snapshot["watches"] = watch_figures(node.watches)
    snapshot["problems"] = found
    return snapshot


def _observer(stats: dict[str, Any]) -> dict[str, Any]:
    """What the page shows of a runner: its lag (messages waiting for it on the server) and its state."""
    state = "stalled" if stats.get("stalled") else "degraded" if stats.get("degraded") else "ok"
    return {
        "state": state,
        "lag": stats.get("pending"),
        "handled": stats.get("handled"),
        "last_stream_seq": stats.get("last_stream_seq"),
        "dead_lettered": sum((stats.get("dead_lettered") or {}).values()),
        "last_error": stats.get("last_error"),
    }


async def _dlq_depth(node: NodeView, found: list[str]) -> int | None:
    js = node.js
    if js is None or node.nc is None or not node.nc.is_connected:
        found.append("dead letters: the node is not connected to NATS")
        return None
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            info = await js.stream_info(DLQ_STREAM)
    except STREAM_ERRORS as e:
        found.append(f"dead letters: {DLQ_STREAM} did not answer ({type(e).__name__} {e})")
        return None
    return int(info.state.messages)


async def _outbox(node: NodeView, found: list[str]) -> dict[str, int] | None:
    if node.forwarder is None:
        return None
    outbox = node.forwarder.outbox
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            return {"depth": await outbox.depth(), "parked": len(await outbox.parked())}
    except (TimeoutError, sqlite3.Error, EpibusError) as e:
        found.append(f"outbox: not readable now ({type(e).__name__} {e})")
        return None


def mesh_figures(view: MeshView | None, found: list[str]) -> dict[str, Any] | None:
    """Tasks per project and state, the open acknowledgements (completed, not yet acknowledged by their
    proposer), and the most recently changed tasks."""
    if view is None:
        found.append("mesh: not followed by this node (it runs without its status snapshot)")
        return None
    if not view.caught_up:
        found.append("mesh: still reading the bucket")
    records = sorted(view.records.values(), key=lambda r: r.last_step.at, reverse=True)
    by_state: dict[str, dict[str, int]] = {}
    for record in records:
        counts = by_state.setdefault(record.proposal.project, {})
        counts[record.state.value] = counts.get(record.state.value, 0) + 1
    awaiting = [r for r in records if awaits_acknowledgement(r)]
    return {
        "tasks": len(records),
        "by_project": by_state,
        "pending_acks": len(awaiting),
        "latest": [_task(r) for r in records[:MESH_TASKS_SHOWN]],
        "quarantined": view.watcher.stats.quarantined,
    }


def _task(record: TaskRecord) -> dict[str, Any]:
    return {
        "project": record.proposal.project,
        "task_id": record.task_id,
        "title": record.proposal.title,
        "state": record.state.value,
        "proposer": record.proposal.proposer,
        "assignee": record.assignee,
        "awaits_ack": awaits_acknowledgement(record),
        "at": record.last_step.at.isoformat(),
    }


def watch_figures(watches: tuple[WatchRegistry, WatchPusher] | None) -> dict[str, Any] | None:
    """The watches this node holds (newest first), what became of the claims matched against them and what the
    matching costs per claim; None when the node runs no mirror (it matches nothing)."""
    if watches is None:
        return None
    registry, pusher = watches
    now = datetime.now(UTC)
    records = sorted(registry.book.records(), key=lambda r: r.created_at, reverse=True)
    stats = pusher.stats
    return {
        "held": len(records),
        "expired": sum(1 for r in records if r.expired(now)),
        "claims": stats.claims,
        "matches": stats.matched,
        "pushed": stats.pushed,
        "duplicates": stats.duplicates,
        "follow_ups": stats.follow_ups,
        "erased": stats.erased,
        "withheld": stats.withheld,
        "match_ms_per_claim": round(1000 * stats.match_s / stats.claims, 3) if stats.claims else None,
        "latest": [
            {
                "watch_id": r.watch_id,
                "agent": r.agent_id,
                "projects": r.projects,
                "about": r.about[:ABOUT_CHARS],
                "threshold": r.threshold,
                "audit": r.audit,
                "expires_at": r.expires_at.isoformat(),
                "expired": r.expired(now),
            }
            for r in records[:WATCHES_SHOWN]
        ],
    }
