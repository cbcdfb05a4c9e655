"""A node's authority over who may connect and act: it answers admins' enrolment requests (an agent asks, the
node records the change on the stream, then writes the registry) and keeps its embedded nats-server's
authorization in step with the registry.

Every enrolment change is first published as an `enrolment` record signed by the node's identity
(`bus.model.authority`): the stream orders it with the events it governs, so every path decides an event with the
enrolments as they stood at its place in the stream. Only then does the registry change, and with it what the
broker lets the agent do."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nkeys
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.nats_errors import JS_TIMEOUT_S
from bus.enrolment.enrolment_view import shared, shared_view
from bus.enrolment.registry import AgentRegistry
from bus.enrolment.service_rules import (
    Authorizer,
    ServiceGuard,
    admin_rule,
    current_asker,
    enrolled_rule,
)
from bus.errors import ConfigError, EpibusError
from bus.host.server import AUTHORIZATION_FILE, NatsServer
from bus.identity.signing import AgentKey, node_event_key
from bus.intake.admission import Admission
from bus.intake.batch_context import EnrolmentLog
from bus.model.auth import (
    ANY_PROJECT,
    DEFAULT_CONSUMER_SLOTS,
    FIRST_USE,
    NODE_PREFIX,
    Enrolment,
    first_use_enrolment,
    is_node_identity,
    render_authorization,
    reviewer_refusal,
)
from bus.model.authority import enrolment_event
from bus.model.fields import AGENT_PATTERN
from bus.model.requests import (
    MAX_VIEW_RECORDS,
    AgentListReply,
    AgentListRequest,
    EnrolmentReply,
    EnrolmentViewRecord,
    EnrolmentViewReply,
    EnrolmentViewRequest,
    EnrolRequest,
    RevokeRequest,
)
from bus.model.vocab import Identity, Role
from bus.outbox.outbox_file import OutboxRow
from bus.outbox.publish import retrying_unavailable, send_one
from bus.services.responder import Responder, Service, serve
from bus.services.review_policies import ReviewPolicies
from bus.subjects import (
    ADMIN_QUEUE,
    ENROL,
    ENROLMENT_VIEW,
    ENROLMENT_VIEW_QUEUE,
    LIST_AGENTS,
    REVOKE,
)

log = logging.getLogger(__name__)
KEEP_IN_STEP_EVERY_S = 2.0  # how soon an enrolment made through another node reaches this node's server


def local_agent_keys(keys: Path) -> list[tuple[str, Path]]:
    """The agents whose keys live in a home's `keys` directory (`<agent>.nk`), with each key's path, by name."""
    if not keys.is_dir():
        return []
    found = ((path.stem, path) for path in sorted(keys.glob("*.nk")))
    return [(agent, path) for agent, path in found if AGENT_PATTERN.fullmatch(agent)]


def initial_authorization(node: AgentKey) -> str:
    """What a server starts with before the registry is read: the node alone (a restart keeps the last file)."""
    return render_authorization([node.public_key], [])


def starting_authorization(store: Path, node: AgentKey) -> str:
    """What an authenticating embedded server starts with: the enrolments it last applied (kept in its store,
    so agents reconnect at once after a restart), else the node alone."""
    kept = store / AUTHORIZATION_FILE
    return kept.read_text() if kept.exists() else initial_authorization(node)


async def record_enrolment(js: JetStreamContext, signer: AgentKey, enrolment: Enrolment, *, session_id: str) -> int:
    """Publish an enrolment record signed by a node's identity (signing.node_event_key), retried while NATS does
    not answer. Returns its stream sequence: the change applies to events after it. Raises Unavailable."""
    event = enrolment_event(signer, enrolment, session_id=session_id)
    row = OutboxRow.of(event)
    async for attempt in retrying_unavailable():
        with attempt:
            ack = await send_one(js, row, timeout_s=JS_TIMEOUT_S)
    return int(ack.seq)


class Enrolments:
    """The enrol / revoke / list services and the authorization keeper of one node."""

    def __init__(
        self,
        js: JetStreamContext,
        node: AgentKey,
        server: NatsServer | None,
        *,
        node_name: str,
        local_keys: Path | None = None,
        consumer_slots: int = DEFAULT_CONSUMER_SLOTS,
    ) -> None:
        self.js = js
        self.consumer_slots = consumer_slots
        self.suspended: frozenset[str] = frozenset()  # keys over their publish budget (epibus/node/budget.py)
        self.events_held = False  # the node's disk is below its reserve (epibus/node/upkeep.py)
        self.local_keys = local_keys  # auto-enrolment: agents whose keys live under the node's home
        self.node = node
        self.server = server
        self.node_name = node_name
        self.registry = AgentRegistry(js)
        # Who signed each request to this node's services; a server to keep in step means the node authenticates.
        self.guard = ServiceGuard(self.registry, node.public_key, enforce=server is not None)
        self.signer = node_event_key(node)  # signs this node's enrolment records
        self.records = EnrolmentLog(js, Admission(self.registry))  # the stream's records, read on as they grow
        self._applied: str | None = None
        self._lock = asyncio.Lock()
        # On a fleet's leaf, agents' JetStream API subjects are stated in the hub's domain too (its server maps
        # them there before checking); on a hub, the joined nodes and pending invites are users as well.
        self.js_domain: str | None = None
        self._told_taken: set[str] = set()  # local agents whose name the fleet gave another key (logged once)
        self.taken_names = 0
        self.extra_users: Callable[[], list[dict[str, Any]]] = list

    async def start(self) -> int:
        """Before serving: enrol this node's identity (so its records are admitted where the registry is closed)
        and record on the stream every registry enrolment the stream's records do not show yet (made before
        records existed, or a change whose registry write was interrupted). Returns how many were recorded.
        Raises Unavailable."""
        me = self.signer.agent_id
        if await self.registry.get(me) is None:
            await self.registry.enrol(
                Enrolment(
                    agent_id=me,
                    public_key=self.signer.public_key,
                    owner=me,
                    roles=(Role.admin,),
                    projects=(ANY_PROJECT,),
                    enrolled_by=self.node_name,
                    enrolled_at=datetime.now(UTC),
                )
            )
        recorded = 0
        for enrolment in await self.registry.enrolments():
            if enrolment.agent_id.startswith(NODE_PREFIX) or enrolment.enrolled_by == FIRST_USE:
                continue  # a first-use binding grants nothing the records' default does not
            recorded += await self._record(enrolment)
        if recorded:
            log.info("recorded %d registry enrolment(s) on the stream", recorded)
        return recorded

    async def _record(self, enrolment: Enrolment) -> bool:
        """Publish the enrolment record, unless the stream's records already give the agent this standing (an
        agent enrolled as first use would stand: such an enrolment adds nothing to the stream). Returns whether
        it published one. Raises Unavailable."""
        authority = await self.records.read()
        standing = authority.record(enrolment.agent_id, authority.last_seq + 1) or first_use_enrolment(
            enrolment.agent_id, enrolment.public_key, enrolled_at=enrolment.enrolled_at
        )
        if standing.same_standing(enrolment):
            return False
        await record_enrolment(self.js, self.signer, enrolment, session_id=self.node_name)
        return True

    async def _change(self, enrolment: Enrolment, *, replace_key: bool = False) -> None:
        """Record the change on the stream, then write the registry. If the write fails after the record was
        published, the registry's record (or, for an agent it never held, a revocation) is recorded again so
        the stream does not grant what the registry refused."""
        await self.registry.check_enrol(enrolment, replace_key=replace_key)
        recorded = await self._record(enrolment)
        try:
            await self.registry.enrol(enrolment, replace_key=replace_key)
        except EpibusError:
            if recorded:
                current = await self.registry.get(enrolment.agent_id)
                await self._record(current or enrolment.revoked(datetime.now(UTC)))
            raise

    async def serve(self, nc: NatsClient) -> dict[str, Responder[Any, Any]]:
        name, queue = self.node_name, ADMIN_QUEUE
        admin: Authorizer[Any] = self.guard.authorizer(admin_rule, always=True)  # on any server: admins only
        policies = ReviewPolicies(self.js, self.signer, self.records, self.guard, node_name=name)
        return await policies.serve(nc) | {
            ENROL: await serve(
                nc, ENROL, EnrolRequest, EnrolmentReply, self._enrol, node=name, authorize=admin, queue=queue
            ),
            REVOKE: await serve(
                nc, REVOKE, RevokeRequest, EnrolmentReply, self._revoke, node=name, authorize=admin, queue=queue
            ),
            LIST_AGENTS: await serve(
                nc, LIST_AGENTS, AgentListRequest, AgentListReply, self._list, node=name, authorize=admin, queue=queue
            ),
        }

    def view_service(self) -> Service[EnrolmentViewRequest]:
        """What an agent may see of the fleet's enrolments (`bus.enrolment.enrolment_view`): any enrolled agent
        asks, and sees the agents it shares a project with, cut to the projects shared, and the nodes."""

        async def answer(request: EnrolmentViewRequest) -> EnrolmentViewReply:
            asker = current_asker()
            scope = None if asker is None or asker.enrolment is None else list(asker.enrolment.projects)
            visible = shared_view((await self.records.read()).in_order(), scope)
            after = [(seq, e) for seq, e in visible if seq > request.after_seq]
            page = after[:MAX_VIEW_RECORDS]
            more = len(after) > len(page)
            last_seq = page[-1][0] if more else max(request.after_seq, self.records.last_seq)
            nodes, node_keys = await self.registry.node_identities()
            asked = [(0, e) for agent in request.agents if (e := await self.registry.get(agent)) is not None]
            seen = {e.agent_id for _, e in visible} | ({asker.agent_id} if asker is not None else set())
            current = shared_view(asked, scope, also=seen)
            return EnrolmentViewReply(
                node=self.node_name,
                records=[EnrolmentViewRecord(seq=seq, enrolment=shared(e)) for seq, e in page],
                last_seq=last_seq,
                more=more,
                scope=scope,
                current=[shared(e) for _, e in current],
                nodes=[shared(e) for e in nodes],
                node_keys=node_keys,
            )

        return Service(
            ENROLMENT_VIEW,
            EnrolmentViewRequest,
            EnrolmentViewReply,
            answer,
            enrolled_rule,
            queue=ENROLMENT_VIEW_QUEUE,
        )

    async def _enrol(self, request: EnrolRequest) -> EnrolmentReply:
        if request.agent_id.startswith(NODE_PREFIX):
            why = f"{request.agent_id!r}: ids starting {NODE_PREFIX!r} name nodes; choose another name"
            raise ConfigError("agent_id", why)
        if Role.reviewer in request.roles and request.identity is not Identity.person:
            raise ConfigError("roles", reviewer_refusal(request.agent_id))
        enrolment = Enrolment(
            agent_id=request.agent_id,
            public_key=request.public_key,
            owner=request.owner or request.agent_id,
            roles=tuple(dict.fromkeys(request.roles)),
            projects=tuple(dict.fromkeys(request.projects)),
            enrolled_by=self.node_name,
            enrolled_at=datetime.now(UTC),
            identity=request.identity,
        )
        if request.if_absent:  # a client enrolling itself never demotes, re-keys or un-revokes an agent
            # Its standing is a first use's (every project, its own owner): nothing to record on the stream.
            if await self.registry.enrol_if_absent(enrolment) is None:
                # Enrolled already, perhaps a moment ago by this node's keeper, which may not have reloaded the
                # server yet: apply (it waits for the keeper's pass) so that the agent's next connect is let in.
                await self.apply()
                return self._reply(await self.registry.require(request.agent_id))
        else:
            await self._change(enrolment, replace_key=request.replace_key)
        self.guard.drop(enrolment.agent_id)
        await self.apply()
        return self._reply(enrolment)

    def _reply(self, enrolment: Enrolment) -> EnrolmentReply:
        return EnrolmentReply(node=self.node_name, enrolment=enrolment.model_dump(mode="json"))

    async def _revoke(self, request: RevokeRequest) -> EnrolmentReply:
        enrolment = await self.registry.require(request.agent_id)
        if enrolment.active:
            enrolment = enrolment.revoked(datetime.now(UTC))
            await self._change(enrolment)
        self.guard.drop(enrolment.agent_id)
        await self.apply()
        return self._reply(enrolment)

    async def _list(self, request: AgentListRequest) -> AgentListReply:
        agents = [e.model_dump(mode="json") for e in await self.registry.enrolments()]
        return AgentListReply(node=self.node_name, agents=agents)

    async def hold_events(self, held: bool) -> None:
        """While `held` (the node's disk is below its reserve) no agent publishes events; asking nodes, and so
        reading through them, goes on."""
        if held != self.events_held:
            self.events_held = held
            await self.apply()

    async def suspend(self, keys: frozenset[str]) -> None:
        """Suspend exactly these agent keys at the broker (over their publish budget); the rest publish again."""
        self.suspended = keys
        await self.apply()

    async def agent_keys(self) -> dict[str, str]:
        """Every active enrolled agent's key and id (the node's identities excluded)."""
        return {
            e.public_key: e.agent_id
            for e in await self.registry.enrolments()
            if e.active and not is_node_identity(e.agent_id, e.public_key)
        }

    async def apply(self) -> bool:
        """Render the authorization from the registry and reload the embedded server if it changed. Returns
        whether it changed. Raises Unavailable."""
        if self.server is None:
            return False
        async with self._lock:
            enrolments = await self.registry.enrolments()
            if await self._enrol_local_agents({e.agent_id: e.public_key for e in enrolments}):
                enrolments = await self.registry.enrolments()  # read again only when a local agent was added
            text = render_authorization(
                [self.node.public_key],
                enrolments,
                consumer_slots=self.consumer_slots,
                suspended=self.suspended,
                events_held=self.events_held,
                js_domain=self.js_domain,
                extra_users=self.extra_users(),
            )
            if text == self._applied:
                return False
            await asyncio.to_thread(self.server.authorize, text)
            self._applied = text
            log.info("server authorization updated from the agent registry")
            return True

    async def _enrol_local_agents(self, known: dict[str, str]) -> bool:
        """Agents created under the node's home (their keys in `<home>/keys`) are enrolled as the local user's,
        like a client enrolling itself with the node's key: an agent of every project, its own owner. This covers
        events they signed while no node ran, which the node forwards from the home's outbox. `known`: the agents
        the registry holds and their keys. Returns whether it enrolled any."""
        if self.local_keys is None:
            return False
        enrolled = False
        for agent_id, path in local_agent_keys(self.local_keys):
            try:
                key = AgentKey(agent_id, path.read_bytes().strip())
            except (OSError, ValueError, nkeys.ErrInvalidSeed) as e:
                log.warning("cannot read the key %s (%s); it is not enrolled", path, e)
                continue
            if agent_id in known:
                # enrolled already (perhaps revoked: never re-enrolled behind an admin's back), or by another
                # key: agent ids are the fleet's, and another host's agent of that name holds it
                if known[agent_id] != key.public_key and agent_id not in self._told_taken:
                    self._told_taken.add(agent_id)
                    self.taken_names += 1
                    log.error(
                        "local agent %s (%s) cannot connect: the fleet enrolled that name with another key (an agent "
                        "of another home or host); give this one another name (--agent), or an admin moves the name "
                        "to this key: epibus agent add %s --key %s --replace-key -p P",
                        agent_id, path, agent_id, key.public_key,
                    )  # fmt: skip
                continue
            first_use = first_use_enrolment(agent_id, key.public_key, enrolled_at=datetime.now(UTC))
            if await self.registry.enrol_if_absent(first_use) is not None:  # else enrolled meanwhile: that stands
                log.info("enrolled local agent %s", agent_id)
                enrolled = True
        return enrolled

    async def keep_in_step(self) -> None:
        """Re-apply the registry every few seconds: enrolments written through other nodes, new durables."""
        while True:
            await self.apply()
            await asyncio.sleep(KEEP_IN_STEP_EVERY_S)
