"""A confined agent's view of the fleet's enrolments, served by a node (`epibus.enrolments.view`): the records of
the agents it shares a project with, each cut to the projects it shares, the nodes' identities and keys. The
registry and the stream's enrolment records name every agent, key and project of the fleet: an agent reads
neither (the broker refuses it), it asks."""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable, Sequence

from nats.aio.client import Client as NatsClient

from bus.broker.ask import ask_one
from bus.broker.nats_errors import JS_TIMEOUT_S
from bus.errors import Unavailable
from bus.identity.signing import AgentKey
from bus.model.auth import ANY_PROJECT, Enrolment
from bus.model.requests import MAX_VIEW_RECORDS, EnrolmentViewReply, EnrolmentViewRequest, SharedEnrolment
from bus.subjects import ENROLMENT_VIEW

MAX_VIEW_PAGES = 1000  # a fleet's whole log is read in pages; past this many the node is answering in circles


def shared_view(
    records: Sequence[tuple[int, Enrolment]], projects: Iterable[str] | None, *, also: Collection[str] = ()
) -> list[tuple[int, Enrolment]]:
    """What an asker of `projects` (None: every project, a node's operator) may see of the records: every record of
    an agent that ever shared one of them (so a removal is seen too) or is named in `also`, cut to the projects
    shared."""
    if projects is None or ANY_PROJECT in (wanted := set(projects)):
        return list(records)
    seen = {e.agent_id for _, e in records if ANY_PROJECT in e.projects or wanted & set(e.projects)} | set(also)
    return [
        (seq, e.model_copy(update={"projects": tuple(p for p in e.projects if p == ANY_PROJECT or p in wanted)}))
        for seq, e in records
        if e.agent_id in seen
    ]


def shared(enrolment: Enrolment) -> SharedEnrolment:
    """The enrolment as a node shows it to an agent (the caller cuts its projects first: shared_view)."""
    return SharedEnrolment.model_validate_json(enrolment.model_dump_json())


def as_enrolment(shared: SharedEnrolment) -> Enrolment:
    """The record as the authority reads it (its projects may be none: it shares none of the asker's now)."""
    fields = shared.model_dump()
    return Enrolment.model_construct(
        **fields | {"roles": tuple(fields["roles"]), "projects": tuple(fields["projects"])}
    )


class EnrolmentView:
    """One confined connection's copy of what a node lets it see, read on from where it stopped."""

    def __init__(self, nc: NatsClient, key: AgentKey) -> None:
        self._nc = nc
        self._key = key
        self.records: list[tuple[int, Enrolment]] = []
        self.nodes: dict[str, Enrolment] = {}
        self.current: dict[str, Enrolment] = {}  # registry records asked for, by agent
        self.node_keys: set[str] = set()
        self.version = 0  # changes whenever `records` does
        self._last_seq = 0
        self._scope: list[str] | None = None  # the projects the records are cut to

    async def lookup(self, agent_id: str) -> Enrolment | None:
        """The agent's registry record now (a node's identity included), or None if it is not enrolled in a
        project this agent shares. Reads the records added meanwhile too. Raises Unavailable, Forbidden."""
        await self.refresh(agents=[agent_id])
        return self.current.get(agent_id) or self.nodes.get(agent_id)

    async def refresh(self, *, agents: Sequence[str] = ()) -> None:
        """Read the records added since the last read (and the asked agents' registry records). Raises
        Unavailable, Forbidden (revoked)."""
        for _ in range(MAX_VIEW_PAGES):
            request = EnrolmentViewRequest(after_seq=self._last_seq, agents=list(agents))
            reply = await ask_one(
                self._nc, ENROLMENT_VIEW, request, EnrolmentViewReply, signer=self._key, timeout_s=JS_TIMEOUT_S
            )
            if reply.scope != self._scope and self._last_seq:  # its projects changed: what it may see changed
                self.records, self._last_seq, self._scope = [], 0, reply.scope
                self.version += 1
                continue
            self._scope = reply.scope
            for agent in agents:
                self.current.pop(agent, None)
            self.current |= {e.agent_id: as_enrolment(e) for e in reply.current}
            agents = ()
            fresh = [(r.seq, as_enrolment(r.enrolment)) for r in reply.records if r.seq > self._last_seq]
            if fresh:
                self.records += fresh
                self.version += 1
            self._last_seq = max(self._last_seq, reply.last_seq)
            self.nodes = {n.agent_id: as_enrolment(n) for n in reply.nodes}
            self.node_keys = set(reply.node_keys)
            if not reply.more:
                return
        raise Unavailable("epibus node", f"{ENROLMENT_VIEW}: more than {MAX_VIEW_PAGES * MAX_VIEW_RECORDS} records")

    def latest(self, agent_id: str) -> Enrolment | None:
        """The agent's newest enrolment record in view (a node's identity from the registry), or None."""
        if agent_id in self.nodes:
            return self.nodes[agent_id]
        return next((e for _, e in reversed(self.records) if e.agent_id == agent_id), None)


_VIEWS: weakref.WeakKeyDictionary[NatsClient, EnrolmentView] = weakref.WeakKeyDictionary()


def enrolment_view(nc: NatsClient, key: AgentKey) -> EnrolmentView:
    """The connection's view (one per connection: every registry and log on it reads the same copy)."""
    view = _VIEWS.get(nc)
    if view is None:
        view = _VIEWS[nc] = EnrolmentView(nc, key)
    return view
