"""The mesh's only writer: a node service that applies what agents ask (epibus.mesh.step / roster / advertise,
one node of the `epibus-mesh` queue group answers each request).

A request is signed by the agent it speaks for, whose key must be registered to it (on a closed registry: an
enrolled, active member of the project). The node re-reads the task and the roster (verified, like every
reader), applies the message with the protocol's own `advance` and the roster rules, checks that the agent's
signature covers exactly the step (or roster change, or capabilities) that makes, and writes it with
compare-and-set. Refusals come back as the error the node raised."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import ValidationError

from bus.enrolment.recent import RecentEnrolments
from bus.enrolment.service_rules import Asker, Authorizer
from bus.errors import Conflict, Forbidden, InvalidEvent, NotFound
from bus.identity.signing import (
    NODE_IDENTITY,
    REQUEST_MAX_AGE_S,
    AgentKey,
    RequestSigner,
    verify_document,
    verify_request,
    verify_signature,
)
from bus.model.auth import Enrolment, inbox_owner
from bus.model.event import Actor, invalid_event_of
from bus.model.vocab import Role
from bus.services.responder import Responder, serve
from bus.subjects import MESH_ADVERTISE, MESH_QUEUE, MESH_ROSTER, MESH_STEP
from mesh.events import roster_event, verify_step
from mesh.protocol import NO_COORDINATORS, advance, counter_record, roster_after, who_may
from mesh.store import MeshStore, ensure_counter_task, utc_now
from mesh.task import CAPABILITIES_PURPOSE, Roster, RosterChange
from mesh.trust import roster_authority
from mesh.vocab import TaskAction
from mesh.wire import (
    REFUSABLE,
    AdvertiseRequest,
    MeshReply,
    MeshRequest,
    RosterRequest,
    StepRequest,
    refusal_of,
    require_fresh,
)

log = logging.getLogger(__name__)
# Requests a node answers at once: each waits on the server (reads, a compare-and-set write); two on one task
# are ordered by that compare-and-set, never by arrival.
MESH_CONCURRENCY = 64


class MeshService:
    """A node's mesh writer. `clock` judges deadlines and signed times (a test may share its agents' clock)."""

    def __init__(
        self,
        js: JetStreamContext,
        key: AgentKey,
        *,
        node: str,
        replicas: int | None = None,
        clock: Callable[[], datetime] = utc_now,
        max_skew_s: float = REQUEST_MAX_AGE_S,
    ) -> None:
        self.key = key
        self.node = node
        self.clock = clock
        self.max_skew_s = max_skew_s
        self.store = MeshStore(js, replicas=replicas)
        self.registry = self.store.registry
        self._standings: RecentEnrolments[tuple[str, str], Enrolment | None] = RecentEnrolments()

    async def serve(self, nc: NatsClient) -> dict[str, Responder[Any, Any]]:
        """Record this node's key (what it signs as operator is then verifiable) and answer the mesh subjects."""
        await self.store.bucket()
        await self.registry.register_node(self.key.public_key, self.node)
        services: dict[str, Responder[Any, Any]] = {}
        for subject, model, handle in (
            (MESH_STEP, StepRequest, self._step),
            (MESH_ROSTER, RosterRequest, self._roster),
            (MESH_ADVERTISE, AdvertiseRequest, self._advertise),
        ):
            services[subject] = await serve(
                nc,
                subject,
                model,
                MeshReply,
                handle,
                node=self.node,
                authorize=self._authorizer(model),
                queue=MESH_QUEUE,
                concurrency=MESH_CONCURRENCY,
            )
        return services

    # -- who asks ----------------------------------------------------------------------------------------

    def _authorizer(self, model: MeshRequest) -> Authorizer[Any]:
        """Who asks, before the body is read (the signature and the signer's standing), then whether the
        request speaks for its signer in a project it belongs to. Answers go to inboxes only."""

        async def identify(msg: Msg) -> Asker:
            signer = verify_request(msg.headers, msg.subject, msg.reply, msg.data, now=datetime.now(UTC))
            return Asker(signer.agent_id, signer.public_key, msg.subject, await self._standing(signer, msg.subject))

        def rule(asker: Asker, request: Any) -> None:
            if (asker.agent_id, asker.public_key) != (request.actor, request.public_key):
                raise asker.refuse(f"the request speaks for {request.actor}: an agent asks as itself")
            if request.project is not None and not asker.member_of(request.project):
                raise asker.refuse(f"it is not a member of project {request.project}")

        return Authorizer(lambda reply: inbox_owner(reply) is not None, identify, rule)

    async def _standing(self, signer: RequestSigner, subject: str) -> Enrolment | None:
        """The signer's enrolment; None for a node (its operator) and on a registry without enrolment, where the
        key is bound on first use. Raises Forbidden for a key that is not the one enrolled, or revoked. A
        standing found is reused for ENROLMENT_CACHE_S, as every node service does (a revocation takes effect
        within it)."""
        return await self._standings.get(
            (signer.agent_id, signer.public_key), lambda: self._read_standing(signer, subject)
        )

    async def _read_standing(self, signer: RequestSigner, subject: str) -> Enrolment | None:
        if signer.agent_id == NODE_IDENTITY and await self.registry.is_node_key(signer.public_key):
            return None
        try:
            if not await self.registry.is_closed():
                await self.registry.bind(Actor(agent_id=signer.agent_id, public_key=signer.public_key))
                return None
            enrolment = await self.registry.get(signer.agent_id)
        except Conflict as e:
            raise Forbidden(signer.agent_id, "ask", subject, f"its key is not the one registered to it ({e})") from e
        if enrolment is None or enrolment.public_key != signer.public_key or not enrolment.active:
            raise Forbidden(signer.agent_id, "ask", subject, "the signing key is not an enrolled agent's")
        return enrolment

    # -- what it asks ------------------------------------------------------------------------------------

    async def _step(self, request: StepRequest) -> MeshReply:
        return await self._answered(self._apply_step(request))

    async def _roster(self, request: RosterRequest) -> MeshReply:
        return await self._answered(self._apply_roster(request))

    async def _advertise(self, request: AdvertiseRequest) -> MeshReply:
        return await self._answered(self._apply_advertise(request))

    async def _answered(self, work: Awaitable[int]) -> MeshReply:
        """The handler's answer: the revision written, or the error the node refused with."""
        try:
            return MeshReply(node=self.node, revision=await work)
        except REFUSABLE as e:
            log.info("mesh request refused: %s", e)
            return MeshReply(node=self.node, refused=refusal_of(e))

    async def _apply_step(self, request: StepRequest) -> int:
        message = request.message
        where = f"task {message.task_id} {message.action}"
        require_fresh(request.at, self.clock(), self.max_skew_s, field=f"{where}.at")
        roster = (await self.store.get_roster(message.project)).roster
        # The revision the agent decided on, verified here before (the node wrote it, or read it) against this
        # roster: no read. The compare-and-set below refuses it if it is no longer current.
        entry = self.store.known_task(message.project, message.task_id, roster)
        if entry is None or entry.revision != request.revision:
            entry = await self.store.get_task(message.project, message.task_id)
        revision = entry.revision if entry is not None else 0
        if revision != request.revision:
            raise Conflict(
                f"task {message.task_id}", f"revision {request.revision} is no longer current", lost_race=True
            )
        if entry is None and message.action is not TaskAction.propose:
            raise NotFound("task", message.task_id, f"project {message.project} has no such task")
        if roster.version != request.roster_version:
            raise Conflict(f"coordinators of {message.project}", "they changed meanwhile", lost_race=True)
        if message.action is TaskAction.propose and not roster.coordinators:
            raise NotFound("project", message.project, f"task {message.task_id} cannot be proposed: {NO_COORDINATORS}")
        record = advance(
            entry.record if entry is not None else None,
            message,
            coordinators=frozenset(roster.coordinators),
            now=request.at,
            roster_version=roster.version,
        )
        record = request.signed(record)
        step = record.last_step
        try:
            await verify_step(record, len(record.steps) - 1, self.registry)
            if step.action is TaskAction.change:
                await verify_step(counter_record(step), 0, self.registry)
        except (InvalidEvent, Conflict) as e:
            rule = f"its signature does not cover the step the node made of the message ({e})"
            raise Forbidden(message.sender, message.action.value, f"task {message.task_id}", rule) from e
        written = await self.store.write_made_task(record, roster, last=revision)
        if step.action is TaskAction.change:
            await ensure_counter_task(self.store, step)
        return written

    async def _apply_roster(self, request: RosterRequest) -> int:
        project = request.project
        require_fresh(request.at, self.clock(), self.max_skew_s, field=f"coordinators of {project}.at")
        entry = await self.store.get_roster(project)
        roster = entry.roster
        if entry.revision != request.revision or roster.change_for(request.message_id) is not None:
            raise Conflict(
                f"coordinators of {project}", f"revision {request.revision} is no longer current", lost_race=True
            )
        current = frozenset(roster.coordinators)
        if await roster_authority(self.registry, request.sender, request.public_key, current) is None:
            raise Forbidden(request.sender, f"{request.change} a coordinator of", f"project {project}", who_may(roster))
        after = roster_after(roster, request.change, request.agent, actor=request.sender)
        if request.change == "add":
            await self._require_seatable(request)
        change = RosterChange(
            message_id=request.message_id,
            change=request.change,
            agent=request.agent,
            coordinators=after,
            actor=request.sender,
            at=request.at,
            public_key=request.public_key,
            session_id=request.session_id,
            signature=request.signature,
        )
        try:
            changed = Roster(project=project, changes=(*roster.changes, change))
        except ValidationError as e:  # the roster's history is full
            raise invalid_event_of(e) from e
        try:
            verify_signature(roster_event(changed, changed.version - 1))
        except InvalidEvent as e:
            rule = f"its signature does not cover the change the node made of the request ({e})"
            raise Forbidden(request.sender, f"{request.change} a coordinator of", f"project {project}", rule) from e
        return await self.store.write_roster(changed, last=entry.revision)

    async def _require_seatable(self, request: RosterRequest) -> None:
        """On a closed registry a coordinator is an enrolled, active member of the project with the
        `coordinator` role."""
        if not await self.registry.is_closed():
            return
        agent, project = request.agent, request.project
        try:
            enrolment = await self.registry.get(agent)
        except Conflict as e:
            raise Forbidden(request.sender, "seat", f"{agent} in project {project}", str(e)) from e
        target = f"{agent} as a coordinator of project {project}"
        fix = f"enrol it with `epibus agent add {agent} --key KEY -p {project} --role coordinator`"
        if enrolment is None or not enrolment.active:
            raise Forbidden(request.sender, "seat", target, f"it is not an enrolled agent; {fix}")
        if not enrolment.member_of(project) or not enrolment.has_role(Role.coordinator):
            raise Forbidden(request.sender, "seat", target, f"it lacks the coordinator role or the project; {fix}")

    async def _apply_advertise(self, request: AdvertiseRequest) -> int:
        advertised = request.advertised
        require_fresh(advertised.updated_at, self.clock(), self.max_skew_s, field="capabilities.updated_at")
        try:
            verify_document(advertised.public_key, CAPABILITIES_PURPOSE, advertised.document(), advertised.signature)
        except InvalidEvent as e:
            raise Forbidden(advertised.agent, "advertise", "capabilities", f"they are not signed by it ({e})") from e
        return await self.store.set_capabilities(advertised)
