"""The `epibus` command line's typer app (typer + rich). Every command takes --json. `epibus.cli.main` runs it,
except for the lean commands it dispatches before importing this module (`statusline`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Annotated

import typer
from typer.main import get_command_name
from typer.models import CommandInfo

from epibus.cli import (
    agents,
    backup,
    certs,
    chaos,
    cluster,
    dlq,
    events,
    fleet,
    forget,
    health,
    lineage,
    mcp,
    mesh,
    mesh_agents,
    mesh_roster,
    mesh_views,
    mirror_cmd,
    natsctx,
    ops,
    persons,
    policy,
    reads,
    recall,
    reindex,
    state,
    stats,
    streams,
    up,
    verify,
    watch,
)
from epibus.cli.display import SafeFormatter
from epibus.cli.group import EpibusGroup
from epibus.cli.publish import publish_app, register_publish_commands
from epibus.monitoring.statusline import STATUSLINE_HELP
from epibus.monitoring.statusline import main as statusline_main

app = typer.Typer(
    name="epibus",
    help="epibus: a distributed event bus with durable, queryable memory for fleets of AI agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion; `epibus completion SHELL` prints the script
    cls=EpibusGroup,  # one error format for every command, usage errors included
)
register_publish_commands()
app.add_typer(publish_app, name="publish")
app.add_typer(dlq.dlq_app, name="dlq")
app.add_typer(agents.agent_app, name="agent")
app.add_typer(persons.person_app, name="person")
app.add_typer(policy.policy_app, name="policy")
app.add_typer(streams.streams_app, name="streams")
app.add_typer(cluster.cluster_app, name="cluster")
app.add_typer(mirror_cmd.mirror_app, name="mirror")
app.add_typer(fleet.fleet_app, name="fleet")
app.add_typer(watch.watch_app, name="watch")
# mesh commands: reading in mesh_views, the roster in mesh_roster, coordinate and advertise in mesh_agents
app.add_typer(mesh.mesh_app, name="mesh")
assert mesh_views.show is not None
assert mesh_agents.coordinate is not None
assert mesh_roster.coordinators_add is not None
app.command()(up.up)
app.command()(events.tail)
app.command()(events.events)
app.command("replay")(events.replay_command)
app.command()(stats.stats)
app.command()(health.health)
app.command()(state.resolve)
for command in (verify.verify, state.contradict, state.rollback):
    app.command(help=f"{command.__doc__}\n\n{state.trust_help()}")(command)
app.command()(verify.reconcile)
app.command("artifacts")(reads.artifacts_command)
app.command()(reads.audit)
app.command("lineage")(lineage.lineage_command)
app.command("briefing")(reads.briefing_command)
app.command("vocab-report")(reads.vocab_report_command)
app.command("recall")(recall.recall_command)
app.command("audit-recall")(recall.audit_recall_command)
app.command("forget")(forget.forget_command)
app.command("reindex")(reindex.reindex_command)
app.command()(certs.certs)
app.command("mcp")(mcp.mcp)
app.command()(ops.status)
app.command()(ops.doctor)
app.command()(ops.down)
app.command("chaos")(chaos.chaos)
app.command()(ops.version)
app.command()(ops.completion)
app.command("nats-context")(natsctx.nats_context)
app.command()(backup.backup)
app.command()(backup.restore)


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=ops.version_callback, is_eager=True, help="Print the epibus and nats-server versions."
        ),
    ] = False,
) -> None:
    """epibus: a distributed event bus with durable, queryable memory for fleets of AI agents."""


@app.command(
    "statusline",
    help=STATUSLINE_HELP,
    add_help_option=False,  # its own parser answers --help
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def statusline(ctx: typer.Context) -> None:
    # `epibus statusline` never gets here (epibus.cli.main runs it before typer loads); this entry lists it in
    # --help and serves callers of this app, with the same parser.
    raise typer.Exit(statusline_main(ctx.args))


def _name(command: CommandInfo) -> str | None:
    if command.name is not None:
        return command.name
    return get_command_name(command.callback.__name__) if command.callback is not None else None


@contextlib.contextmanager
def only_the_command_named(argv: list[str]) -> Iterator[None]:
    """Within it, the app holds only the top-level command or group the arguments name, when they name one
    exactly: typer builds the parameters of every registered command on each run (about 0.2 s for all of
    them), and a command needs only its own. Help, completion and a mistyped name keep the whole app."""
    every = app.registered_commands, app.registered_groups
    if len(argv) >= 2 and not argv[1].startswith("-") and not os.environ.get(ops.COMPLETE_VAR):
        commands = [c for c in app.registered_commands if _name(c) == argv[1]]
        groups = [g for g in app.registered_groups if g.name == argv[1]]
        if commands or groups:
            app.registered_commands, app.registered_groups = commands, groups
    try:
        yield
    finally:
        app.registered_commands, app.registered_groups = every


def main() -> None:
    handler = logging.StreamHandler()  # stderr; a logged remote text must not reach the terminal raw
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=os.environ.get("EPIBUS_LOG_LEVEL", "WARNING").upper(), handlers=[handler])
    with only_the_command_named(sys.argv):
        app(prog_name=ops.PROG, complete_var=ops.COMPLETE_VAR)  # also under `python -m epibus`
