"""The `epibus` command line (typer + rich). Every command takes --json."""

from __future__ import annotations

import logging
import os

import typer

from epibus.cli import (
    agents,
    certs,
    commands,
    dlq,
    health,
    mesh,
    mesh_roster,
    mesh_views,
    recall,
    state,
    streams,
    verify,
)
from epibus.cli.display import SafeFormatter
from epibus.cli.publish import publish_app, register_publish_commands

app = typer.Typer(
    name="epibus",
    help="epibus: a distributed event bus with durable, queryable memory for fleets of AI agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register_publish_commands()
app.add_typer(publish_app, name="publish")
app.add_typer(dlq.dlq_app, name="dlq")
app.add_typer(agents.agent_app, name="agent")
app.add_typer(streams.streams_app, name="streams")
app.add_typer(mesh.mesh_app, name="mesh")  # its reading commands are in mesh_views, the roster's in mesh_roster
assert mesh_views.show is not None
assert mesh_roster.coordinators_add is not None
app.command()(commands.up)
app.command()(commands.tail)
app.command()(commands.events)
app.command("replay")(commands.replay_command)
app.command()(commands.stats)
app.command()(health.health)
app.command()(state.resolve)
for command in (verify.verify, state.contradict, state.rollback):
    app.command(help=f"{command.__doc__}\n\n{state.trust_help()}")(command)
app.command("artifacts")(state.artifacts_command)
app.command()(state.audit)
app.command("briefing")(state.briefing_command)
app.command("vocab-report")(state.vocab_report_command)
app.command("recall")(recall.recall_command)
app.command("audit-recall")(recall.audit_recall_command)
app.command("forget")(recall.forget_command)
app.command("reindex")(recall.reindex_command)
app.command()(certs.certs)


def main() -> None:
    handler = logging.StreamHandler()  # stderr; a logged remote text must not reach the terminal raw
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=os.environ.get("EPIBUS_LOG_LEVEL", "WARNING").upper(), handlers=[handler])
    app()
