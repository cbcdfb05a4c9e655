"""Who decides a project's work and what agents can do: the coordinator roster (changed only by coordinators,
every change an event) and advertised capabilities. A mixin of MeshAgent."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Literal

from pydantic import ValidationError

from bus.client import EpibusClient
from bus.errors import Forbidden, NotFound
from bus.event import raise_for_validation
from bus.ids import new_event_id
from bus.publish import Receipt
from mesh.events import COORDINATORS_KIND, CoordinatorsEventBody
from mesh.store import AgentCapabilities, MeshStore, Roster, retry_on_conflict

KEEP_APPLIED_IDS = 256  # roster message ids remembered for idempotency


class RosterChanges:
    client: EpibusClient
    clock: Callable[[], datetime]

    @property
    def agent(self) -> str:
        return self.client.key.agent_id

    @property
    def store(self) -> MeshStore:
        raise NotImplementedError

    async def coordinators(self, project: str) -> tuple[str, ...]:
        return (await self.store.get_roster(project)).roster.coordinators

    async def add_coordinator(self, project: str, agent: str, *, message_id: uuid.UUID | None = None) -> Roster:
        """Add a coordinator. The first coordinator of a project may be added by anyone; after that only a
        coordinator may. Adding one already there changes nothing. Raises Forbidden."""
        return await self._change_roster(project, agent, "add", message_id or new_event_id())

    async def remove_coordinator(self, project: str, agent: str, *, message_id: uuid.UUID | None = None) -> Roster:
        """Remove a coordinator (only a coordinator may; the last one stays). Raises Forbidden, NotFound."""
        return await self._change_roster(project, agent, "remove", message_id or new_event_id())

    async def _change_roster(
        self, project: str, agent: str, change: Literal["add", "remove"], message_id: uuid.UUID
    ) -> Roster:
        async def attempt() -> Roster:
            entry = await self.store.get_roster(project)
            roster = entry.roster
            if message_id in roster.applied:
                await self._publish_roster(roster, agent, change, message_id)
                return roster
            current = set(roster.coordinators)
            if current and self.agent not in current:
                raise Forbidden(
                    self.agent,
                    f"{change} a coordinator of",
                    f"project {project}",
                    f"only its coordinators ({', '.join(sorted(current))}) may",
                )
            if change == "add":
                if agent in current:
                    return roster
                current.add(agent)
            else:
                if agent not in current:
                    raise NotFound("coordinator", agent, f"project {project} has {sorted(current) or 'none'}")
                if current == {agent}:
                    raise Forbidden(
                        self.agent, "remove", f"the last coordinator of project {project}", "add another one first"
                    )
                current.discard(agent)
            new = Roster(
                project=project,
                coordinators=tuple(sorted(current)),
                applied=(*roster.applied, message_id)[-KEEP_APPLIED_IDS:],
            )
            await self.store.write_roster(new, last=entry.revision)
            await self._publish_roster(new, agent, change, message_id)
            return new

        return await retry_on_conflict(attempt, what=f"coordinators of {project}")

    async def _publish_roster(
        self, roster: Roster, agent: str, change: Literal["add", "remove"], message_id: uuid.UUID
    ) -> Receipt:
        body = CoordinatorsEventBody(change=change, agent=agent, coordinators=roster.coordinators)
        return await self.client.publish(
            self.client.event(COORDINATORS_KIND, body, project=roster.project, event_id=message_id)
        )

    async def advertise(self, capabilities: Sequence[str]) -> AgentCapabilities:
        """Say what this agent can do (the capability-match policy assigns by it)."""
        try:
            advertised = AgentCapabilities.model_validate(
                {"agent": self.agent, "capabilities": sorted(set(capabilities)), "updated_at": self.clock()}
            )
        except ValidationError as e:
            raise raise_for_validation(e) from e
        await self.store.set_capabilities(advertised)
        return advertised
