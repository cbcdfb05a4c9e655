"""Reconciling the three stores by event id (DESIGN §2): the stream is the truth, the journal must hold every
valid event once, the mirror a point for every claim the journal's projection holds, with that state in its
payload. The report names missing, extra and stale ids per store; `repair` makes the stores agree."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy import select

from bus.ids import point_id
from bus.reader import read_stream
from bus.runner import Delivery, Rejected, admit_event
from bus.subjects import STREAM, events_filter
from observers.journal import Journal
from observers.mirror.observer import STATE_FIELDS, MirrorObserver, state_payload
from observers.mirror.store import Filter, Point, VectorStore
from observers.projection import FORGOTTEN, row_to_state
from observers.schema import artifacts, events

SAMPLE = 10


@dataclass
class StoreReport:
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.extra or self.stale)

    def as_dict(self) -> dict[str, Any]:
        return {
            "missing": len(self.missing),
            "extra": len(self.extra),
            "stale": len(self.stale),
            "clean": self.clean,
            "sample_missing": self.missing[:SAMPLE],
            "sample_extra": self.extra[:SAMPLE],
            "sample_stale": self.stale[:SAMPLE],
        }


@dataclass
class VerifyReport:
    stream_events: int
    journal: StoreReport
    mirror: StoreReport | None
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return self.journal.clean and (self.mirror is None or self.mirror.clean)

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream_events": self.stream_events,
            "journal": self.journal.as_dict(),
            "mirror": self.mirror.as_dict() if self.mirror else None,
            "repaired": self.repaired,
            "clean": self.clean,
        }


async def _stream_deliveries(js: JetStreamContext, project: str | None) -> list[Delivery]:
    found: list[Delivery] = []
    async for messages in read_stream(js, STREAM, filter_subject=events_filter(project)):
        for msg in messages:
            try:
                event = admit_event(msg.subject, msg.data)
            except Rejected:
                continue  # dead-lettered by the live consumers, never journaled
            found.append(Delivery(event, msg.subject, msg.metadata.sequence.stream, 1, msg.metadata.timestamp))
    return found


def _journal_side(journal: Journal, project: str | None) -> tuple[set[str], dict[tuple[str, str], Any]]:
    with journal.engine.connect() as conn:
        query = select(events.c.event_id).where(events.c.status != FORGOTTEN)
        states_query = select(artifacts)
        if project is not None:
            query = query.where(events.c.project == project)
            states_query = states_query.where(artifacts.c.project == project)
        ids = set(conn.execute(query).scalars())
        states = {(r.project, r.artifact_id): row_to_state(r._mapping) for r in conn.execute(states_query)}
    return ids, states


async def verify(
    js: JetStreamContext,
    journal: Journal,
    mirror: MirrorObserver | None,
    *,
    project: str | None = None,
    repair: bool = False,
) -> VerifyReport:
    """Compare the stream, the journal and the mirror by event id. With repair: journal the missing events,
    index the missing claims, delete extra points, rewrite stale payloads; then report again."""
    deliveries = await _stream_deliveries(js, project)
    in_stream = {str(d.event.event_id): d for d in deliveries}
    journaled, states = await asyncio.to_thread(_journal_side, journal, project)
    journal_report = StoreReport(missing=sorted(set(in_stream) - journaled), extra=sorted(journaled - set(in_stream)))
    mirror_report = None
    if mirror is not None:
        mirror_report = await _mirror_side(mirror.store, states, project)
    report = VerifyReport(len(deliveries), journal_report, mirror_report)
    if not repair or report.clean:
        return report
    if journal_report.missing:
        await asyncio.to_thread(journal.write, [in_stream[e] for e in journal_report.missing])
    if mirror is not None and mirror_report is not None:
        _, states = await asyncio.to_thread(_journal_side, journal, project)
        await _repair_mirror(mirror, states, mirror_report, project)
    again = await verify(js, journal, mirror, project=project, repair=False)
    again.repaired = True
    return again


async def _mirror_side(store: VectorStore, states: dict[tuple[str, str], Any], project: str | None) -> StoreReport:
    expected = {point_id(uuid.UUID(s.created_event_id)): s for s in states.values()}
    present = set(await store.point_ids(Filter(equals={"project": project}) if project else None))
    report = StoreReport(
        missing=sorted(s.created_event_id for p, s in expected.items() if p not in present),
        extra=sorted(str(p) for p in present - set(expected)),
    )
    for found in await store.retrieve([p for p in present if p in expected]):
        want = state_payload(expected[found.id])
        if any(found.payload.get(k) != want[k] for k in STATE_FIELDS if k not in ("last_seq", "updated_at")):
            report.stale.append(str(found.payload.get("event_id")))
    return report


async def _repair_mirror(
    mirror: MirrorObserver, states: dict[tuple[str, str], Any], report: StoreReport, project: str | None
) -> None:
    store = mirror.store
    by_event = {s.created_event_id: s for s in states.values()}
    if report.extra:
        await store.delete([uuid.UUID(p) for p in report.extra])
    missing = [by_event[e] for e in report.missing if e in by_event]
    if missing:
        vectors = await mirror.embedder.embed([s.content for s in missing])
        await store.upsert(
            [
                Point(
                    point_id(uuid.UUID(s.created_event_id)), v, state_payload(s) | {"node": mirror.node, "evidence": []}
                )
                for s, v in zip(missing, vectors, strict=True)
            ]
        )
    for event_id in report.stale:
        state = by_event.get(event_id)
        if state is None:
            continue
        fields = {k: v for k, v in state_payload(state).items() if k in STATE_FIELDS}
        await store.set_payload(Filter(equals={"project": state.project, "artifact_id": state.artifact_id}), fields)
