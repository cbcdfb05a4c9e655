"""How a node takes its place in a fleet across machines: a hub (`--fleet-port`) runs its server with the fleet's
JetStream domain and a listener for joining nodes, and serves the fleet's requests; a joined node (`--join`, or a
home that joined before) runs its server as a leaf of the hub, redeeming its invite at the first start."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.nats_errors import NATS_UNAVAILABLE
from bus.errors import ConfigError, Forbidden, Unavailable
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey
from bus.services.enrolments import Enrolments
from bus.services.responder import serve_services
from bus.subjects import FLEET_DOMAIN
from epibus.fleet.hub import FleetHub, hub_listener
from epibus.fleet.join import Leaf, hub_refuses, load_leaf, prepare_join, redeem
from epibus.node.config import NodeConfig

log = logging.getLogger(__name__)
LEAF_SETTLE_S = 60.0  # a joined node's first JetStream calls wait for its leaf connection to the hub


@dataclass(frozen=True)
class FleetPlace:
    """What a node's server is in its fleet: alone (neither), the hub, or a leaf."""

    hub_port: int | None
    leaf: Leaf | None

    def server_options(self, home: Path, name: str, host: str, key: AgentKey) -> dict[str, object]:
        """NatsServer keyword arguments for this place."""
        if self.leaf is not None:
            seed = self.leaf.invite_seed() if self.leaf.state.phase == "invited" else _seed(key)
            return {"jetstream": False, "extra_config": self.leaf.server_block(seed)}
        if self.hub_port is not None:
            return {"jetstream_domain": FLEET_DOMAIN, "extra_config": hub_listener(home, name, host, self.hub_port)}
        return {}

    @property
    def joining_as(self) -> str | None:
        """The name the invite was made for (a joined node keeps it)."""
        return self.leaf.state.name if self.leaf is not None else None

    @property
    def settle_s(self) -> float:
        return LEAF_SETTLE_S if self.leaf is not None else 0.0


def fleet_place(config: NodeConfig) -> FleetPlace:
    """Where `config` puts the node. Raises ConfigError: a join token that does not read, a hub that joins, or a
    joined node started with the embedded server off."""
    leaf = prepare_join(config.home, config.join) if config.join else load_leaf(config.home)
    if leaf is not None and config.fleet_port is not None:
        raise ConfigError("--fleet-port", f"this node joined the fleet of {leaf.state.hub}; only the hub listens")
    if leaf is not None and config.name is not None and config.name != leaf.state.name:
        raise ConfigError("--name", f"the invite is for {leaf.state.name}; drop --name or use {leaf.state.name}")
    if (leaf is not None or config.fleet_port is not None) and config.nats_url is not None:
        raise ConfigError("--nats", "a fleet's nodes run their embedded server; drop --nats")
    return FleetPlace(config.fleet_port, leaf)


async def join_if_invited(place: FleetPlace, server: NatsServer, key: AgentKey, *, host: str) -> FleetPlace:
    """Redeem the invite through the node's own server, then run it as the node from now on; return once the
    hub's JetStream answers through it. Raises Forbidden (the hub refused the invite or this node's key) or
    Unavailable (it did not answer)."""
    leaf = place.leaf
    if leaf is None:
        return place
    if leaf.state.phase == "invited":
        leaf = await redeem(leaf, server.url, key, host=host, server_log=lambda: server.log_tail(20))
        await asyncio.to_thread(server.stop)
        server.extra_config = leaf.server_block(_seed(key))
        await asyncio.to_thread(server.start)
    await reach_hub(server, key, leaf)
    return FleetPlace(place.hub_port, leaf)


async def reach_hub(server: NatsServer, key: AgentKey, leaf: Leaf) -> None:
    """Wait until the hub's JetStream answers through this node's leaf connection. Raises Forbidden when the hub
    refuses this node's key (removed from the fleet), Unavailable when it does not answer in time."""
    nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=5, **key.nats_credentials)
    deadline = asyncio.get_running_loop().time() + LEAF_SETTLE_S
    try:
        while True:
            try:
                await nc.request("$JS.API.INFO", b"", timeout=2)
                return
            except NATS_UNAVAILABLE as e:
                if hub_refuses(server.log_tail(20)):
                    raise Forbidden(
                        leaf.state.name, "connect to", f"the fleet of {leaf.state.hub}",
                        "the hub refuses this node's key: it was removed from the fleet; a node rejoins with a new "
                        "key through a new invite (epibus fleet invite, then `epibus up --join` with a new --home)",
                    ) from e  # fmt: skip
                if asyncio.get_running_loop().time() > deadline:
                    raise Unavailable(
                        "fleet hub",
                        f"{', '.join(leaf.state.urls)} did not answer within {LEAF_SETTLE_S:.0f} s; is it up and "
                        "reachable from here? (the server log under <home>/nats says why)",
                    ) from e
                await asyncio.sleep(0.25)
    finally:
        await nc.close()


async def serve_hub(
    place: FleetPlace,
    *,
    home: Path,
    nc: NatsClient,
    js: JetStreamContext,
    name: str,
    key: AgentKey,
    host: str,
    enrolments: Enrolments,
    system: Callable[[], Awaitable[NatsClient]],
) -> FleetHub | None:
    """On a hub: record it, make its joined nodes and pending invites users of its server, answer the fleet's
    requests. Returns the hub, or None elsewhere. On a leaf: agents' permissions in the hub's domain."""
    if place.leaf is not None:
        enrolments.js_domain = FLEET_DOMAIN
        return None
    if place.hub_port is None:
        return None
    hub = FleetHub(
        home, js, name=name, public_key=key.public_key, host=host, fleet_port=place.hub_port,
        apply=enrolments.apply, system=system,
    )  # fmt: skip
    await hub.start()
    enrolments.extra_users = hub.users
    await serve_services(nc, hub.services(), node=name, guard=enrolments.guard)
    await hub.serve_join(nc)
    await enrolments.apply()
    return hub


def _seed(key: AgentKey) -> str:
    return str(key.nats_credentials["nkeys_seed_str"])


class FleetLink:
    """A joined node's link to its hub, as its own server's log tells: refused once the hub removed this node.
    Said once, loudly, and reported in the node's health until it changes."""

    def __init__(self, server: NatsServer, leaf: Leaf) -> None:
        self.server = server
        self.leaf = leaf
        self.refused = False

    async def watch(self, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            refused = hub_refuses(self.server.log_tail(20))
            if refused and not self.refused:
                log.error("%s", self.problem)
            self.refused = refused

    @property
    def problem(self) -> str:
        return (
            f"the hub {self.leaf.state.hub} refuses this node's key: it was removed from the fleet; nothing reaches "
            "the stream from here (agents' events wait in their outboxes); a node rejoins with a new key through a "
            "new invite (`epibus up --join` with a new --home)"
        )
