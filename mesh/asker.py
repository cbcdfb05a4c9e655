"""Asking a node to write the mesh for an agent (the node is the mesh bucket's only writer): one signed
request, asked again while no node responds yet, and the node's answer turned back into the error it raised."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from bus.broker.ask import fan_out
from bus.client.client import EpibusClient
from bus.errors import Forbidden, Unavailable
from bus.model.requests import ErrorReply
from mesh.wire import MeshReply, raise_refusal

ASK_TIMEOUT_S = 10.0
ASK_AGAIN_S = 0.25


class NodeAsker:
    """Asks on `client`'s connection, signed with its key."""

    def __init__(self, client: EpibusClient) -> None:
        self.client = client

    async def ask(self, subject: str, request: BaseModel) -> int:
        """Ask one node to write (signed with this agent's key); the revision it wrote. Raises the error the
        node refused with, Forbidden (the node would not hear this agent), Unavailable (no node answered)."""
        nc = self.client.nc
        if nc is None or not self.client.connected:
            raise Unavailable("nats", f"not connected: {subject} needs a node to write the mesh")
        key = self.client.key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ASK_TIMEOUT_S
        while True:  # no responder yet (a node reconnecting after a restart): ask again until the deadline
            left = deadline - loop.time()
            replies = await fan_out(nc, subject, request, MeshReply, timeout_s=max(left, 0.1), signer=key, one=True)
            if replies.answers or replies.malformed or loop.time() + ASK_AGAIN_S >= deadline:
                break
            await asyncio.sleep(ASK_AGAIN_S)
        if not replies.answers:
            why = "; ".join(f"{n}: {e}" for n, e in replies.malformed.items()) or "no node answered"
            raise Unavailable("mesh service", f"{subject}: {why}; is `epibus up` running?")
        return self._revision(subject, replies.answers[0])

    def _revision(self, subject: str, reply: MeshReply | ErrorReply) -> int:
        """The revision the node wrote, or the error it answered with."""
        agent = self.client.key.agent_id
        if isinstance(reply, ErrorReply):
            refused = f"agent {agent!r} may not ask {subject}: "
            if reply.error.startswith(refused):
                raise Forbidden(agent, "ask", subject, f"{reply.error.removeprefix(refused)} (node {reply.node})")
            raise Unavailable("mesh service", f"node {reply.node} failed {subject}: {reply.error}")
        if reply.refused is not None:
            raise_refusal(reply.refused)
        if reply.revision is None:
            raise Unavailable("mesh service", f"node {reply.node} answered {subject} without a revision")
        return reply.revision
