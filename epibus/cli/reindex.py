"""`epibus reindex`: every node rebuilds its mirror from the stream into a new collection and swaps it in."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from bus.client.fleet import ask_reindex
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    Target,
    console,
    emit_json,
    err_console,
    handles_errors,
    run,
    table,
)
from epibus.cli.display import plain


@handles_errors
def reindex_command(
    timeout: Annotated[float, typer.Option("--timeout", min=1.0)] = 1800.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Rebuild every node's mirror from the stream into a new collection and swap it in (after a model
    change, or to start clean); the old mirror keeps answering until the swap. For admins (under a node's
    home the node's operator asks)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn  # only this command's bar

    with Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console,
        disable=as_json,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def advance(node: str, done: int, total: int) -> None:
            if node not in tasks:
                tasks[node] = bar.add_task(plain(f"reindexing on {node}"), total=total)
            bar.update(tasks[node], completed=done, total=total)

        async def ask() -> list[dict[str, Any]]:
            async with Target(nats, home, agent).asking() as (nc, signer):
                return await ask_reindex(nc, signer, advance, timeout_s=timeout)

        answers = run(ask())
    ok = all("error" not in a for a in answers)
    if as_json:
        emit_json({"ok": ok, "nodes": answers})
    else:
        console.print(
            table(
                "reindex",
                ["node", "points", "up to stream seq", "error"],
                [[a["node"], a.get("points"), a.get("last_seq"), a.get("error")] for a in answers],
            )
        )
    if not ok:
        raise typer.Exit(1)
