"""`epibus mesh coordinators add|remove|list`: who decides a project's work.

From a node's home the roster is changed as the node's operator (its key, an admin): it seats a project's
first coordinator and, on a fleet that enrols its agents, first gives the agent the `coordinator` role in the
project if it lacks it (a local agent's key is made on first use, as every command does). Elsewhere it is
changed as --agent: an admin, or one of the project's coordinators."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from bus.client import enrol
from bus.client.client import EpibusClient
from bus.enrolment.registry import AgentRegistry
from bus.host.home import NodeFollower, epibus_home, explicit_nats_url, resolve_nats_url, split_servers
from bus.identity.signing import NODE_KEY_FILE, AgentKey, node_key
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Role
from epibus.cli.common import AgentOpt, HomeOpt, JsonOpt, NatsOpt, console, emit_json, err_console, handles_errors, run
from epibus.cli.display import shown
from epibus.cli.mesh import MessageIdOpt, RequiredProject, coordinators_app, message_id_of, run_mesh

# The mesh's models load when a mesh command runs, not at every CLI start (`epibus --help` included).
if TYPE_CHECKING:
    from mesh.agent import MeshAgent
    from mesh.store import Roster

T = TypeVar("T")
AgentArg = Annotated[str, typer.Argument(help="The agent.")]


def _run_as_signer(
    nats: str | None, agent: str | None, home: Path | None, work: Callable[[MeshAgent, Path | None], Awaitable[T]]
) -> T:
    """Run `work` as the node's operator where the home holds its key (given the home), else as --agent (None)."""
    where = epibus_home(home)
    if not (where / NODE_KEY_FILE).exists():
        return run_mesh(nats, agent, home, lambda mesh: work(mesh, None))

    from mesh.agent import MeshAgent

    async def go() -> T:
        servers = split_servers(resolve_nats_url(nats, where))
        follow = NodeFollower(where, servers) if explicit_nats_url(nats) is None else None
        async with EpibusClient(servers, node_key(where), outbox=None, follow=follow) as client:
            return await work(MeshAgent(client), where)

    return run(go())


async def seat_as_operator(
    servers: list[str], home: Path, project: str, who: str, *, message_id: uuid.UUID | None = None
) -> Roster:
    """What `epibus mesh coordinators add` does from a node's home, from Python: the node's operator gives
    `who` the coordinator role in `project` if the fleet enrols its agents, and seats it."""
    from mesh.agent import MeshAgent

    async with EpibusClient(servers, node_key(home), outbox=None) as client:
        mesh = MeshAgent(client)
        await give_coordinator_role(mesh, who, project, home)
        return await mesh.add_coordinator(project, who, message_id=message_id)


async def give_coordinator_role(mesh: MeshAgent, who: str, project: str, home: Path) -> dict[str, Any] | None:
    """On a fleet that enrols its agents, enrol `who` (a local agent's key, made on first use) with the
    `coordinator` role in `project` unless it has it. Returns the enrolment written, or None."""
    registry = AgentRegistry(mesh.client.js)
    if not await registry.is_closed():
        return None
    enrolment = await registry.get(who)
    if enrolment is not None and not enrolment.active:
        return None  # revoked on purpose: the node refuses to seat it, saying so
    if enrolment is not None and enrolment.member_of(project) and enrolment.has_role(Role.coordinator):
        return None
    if enrolment is not None:
        fields: dict[str, Any] = {
            "public_key": enrolment.public_key,
            "owner": enrolment.owner,
            "roles": list(dict.fromkeys([*enrolment.roles, Role.coordinator])),
            "projects": list(enrolment.projects if enrolment.member_of(project) else (*enrolment.projects, project)),
        }
    else:
        key = AgentKey.load_or_create(home, who)
        fields = {"public_key": key.public_key, "roles": [Role.agent, Role.coordinator], "projects": [project]}
    request = build_request(EnrolRequest, agent_id=who, **fields)
    nc = mesh.client.nc
    assert nc is not None  # the client is connected: it just read the registry
    return await enrol.enrol(nc, mesh.client.key, request)


def _show_roster(project: str, coordinators: tuple[str, ...], as_json: bool, **extra: Any) -> None:
    if as_json:
        emit_json({"ok": True, "project": project, "coordinators": list(coordinators), **extra})
    else:
        console.print(shown(f"coordinators of {project}: {', '.join(coordinators) or 'none'}"), soft_wrap=True)


@coordinators_app.command("add")
@handles_errors
def coordinators_add(
    who: AgentArg,
    project: RequiredProject,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Seat a coordinator: an admin (from a node's home: its operator) seats a project's first; after that, an
    admin or one of its coordinators."""
    mid = message_id_of(message_id)

    async def work(mesh: MeshAgent, operator_home: Path | None) -> tuple[Roster, dict[str, Any] | None]:
        enrolled = await give_coordinator_role(mesh, who, project, operator_home) if operator_home else None
        return await mesh.add_coordinator(project, who, message_id=mid), enrolled

    roster, enrolled = _run_as_signer(nats, agent, home, work)
    if enrolled is not None and not as_json:
        err_console.print(shown(f"enrolled {who} with the coordinator role in project {project}"), soft_wrap=True)
    _show_roster(project, roster.coordinators, as_json, enrolled=enrolled)


@coordinators_app.command("remove")
@handles_errors
def coordinators_remove(
    who: AgentArg,
    project: RequiredProject,
    message_id: MessageIdOpt = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a coordinator (an admin, from a node's home its operator, or a coordinator; the last one stays)."""
    mid = message_id_of(message_id)

    async def work(mesh: MeshAgent, _operator_home: Path | None) -> Roster:
        return await mesh.remove_coordinator(project, who, message_id=mid)

    _show_roster(project, _run_as_signer(nats, agent, home, work).coordinators, as_json)


@coordinators_app.command("list")
@handles_errors
def coordinators_list(
    project: RequiredProject,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The project's coordinators."""
    _show_roster(project, run_mesh(nats, agent, home, lambda m: m.coordinators(project)), as_json)
