"""The mirror observer: embeds every claim and upserts it as one point with the deterministic point id of
its event id, and carries every state transition into the payload of the affected artifacts' points,
so the safe door never shows a retracted, contradicted or rolled-back item once the transition is mirrored.

A store or model that fails raises Unavailable: the runner holds the batch and retries (the mirror reports
degraded, the journal is never blocked), and no placeholder vector is ever written."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from bus.errors import NotFound
from bus.intake.admission import Delivery, Refusal, conflict_refusal
from bus.intake.batch_context import batch_erased
from bus.model.erasure import erased_digests, with_erased
from bus.model.ids import point_id
from bus.model.state import REFUSED, ArtifactState, IdUse, decide, event_references, id_use
from observers.mirror.embed import Embedder
from observers.mirror.listener import IndexedClaim, MirrorListener
from observers.mirror.store import Filter, Point, VectorStore

if TYPE_CHECKING:
    from observers.journal import KeptEvent

STATE_FIELDS = (
    "trust",
    "lifecycle",
    "resolution",
    "superseded_by",
    "supersedes",
    "contradicted_by",
    "forgotten",
    "last_seq",
    "updated_at",
    "verified_by",
    "reviewed_by",
    "reviewed_at",
)


NO_RESOLUTION = "none"  # a payload's resolution when there is none: a filter can match it, it cannot match null


def state_payload(state: ArtifactState) -> dict[str, Any]:
    """An artifact's state as payload fields: its record (times as ISO text), the creation time in epoch
    seconds too, `actor` and `event_id` under the names recall filters and answers use."""
    record = state.to_record()
    return record | {
        "actor": state.author,
        "event_id": state.created_event_id,
        "created_ts": state.created_at.timestamp(),
        "resolution": record["resolution"] or NO_RESOLUTION,
    }


def payload_state(payload: Mapping[str, Any]) -> ArtifactState:
    resolution = payload.get("resolution")
    return ArtifactState.from_record({**payload, "resolution": None if resolution == NO_RESOLUTION else resolution})


class KeptEvents(Protocol):
    """Which event a journal keeps under each event id: the mirror writes only what its journal kept."""

    def kept_events(self, event_ids: Sequence[str]) -> Mapping[str, KeptEvent]:
        """Blocking. Ids that are absent are not journaled yet. Raises Unavailable."""
        ...


class MirrorObserver:
    """The runner's mirror sink. `name` is the durable consumer: mirrors sharing one store share it.

    It follows its node's journal on which event each id holds (the first in stream order): an event the journal
    refused is refused here too, and a repeat at another stream sequence changes nothing."""

    def __init__(
        self,
        store: VectorStore,
        embedder: Embedder,
        *,
        name: str,
        journal: KeptEvents,
        node: str = "local",
        journal_wait_s: float = 20.0,  # under the runner's ack wait (30 s), so a wait never causes a redelivery
        listener: MirrorListener | None = None,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.name = name
        self.node = node
        self.journal = journal
        self.journal_wait_s = journal_wait_s
        self.listener = listener  # told of each batch once it is written (watches)
        self.indexed = 0
        self.transitions = 0
        self.illegal = 0
        self.refused = 0

    async def handle(self, batch: Sequence[Delivery]) -> list[Refusal]:
        admitted, refused = await self._kept_by_journal(sorted(batch, key=lambda d: d.stream_seq))
        states = await self._prefetch(admitted)
        changed: dict[tuple[str, str], ArtifactState] = {}
        created: dict[tuple[str, str], Delivery] = {}
        forgotten: set[tuple[str, str]] = set()
        for delivery in admitted:
            event = delivery.event
            lookup = with_erased(
                partial(_state_of, states, event.project), delivery.erased, event.project, delivery.stream_seq
            )
            try:
                change = decide(event, delivery.stream_seq, lookup, _no_tombstones, delivery.authority)
            except REFUSED:
                self.illegal += 1  # the journal records why; the mirror mirrors only what the rules allow
                continue
            for state in change.artifacts:
                key = (state.project, state.artifact_id)
                if state.erased:
                    continue  # a forgotten artifact's state: its forget's history holds it, no point does
                if state.forgotten:  # gone, as in the journal: a later claim may use the id again
                    states[key] = None
                    changed.pop(key, None)
                    created.pop(key, None)
                    forgotten.add(key)
                    continue
                states[key] = changed[key] = state
            if not event.body.transition:
                created[(event.project, event.artifact_id)] = delivery
        await self._write(changed, created, forgotten)
        self.refused += len(refused)
        return refused

    async def _kept_by_journal(self, ordered: list[Delivery]) -> tuple[list[Delivery], list[Refusal]]:
        """The deliveries to apply (the events the journal keeps, at the sequence it kept them) and refusals
        for events that reuse a kept id with other content. Waits a while for a journal that lags behind."""
        erased = erased_digests(batch_erased(ordered))
        ids = sorted({str(d.event.event_id) for d in ordered} - set(erased))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.journal_wait_s
        while True:
            kept = await asyncio.to_thread(self.journal.kept_events, ids)
            missing = [i for i in ids if i not in kept]
            if not missing:
                break
            if loop.time() > deadline:
                # Not an outage (the journal answered): it lags far behind, or never kept the event (it
                # dead-lettered it). The runner spends a delivery; after the last one, the mirror dead-letters it.
                raise NotFound(
                    "journaled event",
                    missing[0],
                    f"{len(missing)} events of the batch are not in the node's journal after {self.journal_wait_s:g}s",
                )
            await asyncio.sleep(0.2)
        digests: dict[str, str | None] = {event_id: k.digest for event_id, k in kept.items()}
        digests.update(erased)  # ids a forget erased stay taken; the journal skipped those events too
        admitted: list[Delivery] = []
        refused: list[Refusal] = []
        for delivery in ordered:
            event_id = str(delivery.event.event_id)
            if id_use(digests, event_id, delivery.digest) is IdUse.conflict:
                refused.append(conflict_refusal(delivery, digests[event_id] or ""))
            elif event_id in kept and delivery.stream_seq == kept[event_id].stream_seq:
                admitted.append(delivery)  # else: a repeat of the kept event, or of an erased one
        return admitted, refused

    async def _write(
        self,
        changed: dict[tuple[str, str], ArtifactState],
        created: dict[tuple[str, str], Delivery],
        forgotten: set[tuple[str, str]],
    ) -> None:
        """Forgotten artifacts' points go first (a privacy delete: the content leaves the mirror, not just the
        safe door). Claims are indexed with the state they have at the end of the batch, so a change that
        arrives in the same batch as its claim is never lost."""
        if forgotten and self.listener is not None:  # first: a mirror without the points has forgotten it all
            await self.listener.forgotten(sorted(forgotten))
        for project, artifact_id in sorted(forgotten):
            where = Filter(equals={"project": project, "artifact_id": artifact_id})
            await self.store.delete(await self.store.point_ids(where))
            self.transitions += 1
        claims: list[tuple[Delivery, ArtifactState]] = []
        moved: list[ArtifactState] = []
        for key, state in changed.items():
            if key in created:
                claims.append((created[key], state))
                continue
            where = Filter(equals={"project": key[0], "artifact_id": key[1]})
            await self.store.set_payload(where, {k: v for k, v in state_payload(state).items() if k in STATE_FIELDS})
            moved.append(state)
            self.transitions += 1
        if moved and self.listener is not None:
            await self.listener.changed(moved)
        await self._index_claims(claims)

    async def _prefetch(self, batch: Sequence[Delivery]) -> dict[tuple[str, str], ArtifactState | None]:
        """Current states, read from the points' payloads, of every artifact the batch refers to."""
        wanted: dict[str, set[str]] = {}
        for delivery in batch:
            wanted.setdefault(delivery.event.project, set()).update(event_references(delivery.event))
        states: dict[tuple[str, str], ArtifactState | None] = {}
        for project, artifact_ids in wanted.items():
            ids = await self.store.point_ids(
                Filter(equals={"project": project}, any_of={"artifact_id": sorted(artifact_ids)})
            )
            for found in await self.store.retrieve(ids):
                state = payload_state(found.payload)
                states[(state.project, state.artifact_id)] = state
        return states

    async def _index_claims(self, claims: list[tuple[Delivery, ArtifactState]]) -> None:
        if not claims:
            return
        vectors = await self.embedder.embed([state.content for _, state in claims])
        points = [
            Point(point_id(delivery.event.event_id), vector, claim_payload(state, delivery, self.node))
            for (delivery, state), vector in zip(claims, vectors, strict=True)
        ]
        await self.store.upsert(points)
        self.indexed += len(points)
        if self.listener is not None:
            await self.listener.indexed(
                [
                    IndexedClaim(str(d.event.event_id), state, d.event.recorded_at, vector, d.stream_seq, d.authority)
                    for (d, state), vector in zip(claims, vectors, strict=True)
                ]
            )


def claim_payload(state: ArtifactState, delivery: Delivery, node: str) -> dict[str, Any]:
    """A claim's point payload: its state, the digest of the event that made it, when the stream stored it."""
    stream_ts = delivery.stream_time.timestamp() if delivery.stream_time is not None else None
    return state_payload(state) | {
        "node": node,
        "stream_seq": delivery.stream_seq,
        "stream_ts": stream_ts,
        "event_digest": delivery.digest,
        "evidence": _evidence(delivery),
    }


def _state_of(
    states: dict[tuple[str, str], ArtifactState | None], project: str, artifact_id: str
) -> ArtifactState | None:
    return states.get((project, artifact_id))


def _no_tombstones(_digest: str) -> bool:
    return False  # flags are the journal's business; the mirror carries trust and lifecycle


def _evidence(delivery: Delivery) -> list[dict[str, Any]]:
    evidence = getattr(delivery.event.body, "evidence", ())
    return [e.model_dump(mode="json") for e in evidence]
