"""One MCP server, one agent: its key (the same `~/.epibus/keys/NAME.nk` every command signs with), its connection
to the bus, its mesh agent and the node's journal it reads. The connection is made on the first call that needs
it and made again after a failure, so the server outlives a node restart; nothing is ever signed with another
identity, and nothing a tool's arguments say changes who acts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bus.client.client import EpibusClient, connect
from bus.client.connection import requires_authentication
from bus.enrolment.recent import RecentEnrolments
from bus.enrolment.registry import AgentRegistry
from bus.errors import ConfigError, Forbidden, Unavailable
from bus.host.home import default_journal_url, epibus_home, person_refusal, read_node_info, resolve_journal_url
from bus.identity.signing import AgentKey
from bus.model.auth import AUDIT_ROLES, Enrolment
from mesh.agent import MeshAgent
from observers.journal import Journal

T = TypeVar("T")


@dataclass(frozen=True)
class SessionConfig:
    agent: str
    home: Path | None = None
    nats: str | None = None  # default: the local node (node.json), followed across restarts
    journal: str | None = None  # default: the local node's journal


log = logging.getLogger(__name__)
A_PERSON = "a person"  # what an MCP server never runs as


class AgentSession:
    """Use as `async with`. Every tool call goes through `client()` and `journal()`."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.home = epibus_home(config.home)
        self.key = AgentKey.load_or_create(self.home, config.agent)
        self._client: EpibusClient | None = None
        self._mesh: MeshAgent | None = None
        self._journal: Journal | None = None
        self._connecting = asyncio.Lock()
        self._opening_journal = threading.Lock()  # two first reads at once open one journal
        self._recent: RecentEnrolments[str, Enrolment | None] = RecentEnrolments()

    @property
    def agent(self) -> str:
        return self.key.agent_id

    async def __aenter__(self) -> AgentSession:
        return self

    async def refuse_a_person(self) -> None:
        """At start: raise Forbidden when the key this server signs with is enrolled as a person's (a model sits
        behind an MCP server). A node that does not answer yet, or a key it does not know, is left to the first
        call, which reports it."""
        try:
            await self.enrolment()
        except (Unavailable, ConfigError) as e:  # no node yet: the first call asks again, and says so
            log.warning("epibus mcp: no answer from a node at start (%s); the first call asks again", e)
        except Forbidden as e:
            if e.target == A_PERSON:
                raise
            log.warning("epibus mcp: %s", e)

    async def __aexit__(self, *exc_info: object) -> None:
        await self._drop_client()
        if self._journal is not None:
            await asyncio.to_thread(self._journal.close)

    async def client(self) -> EpibusClient:
        """The agent's connection, made now if there is none (or the last one closed). Without an outbox: a
        node that does not answer is Unavailable now, never a client that runs on unconfined. Raises
        Unavailable, ConfigError (no node here) or Forbidden (the key is not enrolled)."""
        async with self._connecting:
            if self._client is not None and self._client.closed:
                await self._drop_client()
            if self._client is None:
                self._client = await connect(
                    self.config.nats, agent=self.config.agent, home=self.config.home, outbox=False
                )
                self._recent.put(self.agent, self._client.enrolment)  # read by the connect itself
            return self._client

    async def mesh(self) -> MeshAgent:
        client = await self.client()
        if self._mesh is None or self._mesh.client is not client:
            self._mesh = MeshAgent(client)
        return self._mesh

    async def _drop_client(self) -> None:
        client, self._client, self._mesh = self._client, None, None
        if client is not None:
            await client.close()

    async def enrolment(self) -> Enrolment | None:
        """This agent's enrolment as the registry has it now (re-read after ENROLMENT_CACHE_S, so a change an
        admin made reaches a long-running server), or None on a server that does not authenticate (there every
        agent stands as a first-use member of every project). Raises Forbidden when an authenticating server's
        registry holds no enrolment for it: nothing is read unconfined."""
        client = await self.client()
        if client.nc is None or not requires_authentication(client.nc):
            return None
        client.enrolment = await self._recent.get(self.agent, lambda: AgentRegistry(client.js).get(self.agent))
        if client.enrolment is not None and client.enrolment.is_person:
            raise Forbidden(self.agent, "run an MCP server as", A_PERSON, person_refusal(self.agent))
        if client.enrolment is None:
            raise Forbidden(
                self.agent, "read", "anything", "it is not enrolled; an admin enrols it with `epibus agent add`"
            )
        return client.enrolment

    async def require_member(self, project: str) -> None:
        """Reads from the journal do not pass the broker, so the broker's project confinement (the client's rule,
        with the enrolment read again) is applied here."""
        await self.enrolment()
        (await self.client()).require_member(project, "read")

    async def require_auditor(self, project: str, door: str) -> None:
        """The audit doors show retracted and rolled-back claims: reviewers and admins only, on a server that
        authenticates (the same rule the recall service applies to audit recall)."""
        await self.require_member(project)
        enrolment = await self.enrolment()
        if enrolment is not None and not any(enrolment.has_role(role) for role in AUDIT_ROLES):
            roles = ", ".join(enrolment.roles)
            raise Forbidden(self.agent, "read through", door, f"it is for reviewers and admins (its roles: {roles})")

    async def read_journal(self, read: Callable[[Journal], T]) -> T:
        """Run a blocking journal read off the event loop."""
        journal = await asyncio.to_thread(self._open_journal)
        return await asyncio.to_thread(read, journal)

    def _open_journal(self) -> Journal:
        with self._opening_journal:
            return self._journal or self._open_journal_once()

    def _open_journal_once(self) -> Journal:
        if self._journal is None:
            url = resolve_journal_url(self.config.journal, self.home)
            explicit = self.config.journal is not None or read_node_info(self.home) is not None
            if not explicit and url == default_journal_url(self.home) and not (self.home / "journal.db").exists():
                # An empty journal made here would answer every read with nothing: "broken" would read as "none".
                raise Unavailable(
                    "journal",
                    f"no journal under {self.home}: run `epibus mcp` where a node runs (`epibus up`), "
                    "or pass --journal URL",
                )
            journal = Journal(url)
            journal.migrate()
            self._journal = journal
        return self._journal


@contextlib.asynccontextmanager
async def agent_session(config: SessionConfig) -> AsyncIterator[AgentSession]:
    async with AgentSession(config) as session:
        yield session
