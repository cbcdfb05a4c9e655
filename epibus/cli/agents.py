"""`epibus agent add|list|revoke`: enrolling agents, as an admin. The node writes the registry after checking
the request's signature and the signer's role; its server then admits the agent's key."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from bus.client import enrol
from bus.host.home import epibus_home
from bus.identity.signing import AgentKey
from bus.model.auth import ANY_PROJECT
from bus.model.requests import EnrolRequest, build_request
from bus.model.vocab import Role, describe
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

agent_app = typer.Typer(help="Enrol, list and revoke agents (admins only).", no_args_is_help=True)


def _admin(nats: str | None, home: Path | None, agent: str | None) -> tuple[Target, AgentKey]:
    """Who signs: the node's key under --home (its operator), else --agent, which must hold the admin role."""
    target = Target(nats, home, agent)
    return target, target.key(epibus_home(home))


async def _ask(target: Target, admin: AgentKey, call: Any) -> Any:
    nc = await target.connect()
    try:
        return await call(nc, admin)
    finally:
        await nc.close()


def _show(rows: list[dict[str, Any]], title: str) -> None:
    columns = ["agent_id", "identity", "owner", "roles", "projects", "public_key", "enrolled_at", "revoked_at"]
    shown_rows = [r | {"identity": r.get("identity") or "agent"} for r in rows]  # none recorded: an agent
    console.print(
        table(
            title,
            columns,
            [[", ".join(r[c]) if isinstance(r[c], list) else r[c] for c in columns] for r in shown_rows],
        )
    )


@agent_app.command("add")
@handles_errors
def add(
    agent_id: Annotated[str, typer.Argument(metavar="NAME", help="The agent id to enrol.")],
    key: Annotated[str, typer.Option("--key", help="The agent's nkey public key (U…).")],
    project: Annotated[
        list[str], typer.Option("--project", "-p", help=f"A project it belongs to (repeat; {ANY_PROJECT!r}: all).")
    ],
    role: Annotated[list[Role] | None, typer.Option("--role", help=describe(Role))] = None,
    owner: Annotated[str | None, typer.Option("--owner", help="Who is behind it (default: the agent itself).")] = None,
    replace_key: Annotated[bool, typer.Option("--replace-key", help="Rotate the key of an enrolled agent.")] = False,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Enrol an agent (or change its roles, projects or owner): its key may then connect, confined to them."""
    request = build_request(
        EnrolRequest,
        agent_id=agent_id,
        public_key=key,
        owner=owner,
        roles=list(role or [Role.agent]),
        projects=project,
        replace_key=replace_key,
    )
    target, admin = _admin(nats, home, agent)
    enrolment = run(_ask(target, admin, lambda nc, a: enrol.enrol(nc, a, request)))
    if as_json:
        emit_json(enrolment)
    else:
        _show([enrolment], "enrolled")


@agent_app.command("list")
@handles_errors
def list_command(nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Every enrolled agent, revoked ones included."""
    target, admin = _admin(nats, home, agent)
    rows = run(_ask(target, admin, enrol.list_agents))
    if as_json:
        emit_json(rows)
    else:
        _show(rows, "agents")


@agent_app.command("revoke")
@handles_errors
def revoke(
    agent_id: Annotated[str, typer.Argument(metavar="NAME")],
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke an agent: its key can no longer connect; its past events stay verifiable."""
    target, admin = _admin(nats, home, agent)
    enrolment = run(_ask(target, admin, lambda nc, a: enrol.revoke(nc, a, agent_id)))
    if as_json:
        emit_json(enrolment)
    else:
        _show([enrolment], "revoked")
