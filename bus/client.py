"""The epibus client: connect, sign, publish with receipts, through the local outbox by default.

async with connect(agent="alice") as client:
    receipt = await client.publish(client.event("finding", {...}, project="demo"))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import PubAck
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from bus.auth import Enrolment
from bus.authority import NO_RECORDS, authorize
from bus.changes import StateChanges
from bus.connection import open_nats, requires_authentication
from bus.enrol import enrol_locally
from bus.errors import ConfigError, Forbidden, InvalidEvent, Unavailable
from bus.event import Envelope, draft_event
from bus.fleet import FleetRequests
from bus.forwarder import Forwarder
from bus.home import (
    NodeFollower,
    default_agent,
    epibus_home,
    explicit_nats_url,
    outbox_path,
    read_node_info,
    resolve_nats_url,
    split_servers,
)
from bus.ids import new_event_id
from bus.kinds import Body
from bus.loops import cancel_and_wait
from bus.nats_errors import NATS_UNAVAILABLE
from bus.outbox import Outbox, OutboxRow
from bus.precheck import prepublish_flags
from bus.publish import MAX_PUBLISH_ATTEMPTS, Receipt, retrying_unavailable, send_chunks, send_one
from bus.receipts import await_acks, journaled_receipt, wait_indexed, wait_journaled
from bus.registry import AgentRegistry
from bus.signing import AgentKey, PreparedEvent
from bus.state import decide
from bus.streams import ensure_streams
from bus.subjects import POLICY_PROJECT, cas_headers
from bus.tombstones import TombstoneRegistry
from bus.vocab import EpistemicSource, ReceiptLevel

log = logging.getLogger(__name__)
TOMBSTONE_CHECK_TIMEOUT_S = 2.0
SIGN_CHUNK = 256  # events signed per worker-thread call in publish_many, sent while the next chunk is signed
ENROLLED_CONNECT_S = 10.0  # how long a just-enrolled agent is refused by a cluster node that has not applied it yet


class EpibusClient(StateChanges, FleetRequests):
    """One agent's connection to the bus. Use as `async with`; see `connect()`."""

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
        # Called once when the server refuses this agent's key (not enrolled yet), then connecting is retried.
        self.enrol = enrol
        self.follow = follow  # the servers came from node.json: find the node again if it moves
        # Sign and outbox without connecting: receipts are `outboxed`, a node's forwarder sends the events later.
        self.offline = offline
        self.key = key
        self.session_id = session_id or str(new_event_id())
        self.goal_id = goal_id
        self.connect_timeout_s = connect_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.max_in_flight = max_in_flight
        self.replicas = replicas
        # A client's forwarder sends the rows it added (and orphans); a node drains everyone's.
        self.only_own_rows = only_own_rows
        self._outbox_path = outbox
        self.outbox: Outbox | None = None
        self.forwarder: Forwarder | None = None
        self.nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._tombstones: TombstoneRegistry | None = None
        self.unchecked_tombstones = 0  # publishes whose tombstone pre-check could not run (counted, logged)
        self.unchecked_links = 0  # linked claims published while offline, unchecked (counted, logged)
        self._tombstones_js: JetStreamContext | None = None
        self._streams_ready = False
        self._registry: AgentRegistry | None = None
        self.enrolment: Enrolment | None = None  # this agent's, once connected: its projects and roles
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._signer: ThreadPoolExecutor | None = None

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
        if self.offline and self._outbox_path is None:
            raise ConfigError("outbox", "an offline client needs the outbox: nothing else would keep its events")
        if self._outbox_path is not None:
            self.outbox = await Outbox(self._outbox_path).open()
            self._stack.push_async_callback(self.outbox.close)
        if self.offline:
            return
        if self.outbox is not None:
            self.forwarder = Forwarder(
                self.outbox,
                self._jetstream_if_connected,
                before_send=self._prepare_server,
                max_in_flight=self.max_in_flight,
                timeout_s=self.publish_timeout_s,
                only_own_rows=self.only_own_rows,
            )
            self._stack.push_async_callback(self.outbox.release_leases)
        group = await self._stack.enter_async_context(asyncio.TaskGroup())
        try:
            self.nc = await self._connect()
        except Unavailable:
            if self.outbox is None:
                raise
            log.warning("NATS unreachable at %s; events are kept in the outbox until it answers", self.servers)
            self._tasks.append(group.create_task(self._connect_in_background()))
        else:
            await self._prepare_server()
        if self.forwarder is not None:
            self._tasks.append(group.create_task(self.forwarder.run()))

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._tasks)
        try:
            if self.nc is not None and not self.nc.is_closed:
                try:
                    await self.nc.close()
                except NATS_UNAVAILABLE as e:  # the connection was already failing; unsent rows stay in the outbox
                    log.info("closing a failing NATS connection: %s %s", type(e).__name__, e)
        finally:
            if self._signer is not None:
                self._signer.shutdown(wait=True)  # at most one chunk of signatures in progress
                self._signer = None
            await self._stack.aclose()

    async def _connect(self) -> NatsClient:
        try:
            return await self._open_nats()
        except Forbidden:
            if self.enrol is None:
                raise
            enrolment = await self.enrol()
            self.enrol = None
        revoked = isinstance(enrolment, dict) and enrolment.get("revoked_at") is not None
        # Another node of a cluster may have answered the enrolment: this server lets the agent in once its own
        # keeper has applied the replicated registry (every few seconds). A revoked agent is refused at once.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Forbidden),
            stop=stop_after_delay(0 if revoked else ENROLLED_CONNECT_S),
            wait=wait_fixed(0.25),
            reraise=True,
        ):
            with attempt:
                return await self._open_nats()
        raise AssertionError("unreachable: tenacity re-raises the last Forbidden")

    async def _open_nats(self) -> NatsClient:
        return await open_nats(
            self.servers,
            name=f"epibus:{self.key.agent_id}",
            timeout_s=self.connect_timeout_s,
            follow=self.follow,
            key=self.key,
            reconnected_cb=self._on_reconnected,
            disconnected_cb=self._on_disconnected,
            error_cb=self._on_error,
        )

    async def _connect_in_background(self) -> None:
        while self.nc is None:
            try:
                self.nc = await self._connect()
            except Unavailable as e:
                log.info("still offline: %s", e)
                continue
            if self.forwarder is not None:
                self.forwarder.wake()

    async def _on_reconnected(self) -> None:
        self._streams_ready = False  # the server may be new or may have lost its store
        if self.forwarder is not None:
            self.forwarder.wake()

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        log.warning("disconnected from NATS; publishing continues into the outbox")

    async def _on_error(self, error: Exception) -> None:
        log.warning("NATS connection error: %s %s", type(error).__name__, error)

    @property
    def closed(self) -> bool:
        """True once close() began or the connection was closed for good (not merely reconnecting)."""
        return self._closing or (self.nc is not None and self.nc.is_closed)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def js(self) -> JetStreamContext:
        """One context per connection: each context owns the reply subscription of its async publishes."""
        if self.nc is None:
            where = ", ".join(self.servers) or "a node: none was running, so this client only outboxes"
            raise Unavailable("nats", f"not connected to {where}")
        if self._js is None:
            self._js = self.nc.jetstream(timeout=self.publish_timeout_s)
        return self._js

    def _jetstream_if_connected(self) -> JetStreamContext | None:
        return self.js if self.connected else None

    async def _prepare_server(self) -> None:
        """Streams exist and this agent's key is registered; re-run after every reconnect."""
        if self._streams_ready:
            return
        if not requires_authentication(self._require_nc()):  # with authentication the node keeps the streams
            await ensure_streams(self.js, replicas=self.replicas)
        self._registry = self._registry or AgentRegistry(self.js)
        await self._registry.bind(self.key.actor)
        self.enrolment = await self._registry.get(self.key.agent_id)
        self._streams_ready = True

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

    def _row(self, event: Envelope) -> OutboxRow:
        return self._signed_rows([self._item(event)])[0]

    def _item(self, event: Envelope) -> OutboxRow | PreparedEvent:
        """What publishing `event` sends: a signed event's row, or an unsigned event prepared for signing (its
        bytes made, so every check that can refuse it has run). Raises InvalidEvent or Forbidden."""
        item: OutboxRow | PreparedEvent
        if event.signature is None:
            item = self.key.prepare(event)
        elif event.actor != self.key.actor:
            raise InvalidEvent("actor", f"{event.actor.agent_id!r} is not this client's agent {self.key.agent_id!r}")
        else:
            item = OutboxRow.of(event)
        # The reserved project is refused by the authority rule that names it, not here.
        if event.project != POLICY_PROJECT:
            # The broker would refuse it (a timeout to nats-py); an outbox would retry it for ever.
            self.require_member(event.project, "publish in")
        return item

    def _signed_rows(self, items: Sequence[OutboxRow | PreparedEvent]) -> list[OutboxRow]:
        """The rows of `items` in order, the prepared ones signed now. Touches only bytes and text, so it may
        run on the signing thread."""
        prepared = [item for item in items if isinstance(item, PreparedEvent)]
        signatures = iter(self.key.sign_prepared(prepared))
        return [
            item if isinstance(item, OutboxRow) else OutboxRow.prepared(item, next(signatures), self.key.public_key)
            for item in items
        ]

    async def _signed_chunks(self, items: Sequence[OutboxRow | PreparedEvent]) -> AsyncGenerator[list[OutboxRow], None]:
        """The rows of `items` in order, SIGN_CHUNK at a time. The next chunk is signed on a worker thread while
        the caller sends this one (PyNaCl releases the GIL: the second core signs)."""
        if len(items) <= SIGN_CHUNK:  # nothing to overlap: a thread hop would only add latency
            yield self._signed_rows(items)
            return
        if self._signer is None:
            self._signer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epibus-sign")
        loop = asyncio.get_running_loop()
        chunks = [items[start : start + SIGN_CHUNK] for start in range(0, len(items), SIGN_CHUNK)]
        pending = [loop.run_in_executor(self._signer, self._signed_rows, chunk) for chunk in chunks[:2]]
        try:
            for index in range(len(chunks)):
                rows = await pending[index]
                if index + 2 < len(chunks):
                    pending.append(loop.run_in_executor(self._signer, self._signed_rows, chunks[index + 2]))
                yield rows
        finally:
            # Closed early (an error while sending): let the thread finish what it started, never leave it.
            unfinished = [future for future in pending if not future.done()]
            if unfinished:
                await asyncio.wait(unfinished)

    def require_member(self, project: str, action: str) -> None:
        """Raise Forbidden unless this agent's enrolment (known once connected) covers `project`: the broker
        confines an agent to its projects, and reads that do not pass the broker (a local journal) apply the same
        rule here. Before the first connect nothing is known, and nothing is refused."""
        enrolment = self.enrolment
        if enrolment is not None and not enrolment.member_of(project):
            raise Forbidden(
                self.key.agent_id,
                action,
                f"project {project}",
                f"it is enrolled in {', '.join(enrolment.projects)}; an admin adds the project with "
                f"`epibus agent add {self.key.agent_id} --key {self.key.public_key} --project {project}`",
            )

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
        level = self._wait_level(wait_for)
        items = [self._item(event) for event in events]
        for event in events:
            if event.project == POLICY_PROJECT:  # every store would reject it: only nodes write there
                authorize(event, 0, lambda _artifact_id: None, NO_RECORDS)
        if len(events) > 1 and len({event.event_id for event in events}) != len(events):
            raise InvalidEvent("event_id", "appears twice in one publish_many call")
        guard = await self._check_links(events)
        flags = await self._flags(events, strict=strict)
        deadline_s = timeout_s if timeout_s is not None else self.publish_timeout_s * max(1.0, len(events) / 2000)
        if guard is not None:
            receipts = [await self.publish_expecting(events[0], expected_headers=guard, timeout_s=timeout_s)]
        elif self.outbox is not None:
            rows = self._signed_rows(items)
            receipts = await self._publish_through_outbox(rows, 0.0 if level is ReceiptLevel.outboxed else deadline_s)
        else:
            receipts = await self._publish_direct(items)
        receipts = [replace(r, flags=flags[str(r.event_id)]) if flags.get(str(r.event_id)) else r for r in receipts]
        if level in (ReceiptLevel.journaled, ReceiptLevel.indexed):
            started = asyncio.get_running_loop().time()
            outcomes = await self.wait_journaled([r.event_id for r in receipts], timeout_s=deadline_s)
            receipts = [journaled_receipt(r, outcomes.get(str(r.event_id), {})) for r in receipts]
            if level is ReceiptLevel.indexed:  # the rest of the same deadline
                left_s = max(0.1, deadline_s - (asyncio.get_running_loop().time() - started))
                await self.wait_indexed([r.event_id for r in receipts], timeout_s=left_s)
                receipts = [replace(r, level=ReceiptLevel.indexed) for r in receipts]
        return receipts

    async def _check_links(self, events: Sequence[Envelope]) -> dict[str, str] | None:
        """Claims that revise or supersede another artifact are checked against the project as the stream has
        it (IllegalTransition, nothing written). A superseding claim changes the superseded artifact, so it is
        published alone with compare-and-set on that artifact's subjects: a verify, rollback or resolution of
        it landing meanwhile makes JetStream refuse the claim (Conflict). Two new claims superseding one
        artifact at once land on their own subjects; the projection applies the first and rejects the second
        with the reason (a `journaled` receipt says so). Returns the headers to use, else None."""
        linked = [e for e in events if not e.body.transition and (_link(e, "revises") or _link(e, "supersedes"))]
        if not linked:
            return None
        superseding = [e for e in linked if _link(e, "supersedes")]
        if superseding and len(events) > 1:
            raise InvalidEvent(
                "body.supersedes", "a superseding claim must be published on its own (publish), not in a batch"
            )
        if not self.connected:
            self.unchecked_links += len(linked)  # the journal's projection rejects what is illegal, with the reason
            log.warning("%d linked claim(s) published unchecked: NATS is not connected", len(linked))
            return None
        views = {project: await self.project_view(project) for project in {e.project for e in linked}}
        for event in events:
            view = views.get(event.project)
            if view is not None:
                fold = view.fold
                fold.absorb(decide(event, view.next_seq, fold.artifacts.get, lambda _h: False, view.authority))
        if not superseding:
            return None
        target = _link(superseding[0], "supersedes")
        assert target is not None
        view = views[superseding[0].project]
        return cas_headers(superseding[0].project, target, view.subject_seq.get(target, 0))

    def _wait_level(self, wait_for: ReceiptLevel | str) -> ReceiptLevel:
        allowed = [level.value for level in ReceiptLevel]
        try:
            level = ReceiptLevel(wait_for)
        except ValueError:
            raise ConfigError("wait_for", f"{wait_for!r} is not a receipt level", allowed=allowed) from None
        if level is ReceiptLevel.outboxed and self.outbox is None:
            raise ConfigError("wait_for", "'outboxed' needs the outbox; connect with outbox=True", allowed=allowed)
        if level in (ReceiptLevel.journaled, ReceiptLevel.indexed) and self.offline:
            raise ConfigError(
                "wait_for",
                f"'{level.value}' needs a running node and none runs (this client only outboxes); "
                "start one with `epibus up`, or wait for 'published' and get an `outboxed` receipt",
            )
        return level

    async def _flags(self, events: Sequence[Envelope], *, strict: bool) -> dict[str, tuple[str, ...]]:
        """Flags known before publishing; tombstones need NATS (checked within 2 s, else counted and left
        to the journal's projection, unless strict)."""
        registry = self.tombstones if self.connected else None
        flags, unchecked = await prepublish_flags(registry, events, strict=strict, timeout_s=TOMBSTONE_CHECK_TIMEOUT_S)
        self.unchecked_tombstones += len(unchecked)
        return flags

    @property
    def tombstones(self) -> TombstoneRegistry:
        if self._tombstones is None or self._tombstones_js is not self.js:
            self._tombstones, self._tombstones_js = TombstoneRegistry(self.js), self.js
        return self._tombstones

    # -- state changes ---------------------------------------------------------------------------------

    async def _publish_through_outbox(self, rows: list[OutboxRow], timeout_s: float) -> list[Receipt]:
        assert self.outbox is not None
        forwarder = self.forwarder  # None when offline: the rows wait for a node's forwarder
        # Register before the rows exist, or a forwarder mid-drain could send them unobserved.
        futures = {row.event_id: forwarder.sent(row.event_id) for row in rows} if forwarder is not None else {}
        acks: dict[str, tuple[int, bool]] = {}
        try:
            await self.outbox.add(rows)
            if forwarder is not None:
                forwarder.wake()
            if self.connected:
                acks = await await_acks(futures, self.outbox, timeout_s)
        finally:
            for future in futures.values():
                future.cancel()  # no-op when done; an unsent row keeps its place in the outbox
        receipts = []
        for row in rows:
            event_id = uuid.UUID(row.event_id)
            if row.event_id in acks:
                seq, duplicate = acks[row.event_id]
                receipts.append(Receipt(event_id, row.subject, ReceiptLevel.published, seq, duplicate))
            else:
                receipts.append(Receipt(event_id, row.subject, ReceiptLevel.outboxed))
        return receipts

    async def _publish_direct(self, items: Sequence[OutboxRow | PreparedEvent]) -> list[Receipt]:
        """Send straight to JetStream, each chunk as soon as it is signed; rows without a PubAck are retried
        (tenacity, same Nats-Msg-Id)."""
        acks: dict[str, PubAck] = {}
        rows: list[OutboxRow] = []  # signed so far, in order
        async with contextlib.aclosing(self._signed_chunks(items)) as chunks:
            try:
                async for attempt in retrying_unavailable():
                    with attempt:
                        if not self.connected:
                            raise Unavailable("nats", "not connected")
                        await self._prepare_server()
                        results = await send_chunks(
                            self.js,
                            _unacknowledged(rows, chunks, acks),
                            max_in_flight=self.max_in_flight,
                            timeout_s=self.publish_timeout_s,
                        )
                        for event_id, result in results.items():
                            if isinstance(result, PubAck):
                                acks[event_id] = result
                            elif not isinstance(result, Unavailable):
                                raise result  # Conflict or a refusal: retrying the same bytes cannot help
                        if len(acks) < len(items):
                            raise Unavailable("nats", f"{len(items) - len(acks)} event(s) got no PubAck")
            except Unavailable as e:
                raise Unavailable(
                    "nats",
                    f"{len(items) - len(acks)} of {len(items)} events not acknowledged after {MAX_PUBLISH_ATTEMPTS} "
                    f"attempts ({e.cause}); publishing the same events again is safe (ids dedupe)",
                ) from e
        return [
            Receipt(
                uuid.UUID(r.event_id),
                r.subject,
                ReceiptLevel.published,
                acks[r.event_id].seq,
                bool(acks[r.event_id].duplicate),
            )
            for r in rows
        ]

    async def publish_expecting(
        self, event: Envelope, *, expected_headers: dict[str, str], timeout_s: float | None = None
    ) -> Receipt:
        """The awaited publish for compare-and-set state changes: raises Conflict (never retried blindly),
        retries only Unavailable with the same Nats-Msg-Id. Bypasses the outbox: a stale expectation must
        fail now, not after an outage."""
        row = self._row(event)
        async for attempt in retrying_unavailable():
            with attempt:
                await self._prepare_server()
                ack = await send_one(
                    self.js, row, timeout_s=timeout_s or self.publish_timeout_s, extra_headers=dict(expected_headers)
                )
        return Receipt(event.event_id, row.subject, ReceiptLevel.published, ack.seq, bool(ack.duplicate))

    async def wait_journaled(self, event_ids: Sequence[uuid.UUID], *, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Return once a journal observer confirms every event id, with what the state projection made of
        each (status, reason, flags). Raises Unavailable naming what is missing."""
        return await wait_journaled(
            lambda: self.nc if self.connected else None, event_ids, signer=self.key, timeout_s=timeout_s
        )

    async def wait_indexed(self, event_ids: Sequence[uuid.UUID], *, timeout_s: float) -> None:
        """Return once a node's mirror has indexed every event id. Raises ConfigError when the nodes run no
        mirror, Unavailable naming what is missing."""
        await wait_indexed(lambda: self.nc if self.connected else None, event_ids, signer=self.key, timeout_s=timeout_s)

    def _require_nc(self) -> NatsClient:
        if self.nc is None or not self.connected:
            raise Unavailable("nats", f"not connected to {', '.join(self.servers)}")
        return self.nc

    async def outbox_depth(self) -> int:
        return await self.outbox.depth() if self.outbox is not None else 0


def _link(event: Envelope, name: str) -> str | None:
    value = getattr(event.body, name, None)
    return value if isinstance(value, str) else None


class connect:  # noqa: N801 - used like a function: `await connect()` or `async with connect()`
    """Connect an agent to the bus, finding the running local node unless `nats_url` is given (and following
    it to new ports if it restarts elsewhere).

    `outbox=True` (default) keeps events durable in `<home>/outbox.db` before sending; `outbox=False` sends
    directly and raises Unavailable when NATS does not answer. With no URL given and no node running, raises
    ConfigError, unless `offline_without_node`: then the client only outboxes (`EpibusClient.offline`) and the
    node's forwarder sends the events when it starts."""

    def __init__(
        self,
        nats_url: str | None = None,
        *,
        agent: str | None = None,
        home: Path | str | None = None,
        outbox: bool | Path = True,
        offline_without_node: bool = False,
        **options: Any,
    ) -> None:
        self.home = epibus_home(home)
        explicit = explicit_nats_url(nats_url)
        self.outbox = outbox_path(self.home) if outbox is True else (outbox or None)
        self.offline = (
            offline_without_node and explicit is None and self.outbox is not None and read_node_info(self.home) is None
        )
        self.servers = [] if self.offline else split_servers(resolve_nats_url(explicit, self.home))
        self.follow = NodeFollower(self.home, self.servers) if explicit is None and not self.offline else None
        self.key = AgentKey.load_or_create(self.home, agent or default_agent())
        self.options = options
        self._client: EpibusClient | None = None

    def _local_enrolment(self) -> Callable[[], Awaitable[object]] | None:
        """Agents under a node's home are enrolled with the node's key on first connect, unless the node runs
        with auto-enrolment off (`epibus up --no-auto-enrol`) or EPIBUS_AUTO_ENROL=0."""
        info = read_node_info(self.home)
        if (info is not None and not info.auto_enrol) or os.environ.get("EPIBUS_AUTO_ENROL", "1") == "0":
            return None
        servers, home, key = self.servers, self.home, self.key
        return lambda: enrol_locally(servers, home, key)

    async def _open(self) -> EpibusClient:
        options = {"enrol": self._local_enrolment()} | self.options
        client = EpibusClient(
            self.servers, self.key, outbox=self.outbox, follow=self.follow, offline=self.offline, **options
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


async def _unacknowledged(
    rows: list[OutboxRow], chunks: AsyncIterator[list[OutboxRow]], acks: dict[str, PubAck]
) -> AsyncIterator[list[OutboxRow]]:
    """What an attempt sends: the rows signed before it and not acknowledged, then the chunks still being
    signed (kept in `rows` for the next attempt)."""
    if rows:
        yield [row for row in rows if row.event_id not in acks]
    async for chunk in chunks:
        rows.extend(chunk)
        yield chunk
