"""`epibus verify`: two jobs under one name. With an artifact it vouches for
that artifact (trust -> verified); without one it reconciles the stream with every node's journal and mirror."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bus.client.fleet import ask_verify
from bus.errors import ConfigError
from epibus.cli import inputs, state
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JournalOpt,
    JsonOpt,
    NatsOpt,
    Target,
    console,
    emit_json,
    handles_errors,
    run,
    table,
)


@handles_errors
def verify(
    artifact_id: Annotated[
        str | None,
        typer.Argument(help="Vouch for this artifact (id or unique prefix); leave out to reconcile the stores."),
    ] = None,
    project: Annotated[
        str | None,
        typer.Option("--project", "-p", help="Project (required with an artifact).", callback=inputs.project),
    ] = None,
    note: Annotated[str | None, typer.Option("--note", help="With an artifact: what was checked.")] = None,
    evidence: Annotated[
        list[str] | None, typer.Option("--evidence", help="With an artifact: KIND:REF, repeatable.")
    ] = None,
    repair: Annotated[bool, typer.Option("--repair", help="Without an artifact: make the stores agree.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Without an artifact: seconds.")] = 120.0,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """With ARTIFACT: vouch for another agent's artifact (trust -> verified; a verified one gains another
    record; the verifier is the signing --agent, of another owner than the author's). Without: reconcile the stream,
    every node's journal and every node's mirror by event id (missing, extra, stale payload; --repair fixes
    them; exit code 1 unless every store is clean)."""
    if artifact_id is None:
        if note or evidence:
            raise ConfigError("verify", "--note and --evidence go with an ARTIFACT to vouch for")
        _reconcile(project, repair=repair, timeout=timeout, nats=nats, agent=agent, home=home, as_json=as_json)
        return
    if project is None:
        raise ConfigError("--project", "is required to verify an artifact")
    if repair:
        raise ConfigError("verify", "--repair reconciles the stores; leave out the ARTIFACT to use it")
    state.verify(
        artifact_id,
        project,
        note=note,
        evidence=evidence,
        nats=nats,
        journal=journal,
        agent=agent,
        home=home,
        as_json=as_json,
    )


def _reconcile(
    project: str | None,
    *,
    repair: bool,
    timeout: float,
    nats: str | None,
    agent: str | None,
    home: Path | None,
    as_json: bool,
) -> None:
    """Reconcile the stream, every node's journal and every node's mirror by event id: missing, extra and
    stale-payload counts per store (repair fixes them). Exit code 1 unless every store is clean. Every
    project and repair are for admins (under a node's home the node's operator asks)."""

    async def ask() -> list[dict[str, Any]]:
        async with Target(nats, home, agent).asking() as (nc, signer):
            return await ask_verify(nc, signer, project, repair=repair, timeout_s=timeout)

    answers = run(ask())
    clean = all(bool(a.get("clean")) for a in answers)
    if as_json:
        emit_json({"ok": clean, "nodes": answers})
    else:
        rows = []
        for a in answers:
            if "error" in a:
                rows.append([a["node"], "-", "error", a["error"], "", ""])
                continue
            for store in ("journal", "mirror"):
                part = a.get(store)
                if isinstance(part, dict):
                    rows.append([a["node"], a["stream_events"], store, part["missing"], part["extra"], part["stale"]])
        console.print(
            table(
                "verify" + (" (after repair)" if repair else ""),
                ["node", "stream events", "store", "missing", "extra", "stale payload"],
                rows,
            )
        )
    if not clean:
        raise typer.Exit(1)
