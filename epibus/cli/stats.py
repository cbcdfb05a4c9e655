"""`epibus stats`: the streams' figures, the dead letters by reason and the mesh's open tasks, from the server;
and what each store of the local home costs on disk, per event."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from bus.errors import NotFound
from bus.host.home import epibus_home, outbox_path, resolve_journal_url
from bus.intake.reader import stream_figures
from bus.outbox.outbox import Outbox
from bus.subjects import DLQ_STREAM, STREAM
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    Target,
    console,
    emit_json,
    handles_errors,
    run,
    table,
)
from epibus.monitoring.health import read_health
from epibus.ops.disk_use import store_sizes

# Loaded by the commands that use them, not at the top: the node (dashboard, metrics server, mirror), SQLAlchemy
# and the mesh store would otherwise cost every CLI start, `epibus --help` included.
if TYPE_CHECKING:
    from nats.js import JetStreamContext


@handles_errors
def stats(nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Stream and consumer figures: messages, bytes, pending, redelivered, DLQ depth, outbox depth; and each
    local store's bytes on disk (journal, mirror, nats, outbox, embedding cache, models) per event."""
    figures = run(_stats(Target(nats, home, agent)))
    if as_json:
        emit_json({"ok": True, **figures})
        return
    epi, dlq = figures["streams"].get(STREAM), figures["streams"].get(DLQ_STREAM)
    rows: list[list[Any]] = [
        ["server", figures["server_version"]],
        ["EPI messages", epi and epi["messages"]],
        ["EPI bytes", epi and epi["bytes"]],
        ["DLQ depth", dlq and dlq["messages"]],
        ["outbox depth", figures["outbox_depth"]],
        ["outbox parked", figures["outbox_parked"]],
        ["mesh pending acks", sum(figures["mesh_pending"].values())],
        ["mesh records quarantined", figures["mesh_quarantined"]],
    ]
    for project, n in sorted(figures["mesh_pending"].items()):
        rows.append([f"mesh pending in {project}", n])
    for name, c in (epi or {}).get("consumers", {}).items():
        rows.append(
            [
                f"consumer {name}",
                f"pending {c['pending']}, ack pending {c['ack_pending']}, redelivered {c['redelivered']}",
            ]
        )
    rows += _budget_rows(figures.get("budgets"))
    console.print(table("epibus stats", ["figure", "value"], rows))
    events = figures["disk_events"]
    console.print(
        table(
            f"disk of this home ({events:,} events)",
            ["store", "MiB", "bytes/event"],
            _disk_rows(figures["disk"], events),
        )
    )


def _disk_rows(disk: list[dict[str, Any]], events: int) -> list[list[str]]:
    rows = [
        [d["store"], _mib(d["bytes"]), "-" if d["bytes_per_event"] is None else f"{d['bytes_per_event']:,.0f}"]
        for d in disk
    ]
    total = sum(d["bytes"] for d in disk)
    rows.append(["total", _mib(total), f"{total / events:,.0f}" if events else "-"])
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _budget_rows(budgets: dict[str, Any] | None) -> list[list[Any]]:
    """The node's publish budget and each agent's use of it over the last window (from the node's health)."""
    if not budgets:
        return []
    window = f"{budgets['window_s']:g} s"
    rows: list[list[Any]] = [
        ["publish budget", f"{budgets['msgs_per_window']} msgs, {budgets['bytes_per_window']} bytes per {window}"]
    ]
    for agent, use in budgets["agents"].items():
        state = "SUSPENDED" if use["suspended"] else "ok"
        rows.append(
            [
                f"budget of {agent}",
                f"{use['msgs']} msgs, {use['bytes']} bytes; {state}; over {use['suspensions']} time(s)",
            ]
        )
    return rows


async def _stats(target: Target) -> dict[str, Any]:
    home = epibus_home(target.home)
    nc = await target.connect()
    try:
        streams = await stream_figures(nc.jetstream())
        pending, quarantined = await _mesh_pending(nc.jetstream())
        v = nc.connected_server_version
        version = f"{v.major}.{v.minor}.{v.patch}"
    finally:
        await nc.close()
    depth, parked = 0, 0
    if outbox_path(home).exists():
        outbox = await Outbox(outbox_path(home)).open()
        try:
            depth, parked = await outbox.depth(), len(await outbox.parked())
        finally:
            await outbox.close()
    events = int((streams.get(STREAM) or {}).get("messages") or 0)
    disk = store_sizes(home, resolve_journal_url(None, home))
    return {
        "disk": [{**vars(d), "bytes_per_event": d.per_event(events)} for d in disk],
        "disk_events": events,
        "server_version": version,
        "streams": streams,
        "outbox_depth": depth,
        "outbox_parked": parked,
        "mesh_pending": pending,
        "mesh_quarantined": quarantined,
        "budgets": (read_health(home) or {}).get("budgets"),  # the local node's, from its health report
    }


async def _mesh_pending(js: JetStreamContext) -> tuple[dict[str, int], int]:
    """Completed-but-unacknowledged mesh tasks per project (open handshakes), and how many task records
    could not be read (quarantined, left out)."""
    from mesh.protocol import awaits_acknowledgement
    from mesh.store import MeshStore

    store = MeshStore(js, create=False)
    try:
        entries = await store.tasks()
    except NotFound:
        return {}, 0
    pending = Counter(e.record.proposal.project for e in entries if awaits_acknowledgement(e.record))
    return dict(pending), store.quarantine.count
