"""Which connections are confined: an agent's, on a server with authentication. Such a connection reads only
through what the broker scopes to its projects (consumers a node opens for it, direct gets with the subject in
the request) and asks a node for the rest."""

from __future__ import annotations

import weakref

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.identity.signing import AgentKey

# The agent key each confined connection reads as: its consumers are opened by a node.
_CONFINED: weakref.WeakKeyDictionary[NatsClient, AgentKey] = weakref.WeakKeyDictionary()


def confine(nc: NatsClient, key: AgentKey) -> None:
    """From now on, consumers read through `nc` are opened for `key` by a node."""
    _CONFINED[nc] = key


def confined_key(js_or_nc: JetStreamContext | NatsClient) -> AgentKey | None:
    nc = js_or_nc._nc if isinstance(js_or_nc, JetStreamContext) else js_or_nc  # nats-py keeps its connection there
    return _CONFINED.get(nc)
