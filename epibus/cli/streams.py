"""`epibus streams repair`: put the streams and KV buckets back to the configuration epibus needs."""

from __future__ import annotations

from typing import Any

import typer

from bus.broker.drift import show
from bus.broker.streams import ensure_streams
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
from epibus.cli.display import shown

streams_app = typer.Typer(
    help="The JetStream streams and KV buckets epibus relies on, and their drift.", no_args_is_help=True
)


@streams_app.command("repair")
@handles_errors
def repair(nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Restore every managed setting of EPI, EPI_DLQ and the KV buckets' streams that differs from what
    epibus needs (a limit, the retention, the discard policy, ...), and show what was changed. Replicas stay as
    they are: a node applies its own --replicas."""
    rows = run(_repair(Target(nats, home, agent)))
    if as_json:
        emit_json({"ok": True, "repaired": rows})
        return
    if not rows:
        console.print(shown("no drift: every stream has the configuration epibus needs"))
        return
    columns = ["stream", "field", "was", "now"]
    shown_rows = [[r["stream"], r["field"], show(r["field"], r["was"]), show(r["field"], r["now"])] for r in rows]
    console.print(table(f"{len(rows)} setting(s) restored", columns, shown_rows))


async def _repair(target: Target) -> list[dict[str, Any]]:
    nc = await target.connect()
    try:
        changed = await ensure_streams(nc.jetstream(), repair=True)
    finally:
        await nc.close()
    return [
        {"stream": stream, "field": diff.field, "was": diff.current, "now": diff.wanted}
        for stream, diffs in changed.items()
        for diff in diffs
    ]
