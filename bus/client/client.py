"""The epibus client: connect, sign, publish with receipts, through the local outbox by default.

async with connect(agent="alice") as client:
    receipt = await client.publish(client.event("finding", {...}, project="demo"))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bus.broker.loops import cancel_and_wait
from bus.client.changes import StateChanges
from bus.client.connection import Connection
from bus.client.consume import DEFAULT_MAX_UNACKED, Consumer
from bus.client.dispatch import Dispatch
from bus.client.fleet import Asking, FleetRequests
from bus.client.pipeline import PublishPipeline
from bus.client.placement import Placement
from bus.client.prechecks import PublishChecks
from bus.client.project_view import ProjectView, ProjectViews
from bus.client.recall import RecallAnswer
from bus.client.watch import Watches
from bus.errors import ConfigError, Unavailable
from bus.host.home import NodeFollower
from bus.identity.signing import AgentKey
from bus.intake.cursor import Cursor
from bus.model.auth import Enrolment
from bus.model.event import Envelope, draft_event
from bus.model.forget import ForgetProof, ForgetReport
from bus.model.ids import new_event_id
from bus.model.kinds import Body
from bus.model.rollback import RollbackPlan
from bus.model.vocab import EpistemicSource, ReceiptLevel
from bus.model.watch import DEFAULT_THRESHOLD, DEFAULT_WATCH_DAYS, WatchView
from bus.outbox.forwarder import Forwarder
from bus.outbox.outbox import Outbox
from bus.outbox.publish import Receipt
from bus.outbox.receipts import wait_indexed, wait_journaled
from bus.outbox.signer import EventSigner
from bus.services.tombstone_registry import TombstoneRegistry

log = logging.getLogger(__name__)


class EpibusClient:
    """One agent's connection to the bus. Use as `async with`; see `connect()`. The work is done by its parts:
    `connection` (connecting, enrolment, the server prepared), `signer` (events into rows), `dispatch` (the
    outbox, its forwarder, direct sends), `checks` (what is refused or flagged before publishing), `views` (the
    project as the stream has it), `changes` (state changes), `fleet` (signed requests to the nodes) and `watches`
    (standing questions and the notices they push)."""

    def __init__(
        self,
        servers: Sequence[str],
        key: AgentKey,
        *,
        outbox: Path | None,
        session_id: str | None = None,
        goal_id: str | None = None,
        connect_timeout_s: float = 5.0,
        publish_timeout_s: float = 10.0,
        max_in_flight: int = 512,
        replicas: int | None = None,
        only_own_rows: bool = True,
        follow: NodeFollower | None = None,
        offline: bool = False,
        enrol: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.servers = list(servers)
        self.follow = follow  # the servers came from node.json: find the node again if it moves
        self.key = key
        self.replicas = replicas
        # Sign and outbox without connecting: receipts are `outboxed`, a node's forwarder sends the events later.
        self.offline = offline
        self.session_id = session_id or str(new_event_id())
        self.goal_id = goal_id
        self.publish_timeout_s = publish_timeout_s
        self.connection = Connection(
            servers,
            key,
            follow=follow,
            enrol=enrol,
            connect_timeout_s=connect_timeout_s,
            publish_timeout_s=publish_timeout_s,
            replicas=replicas,
        )
        self.signer = EventSigner(key)
        self.dispatch = Dispatch(
            self.connection, self.signer, outbox, max_in_flight=max_in_flight, only_own_rows=only_own_rows
        )
        self.connection.on_ready = self.dispatch.wake
        self.views = ProjectViews(self.connection)
        self.checks = PublishChecks(self.connection, self.views)
        self.pipeline = PublishPipeline(self.checks, self.dispatch, offline=offline)
        self.changes = StateChanges(self.views, self)
        self.fleet = FleetRequests(self.connection, self.views, self.changes, lambda: self.dispatch.outbox)
        self.watches = Watches(self.connection.require_nc, lambda: self.connection.js, key, lambda: self.closed)
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------------------

    async def __aenter__(self) -> EpibusClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the outbox (if any) and connect. Without an outbox an unreachable NATS raises Unavailable;
        with one, the client starts offline and a background task keeps connecting. A key registered to
        another agent raises Conflict. Whatever start raises, it leaves nothing open."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        if self.offline and self.dispatch.outbox_path is None:
            raise ConfigError("outbox", "an offline client needs the outbox: nothing else would keep its events")
        await self.dispatch.open(self._stack, offline=self.offline)
        if self.offline:
            return
        group = await self._stack.enter_async_context(asyncio.TaskGroup())
        try:
            await self.connection.open()
        except Unavailable:
            if self.outbox is None:
                raise
            log.warning("NATS unreachable at %s; events are kept in the outbox until it answers", self.servers)
            self._tasks.append(group.create_task(self.connection.keep_opening()))
        else:
            await self.connection.prepare()
        if self.forwarder is not None:
            self._tasks.append(group.create_task(self.forwarder.run()))

    async def close(self) -> None:
        self.connection.closing = True
        await cancel_and_wait(self._tasks)
        try:
            await self.connection.close()
        finally:
            self.signer.close()
            await self._stack.aclose()

    @property
    def closed(self) -> bool:
        """True once close() began or the connection was closed for good (not merely reconnecting)."""
        return self.connection.closed

    @property
    def connected(self) -> bool:
        return self.connection.connected

    @property
    def nc(self) -> NatsClient | None:
        return self.connection.nc

    @property
    def js(self) -> JetStreamContext:
        """One context per connection: each context owns the reply subscription of its async publishes."""
        return self.connection.js

    @property
    def enrolment(self) -> Enrolment | None:
        """This agent's enrolment, once connected: its projects and roles."""
        return self.connection.enrolment

    @enrolment.setter
    def enrolment(self, enrolment: Enrolment | None) -> None:
        self.connection.enrolment = enrolment

    @property
    def outbox(self) -> Outbox | None:
        return self.dispatch.outbox

    @property
    def forwarder(self) -> Forwarder | None:
        return self.dispatch.forwarder

    # -- events ----------------------------------------------------------------------------------------

    def event(
        self,
        kind: str,
        body: Body | dict[str, Any],
        *,
        project: str,
        artifact_id: str | None = None,
        source: EpistemicSource | str | None = None,
        goal_id: str | None = None,
        event_id: uuid.UUID | None = None,
        recorded_at: datetime | None = None,
    ) -> Envelope:
        """A new event by this agent, validated and signed. Raises InvalidEvent naming the field. Passing the
        same event_id and recorded_at again rebuilds the same signed bytes (ed25519 is deterministic)."""
        draft = self.draft(
            kind,
            body,
            project=project,
            artifact_id=artifact_id,
            source=source,
            goal_id=goal_id,
            event_id=event_id,
            recorded_at=recorded_at,
        )
        return self.key.sign(draft)

    def draft(
        self,
        kind: str,
        body: Body | dict[str, Any],
        *,
        project: str,
        artifact_id: str | None = None,
        source: EpistemicSource | str | None = None,
        goal_id: str | None = None,
        event_id: uuid.UUID | None = None,
        recorded_at: datetime | None = None,
    ) -> Envelope:
        """A new event by this agent, validated, not signed yet: `publish_many` signs drafts in bulk on a
        worker thread while it sends. Raises InvalidEvent naming the field."""
        return draft_event(
            kind,
            body,
            project=project,
            actor=self.key.actor,
            session_id=self.session_id,
            artifact_id=artifact_id,
            goal_id=goal_id or self.goal_id,
            source=source,
            event_id=event_id,
            recorded_at=recorded_at,
        )

    def require_member(self, project: str, action: str) -> None:
        """See PublishChecks.require_member: Forbidden unless this agent is enrolled in `project`."""
        self.checks.require_member(project, action)

    # -- consuming -------------------------------------------------------------------------------------

    def consume(
        self,
        project: str,
        *,
        kind: str | None = None,
        cursor: Cursor | None = None,
        from_start: bool = False,
        max_unacked: int = DEFAULT_MAX_UNACKED,
    ) -> Consumer:
        """One project's events as they reach the stream, each to `ack()` (see bus.client.consume): `async with
        client.consume("demo", cursor=FileCursor(path)) as events: async for received in events: ...`.
        Raises Forbidden unless this agent is a member of `project`, Unavailable when not connected."""
        self.require_member(project, "read")
        return Consumer(
            self.connection.require_nc(),
            project,
            kind=kind,
            cursor=cursor,
            from_start=from_start,
            max_unacked=max_unacked,
            registry=self.connection.registry,
        )

    # -- publishing ------------------------------------------------------------------------------------

    async def publish(
        self,
        event: Envelope,
        *,
        wait_for: ReceiptLevel | str = ReceiptLevel.published,
        timeout_s: float | None = None,
        strict: bool = False,
    ) -> Receipt:
        """Publish one event. Returns the level reached: `outboxed` when NATS did not answer in time (the
        forwarder sends it later), `published` on a PubAck, `journaled` when asked and confirmed.
        Raises InvalidEvent (nothing written), Conflict, or Unavailable (only without an outbox)."""
        (receipt,) = await self.publish_many([event], wait_for=wait_for, timeout_s=timeout_s, strict=strict)
        return receipt

    async def publish_many(
        self,
        events: Sequence[Envelope],
        *,
        wait_for: ReceiptLevel | str = ReceiptLevel.published,
        timeout_s: float | None = None,
        strict: bool = False,
    ) -> list[Receipt]:
        """Publish events in bulk with bounded in-flight async publishes; receipts in the input order.
        Every event is validated before anything is written: one bad event writes none. A claim whose
        content was retracted or rolled back before is flagged `previously_retracted` (refused if strict).
        Raises Forbidden for an event in project `epibus`, which holds the nodes' enrolment records."""
        return await self.pipeline.publish_many(events, wait_for=wait_for, timeout_s=timeout_s, strict=strict)

    async def publish_expecting(
        self, event: Envelope, *, expected_headers: dict[str, str], timeout_s: float | None = None
    ) -> Receipt:
        """The awaited publish for compare-and-set state changes: raises Conflict (never retried blindly),
        retries only Unavailable with the same Nats-Msg-Id. Bypasses the outbox: a stale expectation must
        fail now, not after an outage."""
        return await self.pipeline.expecting(event, expected_headers, timeout_s)

    async def wait_journaled(self, event_ids: Sequence[uuid.UUID], *, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Return once a journal observer confirms every event id, with what the state projection made of
        each (status, reason, flags). Raises Unavailable naming what is missing."""
        return await wait_journaled(self.connection.nc_if_connected, event_ids, signer=self.key, timeout_s=timeout_s)

    async def wait_indexed(self, event_ids: Sequence[uuid.UUID], *, timeout_s: float) -> None:
        """Return once a node's mirror has indexed every event id. Raises ConfigError when the nodes run no
        mirror, Unavailable naming what is missing."""
        await wait_indexed(self.connection.nc_if_connected, event_ids, signer=self.key, timeout_s=timeout_s)

    async def outbox_depth(self) -> int:
        return await self.dispatch.depth()

    # -- views and state changes (bus.client.project_view, bus.client.changes) -----------------------------------

    @property
    def tombstones(self) -> TombstoneRegistry:
        return self.views.tombstones

    async def project_view(self, project: str) -> ProjectView:
        """The project folded from the stream now (the client's view for validating state changes)."""
        return await self.views.project(project)

    async def change_view(self, event: Envelope) -> ProjectView:
        """What deciding `event` reads (see ProjectViews.for_change)."""
        return await self.views.for_change(event)

    async def transition(
        self,
        kind: str,
        body: Body | dict[str, Any],
        *,
        project: str,
        artifact_id: str,
        view: ProjectView | None = None,
        timeout_s: float | None = None,
    ) -> Receipt:
        """See StateChanges.transition: a state change published with compare-and-set on the artifact."""
        return await self.changes.transition(
            kind, body, project=project, artifact_id=artifact_id, view=view, timeout_s=timeout_s
        )

    async def plan_rollback(self, project: str, artifact_id: str, *, cascade: bool = False) -> RollbackPlan:
        """See StateChanges.plan_rollback; writes nothing."""
        return await self.changes.plan_rollback(project, artifact_id, cascade=cascade)

    async def rollback(
        self, project: str, artifact_id: str, *, reason: str, cascade: bool = False
    ) -> tuple[RollbackPlan, list[Receipt]]:
        """See StateChanges.rollback."""
        return await self.changes.rollback(project, artifact_id, reason=reason, cascade=cascade)

    # -- requests to the nodes (bus.client.fleet) -------------------------------------------------------------

    async def forget(
        self, project: str, artifact_id: str, *, reason: str, eraser: Asking | None = None
    ) -> ForgetReport:
        """See FleetRequests.forget: the privacy delete, then `prove_forgotten`."""
        return await self.fleet.forget(project, artifact_id, reason=reason, eraser=eraser)

    async def prove_forgotten(
        self, report: ForgetReport, *, scrub: bool = True, timeout_s: float = 10.0
    ) -> ForgetProof:
        """See bus.client.fleet.ask_forget_proof; signed by this client's key (`scrub` is for admins)."""
        return await self.fleet.prove_forgotten(report, scrub=scrub, timeout_s=timeout_s)

    async def verify_nodes(
        self, project: str | None = None, *, repair: bool = False, timeout_s: float = 60.0
    ) -> list[dict[str, Any]]:
        """See bus.client.fleet.ask_verify; signed by this client's key."""
        return await self.fleet.verify_nodes(project, repair=repair, timeout_s=timeout_s)

    async def reindex_nodes(
        self, progress: Callable[[str, int, int], None] | None = None, *, timeout_s: float = 1800.0
    ) -> list[dict[str, Any]]:
        """See bus.client.fleet.ask_reindex; signed by this client's key (an admin's)."""
        return await self.fleet.reindex_nodes(progress, timeout_s=timeout_s)

    async def recall(
        self,
        query: str,
        project: str,
        *,
        k: int = 10,
        kinds: list[str] | None = None,
        include_resolved: bool = False,
        as_of: datetime | None = None,
        timeout_s: float = 3.0,
    ) -> RecallAnswer:
        """See FleetRequests.recall: the safe door across every node's mirror."""
        return await self.fleet.recall(
            query, project, k=k, kinds=kinds, include_resolved=include_resolved, as_of=as_of, timeout_s=timeout_s
        )

    async def watch(
        self,
        about: str,
        project: str | Sequence[str],
        *,
        kinds: Sequence[str] | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        days: float = DEFAULT_WATCH_DAYS,
        audit: bool = False,
    ) -> WatchView:
        """Keep a standing question: every claim recorded from now on in the project(s) whose meaning is close to
        `about` is pushed to this agent (read them with `watches.notices()`). See Watches.register."""
        projects = [project] if isinstance(project, str) else list(project)
        return await self.watches.register(about, projects, kinds=kinds, threshold=threshold, days=days, audit=audit)

    async def audit_recall(
        self, query: str, project: str, *, k: int = 10, kinds: list[str] | None = None, timeout_s: float = 3.0
    ) -> RecallAnswer:
        """See FleetRequests.audit_recall: every mirrored item whatever its state."""
        return await self.fleet.audit_recall(query, project, k=k, kinds=kinds, timeout_s=timeout_s)


class connect:  # noqa: N801 - used like a function: `await connect()` or `async with connect()`
    """Connect an agent to the bus, finding the running local node unless `nats_url` is given (and following
    it to new ports if it restarts elsewhere).

    `outbox=True` (default) keeps events durable in `<home>/outbox.db` before sending; `outbox=False` sends
    directly and raises Unavailable when NATS does not answer. With no URL given and no node running, raises
    ConfigError, unless `offline_without_node`: then the client only outboxes (`EpibusClient.offline`) and the
    node's forwarder sends the events when it starts. `key`: sign as this identity (a person's key, unlocked for
    the command) rather than the agent's key in the home."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        agent: str | None = None,
        home: Path | str | None = None,
        outbox: bool | Path = True,
        offline_without_node: bool = False,
        key: AgentKey | None = None,
        **options: Any,
    ) -> None:
        self.placement = Placement.find(
            nats_url, agent=agent, home=home, outbox=outbox, offline_without_node=offline_without_node, key=key
        )
        self.options = options
        self._client: EpibusClient | None = None

    async def _open(self) -> EpibusClient:
        where = self.placement
        options = {"enrol": where.local_enrolment()} | self.options
        client = EpibusClient(
            where.servers, where.key, outbox=where.outbox, follow=where.follow, offline=where.offline, **options
        )
        await client.start()
        return client

    def __await__(self) -> Generator[Any, None, EpibusClient]:
        return self._open().__await__()

    async def __aenter__(self) -> EpibusClient:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.close()
