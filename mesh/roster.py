"""Who decides a project's work and what agents can do: the coordinator roster and advertised capabilities,
and how an agent asks a node to write them (the node is the mesh bucket's only writer). A mixin of MeshAgent.

A project's first coordinator is seated by an admin (a node's operator key, or an agent with the admin role);
while the registry is still open to first use (a server without authentication), by anyone. Later changes are
made by an admin or by one of the project's coordinators; the last coordinator stays. Every change is signed
by whoever made it and is an event (kind `coordinators`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ValidationError

from bus.ask import fan_out
from bus.client import EpibusClient
from bus.errors import Conflict, Forbidden, Unavailable
from bus.event import raise_for_validation
from bus.ids import new_event_id
from bus.publish import Receipt
from bus.requests import ErrorReply
from bus.subjects import MESH_ADVERTISE, MESH_ROSTER
from mesh.events import roster_event, unsigned_roster_event
from mesh.protocol import roster_after, who_may
from mesh.store import MeshStore, Roster, retry_on_conflict
from mesh.task import CAPABILITIES_PURPOSE, AgentCapabilities, RosterChange, RosterDraft, capabilities_document
from mesh.trust import roster_authority
from mesh.wire import AdvertiseRequest, MeshReply, RosterRequest, raise_refusal

ASK_TIMEOUT_S = 10.0
ASK_AGAIN_S = 0.25


class RosterChanges:
    client: EpibusClient
    clock: Callable[[], datetime]

    @property
    def agent(self) -> str:
        return self.client.key.agent_id

    @property
    def store(self) -> MeshStore:
        raise NotImplementedError

    async def ask_node(self, subject: str, request: BaseModel) -> int:
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
        reply = replies.answers[0]
        if isinstance(reply, ErrorReply):
            refused = f"agent {self.agent!r} may not ask {subject}: "
            if reply.error.startswith(refused):
                raise Forbidden(self.agent, "ask", subject, f"{reply.error.removeprefix(refused)} (node {reply.node})")
            raise Unavailable("mesh service", f"node {reply.node} failed {subject}: {reply.error}")
        if reply.refused is not None:
            raise_refusal(reply.refused)
        if reply.revision is None:
            raise Unavailable("mesh service", f"node {reply.node} answered {subject} without a revision")
        return reply.revision

    async def coordinators(self, project: str) -> tuple[str, ...]:
        return (await self.store.get_roster(project)).roster.coordinators

    async def add_coordinator(self, project: str, agent: str, *, message_id: uuid.UUID | None = None) -> Roster:
        """Seat a coordinator (see the module's docstring for who may). Seating one already there changes
        nothing. Raises Forbidden."""
        return await self._change_roster(project, agent, "add", message_id or new_event_id())

    async def remove_coordinator(self, project: str, agent: str, *, message_id: uuid.UUID | None = None) -> Roster:
        """Remove a coordinator (an admin or a coordinator; the last one stays). Raises Forbidden, NotFound."""
        return await self._change_roster(project, agent, "remove", message_id or new_event_id())

    async def _change_roster(
        self, project: str, agent: str, change: Literal["add", "remove"], message_id: uuid.UUID
    ) -> Roster:
        key = self.client.key

        async def attempt() -> Roster:
            entry = await self.store.get_roster(project)
            roster = entry.roster
            if (done := roster.change_for(message_id)) is not None:  # a retry: publish its event again
                await self._publish_roster(roster, roster.changes.index(done))
                return roster
            current = frozenset(roster.coordinators)
            if await roster_authority(self.store.registry, self.agent, key.public_key, current) is None:
                raise Forbidden(self.agent, f"{change} a coordinator of", f"project {project}", who_may(roster))
            try:
                after = roster_after(roster, change, agent, actor=self.agent)
            except Conflict:  # seated already
                return roster
            draft = RosterDraft(
                message_id=message_id, change=change, agent=agent, coordinators=after, actor=self.agent, at=self.clock()
            )
            event = key.sign_v1(
                unsigned_roster_event(
                    project, draft, seq=roster.version + 1, actor=key.actor, session_id=self.client.session_id
                )
            )
            assert event.signature is not None
            request = RosterRequest(
                project=project,
                change=change,
                agent=agent,
                message_id=message_id,
                revision=entry.revision,
                sender=self.agent,
                at=draft.at,
                public_key=key.public_key,
                session_id=self.client.session_id,
                signature=event.signature,
            )
            await self.ask_node(MESH_ROSTER, request)
            made = RosterChange(
                **draft.model_dump(),
                public_key=key.public_key,
                session_id=self.client.session_id,
                signature=event.signature,
            )
            changed = roster.model_copy(update={"changes": (*roster.changes, made)})  # as the node wrote it
            await self._publish_roster(changed, roster.version)
            return changed

        return await retry_on_conflict(attempt, what=f"coordinators of {project}")

    async def _publish_roster(self, roster: Roster, index: int) -> Receipt:
        """The change's event, exactly as its actor signed it (a retry re-sends the same event id)."""
        return await self.client.publish(roster_event(roster, index))

    async def advertise(self, capabilities: Sequence[str]) -> AgentCapabilities:
        """Say what this agent can do (the capability-match policy assigns by it), signed by this agent."""
        key = self.client.key
        chosen, at = tuple(sorted(set(capabilities))), self.clock()
        try:
            document = capabilities_document(self.agent, chosen, at)
            advertised = AgentCapabilities.model_validate(
                {
                    "agent": self.agent,
                    "capabilities": chosen,
                    "updated_at": at,
                    "public_key": key.public_key,
                    "signature": key.sign_document(CAPABILITIES_PURPOSE, document),
                }
            )
        except ValidationError as e:
            raise raise_for_validation(e) from e
        await self.ask_node(MESH_ADVERTISE, AdvertiseRequest(advertised=advertised))
        return advertised
