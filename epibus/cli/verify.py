"""`epibus verify ARTIFACT` vouches for an artifact (trust -> verified); `epibus reconcile` compares the stream
with every node's journal and mirror by event id, and repairs them on request. Two jobs, two names."""

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
from epibus.cli.persons import PassphraseStdinOpt, PersonOpt, person_signer


@handles_errors
def verify(
    artifact_id: Annotated[str, typer.Argument(help="The artifact to vouch for (id or unique prefix).")],
    project: Annotated[str, typer.Option("--project", "-p", help="Its project.", callback=inputs.project)],
    note: Annotated[str | None, typer.Option("--note", help="What was checked.")] = None,
    evidence: Annotated[list[str] | None, typer.Option("--evidence", help="KIND:REF, repeatable.")] = None,
    nats: NatsOpt = None,
    journal: JournalOpt = None,
    agent: AgentOpt = None,
    person: PersonOpt = None,
    passphrase_stdin: PassphraseStdinOpt = False,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Vouch for another agent's artifact (trust -> verified; a verified one gains another record). The
    verifier is the signing --agent, or --person (a person's review: asks their passphrase), of another owner
    than the author's. To compare the stores, run `epibus reconcile`."""
    if passphrase_stdin and person is None:
        raise ConfigError("--passphrase-stdin", "unlocks a person's key: add --person NAME")
    signer = person_signer(home, person, from_stdin=passphrase_stdin) if person is not None else None
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
        signer=signer,
    )


@handles_errors
def reconcile(
    project: Annotated[
        str | None,
        typer.Option(
            "--project", "-p", help="Only this project [default: every project, for admins].", callback=inputs.project
        ),
    ] = None,
    repair: Annotated[bool, typer.Option("--repair", help="Make the stores agree with the stream.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Seconds to wait for every node.")] = 120.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile the stream, every node's journal and every node's mirror by event id: missing, extra and
    stale-payload counts per store (--repair fixes them). Exit code 1 unless every store is clean."""
    _reconcile(project, repair=repair, timeout=timeout, nats=nats, agent=agent, home=home, as_json=as_json)


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
                "reconcile" + (" (after repair)" if repair else ""),
                ["node", "stream events", "store", "missing", "extra", "stale payload"],
                rows,
            )
        )
    if not clean:
        raise typer.Exit(1)
