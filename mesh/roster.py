"""Who decides a project's work and what agents can do: the coordinator roster and advertised capabilities,
and how an agent asks a node to write them (the node is the mesh bucket's only writer). MeshAgent delegates
its roster and capability verbs here.

A project's first coordinator is seated by an admin (a node's operator key, or an agent with the admin role);
while the registry is still open to first use (a server without authentication), by anyone. Later changes are
made by an admin or by one of the project's coordinators; the last coordinator stays. Every change is signed
by whoever made it and is an event (kind `coordinators`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Literal

from bus.client.client import EpibusClient
from bus.errors import Conflict, Forbidden
from bus.outbox.publish import Receipt
from bus.subjects import MESH_ADVERTISE, MESH_ROSTER
from mesh.events import roster_event
from mesh.protocol import roster_after, who_may
from mesh.signer import MeshSigner
from mesh.steps import Ask
from mesh.store import MeshStore, Roster, retry_on_conflict
from mesh.task import AgentCapabilities, RosterDraft
from mesh.trust import roster_authority
from mesh.wire import AdvertiseRequest


class RosterChanges:
    """The roster changes and advertisements of the agent `client` connects; see StepSender for the parts."""

    def __init__(
        self,
        client: EpibusClient,
        store: Callable[[], MeshStore],
        signer: MeshSigner,
        ask: Ask,
        clock: Callable[[], datetime],
    ) -> None:
        self.client = client
        self.agent = client.key.agent_id
        self.store = store
        self.signer = signer
        self.ask = ask
        self.clock = clock

    async def coordinators(self, project: str) -> tuple[str, ...]:
        return (await self.store().get_roster(project)).roster.coordinators

    async def change(self, project: str, agent: str, change: Literal["add", "remove"], message_id: uuid.UUID) -> Roster:
        """Add or remove a coordinator (see the module's docstring for who may). Seating one already there
        changes nothing; a message id already applied publishes its event again. Raises Forbidden, NotFound."""

        async def attempt() -> Roster:
            entry = await self.store().get_roster(project)
            roster = entry.roster
            if (done := roster.change_for(message_id)) is not None:  # a retry: publish its event again
                await self._publish(roster, roster.changes.index(done))
                return roster
            current = frozenset(roster.coordinators)
            key = self.client.key
            if await roster_authority(self.store().registry, self.agent, key.public_key, current) is None:
                raise Forbidden(self.agent, f"{change} a coordinator of", f"project {project}", who_may(roster))
            try:
                after = roster_after(roster, change, agent, actor=self.agent)
            except Conflict:  # seated already
                return roster
            draft = RosterDraft(
                message_id=message_id, change=change, agent=agent, coordinators=after, actor=self.agent, at=self.clock()
            )
            request, made = self.signer.roster_change(
                project, draft, revision=entry.revision, roster_version=roster.version
            )
            await self.ask(MESH_ROSTER, request)
            changed = roster.model_copy(update={"changes": (*roster.changes, made)})  # as the node wrote it
            await self._publish(changed, roster.version)
            return changed

        return await retry_on_conflict(attempt, what=f"coordinators of {project}")

    async def _publish(self, roster: Roster, index: int) -> Receipt:
        """The change's event, exactly as its actor signed it (a retry re-sends the same event id)."""
        return await self.client.publish(roster_event(roster, index))

    async def advertise(self, capabilities: Sequence[str]) -> AgentCapabilities:
        """Say what this agent can do (the capability-match policy assigns by it), signed by this agent."""
        advertised = self.signer.capabilities(capabilities, self.clock())
        await self.ask(MESH_ADVERTISE, AdvertiseRequest(advertised=advertised))
        return advertised
