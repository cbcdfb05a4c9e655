"""`epibus mesh coordinate|advertise`: an agent's standing part in the mesh: running a project's coordinator
service, and advertising what it can do (the capability-match policy assigns by it)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from bus.host.home import epibus_home
from epibus.cli.common import (
    AgentOpt,
    HomeOpt,
    JsonOpt,
    NatsOpt,
    console,
    emit_json,
    err_console,
    handles_errors,
)
from epibus.cli.display import shown
from epibus.cli.mesh import RequiredProject, mesh_app, run_mesh, until_stopped

# The mesh's models load when a mesh command runs, not at every CLI start (`epibus --help` included).
if TYPE_CHECKING:
    from mesh.agent import MeshAgent


@mesh_app.command()
@handles_errors
def coordinate(
    project: RequiredProject,
    policy: Annotated[
        str,
        typer.Option("--policy", help="manual | auto-accept:<category>[,<category>…] | capability-match"),
    ] = "manual",
    sweep: Annotated[float, typer.Option("--sweep", help="Seconds between deadline sweeps.")] = 1.0,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the coordinator service for a project: decide proposals by the policy, expire overdue tasks.
    This agent must be one of the project's coordinators."""
    from bus.intake.cursor import FileCursor
    from mesh.coordinator import Coordinator, parse_policy

    chosen = parse_policy(policy)

    async def work(mesh: MeshAgent) -> None:
        cursor = FileCursor(epibus_home(home) / "mesh" / f"coordinator-{mesh.agent}-{project}.cursor")
        service = Coordinator(mesh, project, chosen, sweep_interval_s=sweep, cursor=cursor)
        await service.check()
        if as_json:
            emit_json(
                {"ok": True, "status": "coordinating", "project": project, "agent": mesh.agent, "policy": chosen.name}
            )
        else:
            err_console.print(shown(f"{mesh.agent} coordinates {project} with policy {chosen.name} (Ctrl-C stops)"))
        await until_stopped(service.run(), asyncio.Event())
        figures = {
            "decided": dict(service.stats.decided),
            "left_to_person": service.stats.left_to_person,
            "lost_races": service.stats.lost_races,
            "expired": service.stats.expired,
            "refused": service.stats.refused,
            "sweep_errors": service.stats.sweep_errors,
        }
        if as_json:
            emit_json({"ok": True, "status": "stopped", **figures})
        else:
            err_console.print(shown(f"stopped: {figures}"), soft_wrap=True)

    run_mesh(nats, agent, home, work)


@mesh_app.command()
@handles_errors
def advertise(
    capabilities: Annotated[list[str], typer.Argument(help="What this agent can do, e.g. python db:postgres.")],
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Advertise this agent's capabilities (the capability-match policy assigns by them)."""
    advertised = run_mesh(nats, agent, home, lambda m: m.advertise(capabilities))
    if as_json:
        emit_json({"ok": True, **advertised.model_dump(mode="json")})
    else:
        console.print(shown(f"{advertised.agent} advertises {', '.join(advertised.capabilities)}"), soft_wrap=True)
