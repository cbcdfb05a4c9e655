"""A fleet across machines, the joining node's side. `epibus up --join TOKEN` keeps what the invite carries under
`<home>/fleet` (the fleet CA, this node's certificate and key, the hub's leaf URLs), starts its server as a leaf
of the hub authenticated by the invite's one-time key, redeems the invite with this node's own key, and from then
on (this start and every later one) its server leafs to the hub as this node. Its journal and mirror catch up
from the hub's stream like any node's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import nats
from nats.aio.client import Client as NatsClient
from pydantic import BaseModel, ConfigDict, ValidationError

from bus.broker.ask import ask_one
from bus.broker.nats_errors import CONNECT_OR_REFUSED
from bus.errors import ConfigError, Forbidden, Unavailable
from bus.host.home import private_dir, write_private
from bus.identity.signing import AgentKey
from bus.model.auth import inbox_prefix
from bus.model.requests import FleetJoinRequest, FleetReply
from bus.subjects import FLEET_JOIN
from epibus.fleet.certs import CA_NAME
from epibus.fleet.hub import JOIN_PROOF_PURPOSE, join_proof_document, leaf_remote_block
from epibus.fleet.invites import FLEET_DIR, decode_token

log = logging.getLogger(__name__)
JOIN_FILE = "join.json"
INVITE_KEY_FILE = "invite.nk"
NODE_CERT = "node"
REDEEM_TIMEOUT_S = 30.0  # the leaf connection to the hub comes up first (TLS, then the invite key)


def hub_refuses(server_log: str) -> bool:
    """Whether a node's own server log says the hub refused its leaf connection's key."""
    return "leafnode error 'authorization violation'" in server_log.lower()


class JoinState(BaseModel):
    """What a joined (or joining) node keeps of its fleet."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fleet: str
    name: str
    hub: str
    urls: list[str]
    phase: Literal["invited", "joined"]
    joined_at: datetime | None = None


@dataclass(frozen=True)
class Leaf:
    """A node's view of its fleet membership: where its files are and what its server config says."""

    home: Path
    state: JoinState

    @property
    def directory(self) -> Path:
        return self.home / FLEET_DIR

    def server_block(self, seed: str) -> str:
        return leaf_remote_block(self.state.urls, seed, self.directory, NODE_CERT)

    def invite_seed(self) -> str:
        return (self.directory / INVITE_KEY_FILE).read_text().strip()


def load_leaf(home: Path) -> Leaf | None:
    """The home's fleet membership as a joined node, or None (a standalone node or a hub). Raises ConfigError."""
    path = home / FLEET_DIR / JOIN_FILE
    if not path.exists():
        return None
    try:
        return Leaf(home, JoinState.model_validate(json.loads(path.read_text())))
    except (OSError, ValueError, ValidationError) as e:
        raise ConfigError(str(path), f"cannot be read ({e}); join again with a new invite and a new --home") from e


def prepare_join(home: Path, token: str) -> Leaf:
    """Keep what the invite carries under the home. Raises ConfigError: not a token, damaged, expired, or a home
    that joined a fleet already."""
    invite = decode_token(token)
    known = load_leaf(home)
    if known is not None and known.state.phase == "joined":
        raise ConfigError(
            "--join",
            f"{home} joined the fleet as {known.state.name} already; "
            "start it without --join, or join with a new --home",
        )
    directory = home / FLEET_DIR
    private_dir(directory)
    write_private(directory / f"{CA_NAME}.crt", invite.ca_pem)
    write_private(directory / f"{NODE_CERT}.crt", invite.cert_pem)
    write_private(directory / f"{NODE_CERT}.key", invite.key_pem)
    write_private(directory / INVITE_KEY_FILE, invite.invite_seed)
    state = JoinState(fleet=invite.fleet, name=invite.name, hub=invite.hub, urls=invite.urls, phase="invited")
    _save(home, state)
    return Leaf(home, state)


def _save(home: Path, state: JoinState) -> None:
    write_private(home / FLEET_DIR / JOIN_FILE, state.model_dump_json(indent=1), durable=True)


async def redeem(leaf: Leaf, local_url: str, node: AgentKey, *, host: str, server_log: Callable[[], str]) -> Leaf:
    """Redeem the invite through this node's own server (a leaf of the hub, authenticated by the invite key),
    with `node`'s key. Returns the joined membership. Raises Forbidden (the hub refused: used, expired, withdrawn
    or forged) or Unavailable (the hub did not answer: unreachable, or it refused the invite key at the door)."""
    invite = AgentKey("invite", leaf.invite_seed().encode())
    proof = node.sign_document(JOIN_PROOF_PURPOSE, join_proof_document(leaf.state.name, invite.public_key))
    request = FleetJoinRequest(
        name=leaf.state.name, invite_key=invite.public_key, node_key=node.public_key, host=host, proof=proof
    )
    nc = await _connect(local_url, node, invite)
    try:
        reply = await _ask_until_reached(nc, request, invite, leaf.state, server_log)
    finally:
        await nc.close()
    state = leaf.state.model_copy(update={"phase": "joined", "joined_at": datetime.now(UTC)})
    _save(leaf.home, state)
    (leaf.directory / INVITE_KEY_FILE).unlink(missing_ok=True)  # used once: nothing to keep
    log.info("joined the fleet as %s (hub %s): %s", state.name, state.hub, reply.member)
    return Leaf(leaf.home, state)


async def _connect(local_url: str, node: AgentKey, invite: AgentKey) -> NatsClient:
    # The node's own connection to its own server, receiving on the invite key's inboxes: the hub answers there,
    # and the invite key may hear nothing else.
    credentials = node.nats_credentials | {"inbox_prefix": inbox_prefix(invite.public_key).encode()}
    try:
        return await nats.connect(local_url, allow_reconnect=False, connect_timeout=5, **credentials)
    except CONNECT_OR_REFUSED as e:
        raise Unavailable("nats-server", f"this node's own server at {local_url}: {e}") from e


async def _ask_until_reached(
    nc: NatsClient, request: FleetJoinRequest, invite: AgentKey, state: JoinState, server_log: Callable[[], str]
) -> FleetReply:
    """Ask until the leaf connection is up and the hub answers (a refusal is final)."""
    deadline = asyncio.get_running_loop().time() + REDEEM_TIMEOUT_S
    while True:
        try:
            return await ask_one(nc, FLEET_JOIN, request, FleetReply, signer=invite, timeout_s=3.0)
        except Forbidden as e:
            raise Forbidden(state.name, "join", f"the fleet of {state.hub}", e.rule) from e
        except Unavailable as e:
            if hub_refuses(server_log()):
                raise Forbidden(
                    state.name, "join", f"the fleet of {state.hub}",
                    "the hub refused the invite's key: the invite was used, withdrawn or has expired, or it is not "
                    f"this fleet's; ask an admin for a new one (epibus fleet invite {state.name})",
                ) from e  # fmt: skip
            if asyncio.get_running_loop().time() > deadline:
                raise Unavailable(
                    "fleet hub",
                    f"{', '.join(state.urls)} did not answer within {REDEEM_TIMEOUT_S:.0f} s (is it up, listening with "
                    "--fleet-port, and reachable from here? the server log under <home>/nats says why)",
                ) from e
            await asyncio.sleep(0.5)
