"""`epibus verify`: two jobs under one name. With an artifact it vouches for
that artifact (trust -> verified); without one it reconciles the stream with every node's journal and mirror."""

from __future__ import annotations

from typing import Annotated

import typer

from bus.errors import ConfigError
from epibus.cli import inputs, recall, state
from epibus.cli.common import AgentOpt, HomeOpt, JournalOpt, JsonOpt, NatsOpt, handles_errors


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
        recall.verify_command(
            project=project, repair=repair, timeout=timeout, nats=nats, agent=agent, home=home, as_json=as_json
        )
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
