"""`epibus fleet invite|list|remove`: a fleet across machines. An admin invites a node through the fleet's hub,
the new host runs `epibus up --join TOKEN`, and `remove` shuts a node out for good (docs/cluster.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from nats.aio.client import Client as NatsClient
from pydantic import BaseModel

from bus.broker.ask import ask_one
from bus.broker.presence import live_nodes
from bus.errors import Unavailable
from bus.host.home import write_private
from bus.identity.signing import AgentKey
from bus.model.requests import FleetInviteReply, FleetInviteRequest, FleetRemoveRequest, FleetReply, build_request
from bus.subjects import FLEET_INVITE, FLEET_REMOVE
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
from epibus.fleet.hub import FleetMember, FleetRoster

fleet_app = typer.Typer(help="A fleet on several machines: invite, list and remove nodes.", no_args_is_help=True)
ASK_TIMEOUT_S = 15.0
R = TypeVar("R", bound=BaseModel)
# What the table shows of each row (`--json` has every field whole), under headers that fit 80 columns.
TABLE_COLUMNS = {"name": "name", "role": "role", "host": "host", "public_key": "key", "joined_at": "joined",
                 "heartbeat": "seen", "lag": "lag"}  # fmt: skip


@fleet_app.command("invite")
@handles_errors
def invite(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The new node's name (its `epibus up --name`).")],
    ttl_s: Annotated[float, typer.Option("--ttl", min=60, help="Seconds the invite stays usable.")] = 3600.0,
    host: Annotated[
        list[str] | None, typer.Option("--host", help="The new node's address, for its certificate (repeat).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Write the token to this file (0600) instead of printing it.")
    ] = None,
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Invite node NAME: prints a one-time token (a secret: it holds the node's TLS key) for `epibus up --join`."""
    request = build_request(FleetInviteRequest, name=name, ttl_s=ttl_s, hosts=list(host or []))

    async def ask() -> FleetInviteReply:
        async with Target(nats, home, agent).asking() as (nc, signer):
            return await _ask_hub(nc, FLEET_INVITE, request, FleetInviteReply, signer)

    reply = run(ask())
    if out is not None:
        write_private(out, reply.token + "\n")
    if as_json:
        token = None if out else reply.token
        emit_json({"name": name, "expires_at": reply.expires_at, "hub": reply.node, "token": token, "file": out})
        return
    until = f"{reply.expires_at:%Y-%m-%d %H:%M} UTC"
    if out is not None:
        console.print(shown(f"invite for {name} in {out}, usable once until {until}; on the new host:"))
        console.print(shown(f'  epibus up --join "$(cat {out.name})"'), soft_wrap=True)
        return
    console.print(shown(f"invite for {name}, usable once until {until}; on the new host:"))
    console.print(shown(f"epibus up --join {reply.token}"), soft_wrap=True)


@fleet_app.command("list")
@handles_errors
def list_command(nats: NatsOpt = None, agent: AgentOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Every node of the fleet (removed ones too): role, host, key, last heartbeat and journal lag."""

    async def read() -> list[dict[str, Any]]:
        async with Target(nats, home, agent).asking() as (nc, _):
            js = nc.jetstream()
            members = await FleetRoster(js).members()
            live = await live_nodes(js)
        return [_row(m, live.nodes.get(m.name)) for m in members]

    rows = run(read())
    if as_json:
        emit_json(rows)
        return
    if not rows:
        console.print(shown("no fleet: this node's hub has recorded no members (a hub is started with --fleet-port)"))
        return
    cells = [[_short(c, row[c]) for c in TABLE_COLUMNS] for row in map(_removed_as_role, rows)]
    console.print(table("fleet", list(TABLE_COLUMNS.values()), cells))


@fleet_app.command("remove")
@handles_errors
def remove(
    name: Annotated[str, typer.Argument(metavar="NAME")],
    nats: NatsOpt = None,
    agent: AgentOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove node NAME: its key is refused by the hub at once (its connection closed); its past events stay valid.
    It comes back only through a new invite, with a new key."""
    request = build_request(FleetRemoveRequest, name=name)

    async def ask() -> FleetReply:
        async with Target(nats, home, agent).asking() as (nc, signer):
            return await _ask_hub(nc, FLEET_REMOVE, request, FleetReply, signer)

    reply = run(ask())
    if as_json:
        emit_json(reply.member)
        return
    console.print(shown(f"removed {name} from the fleet (hub {reply.node})"))


async def _ask_hub(nc: NatsClient, subject: str, request: BaseModel, reply: type[R], signer: AgentKey) -> R:
    """Ask the fleet's hub (through any node: the request crosses to it)."""
    try:
        return await ask_one(nc, subject, request, reply, signer=signer, timeout_s=ASK_TIMEOUT_S)
    except Unavailable as e:
        raise Unavailable(
            "fleet hub", f"no hub answered {subject}: a fleet's hub is the node started with `epibus up --fleet-port`"
        ) from e


def _row(member: FleetMember, beat: Any) -> dict[str, Any]:
    age = None if beat is None else round((datetime.now(UTC) - beat.at).total_seconds(), 1)
    return {
        "name": member.name,
        "role": member.role,
        "host": member.host,
        "public_key": member.public_key,
        "joined_at": member.joined_at.isoformat(),
        "removed_at": member.revoked_at.isoformat() if member.revoked_at else None,
        "heartbeat": None if age is None else f"{age:.0f}s ago",
        "lag": None if beat is None else beat.journal_pending,
    }


def _removed_as_role(row: dict[str, Any]) -> dict[str, Any]:
    return row | {"role": "removed"} if row["removed_at"] else row


def _short(column: str, value: Any) -> str:
    """A cell at 80 columns: the key's first characters (`--json` has it whole), times to the minute."""
    if value is None:
        return "-"
    if column == "public_key":
        return f"{value[:8]}…"
    if column in ("joined_at", "removed_at"):
        return datetime.fromisoformat(value).strftime("%m-%d %H:%M")
    return str(value)
