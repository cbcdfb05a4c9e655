"""Reconciling the three stores by event id: the stream is the truth, the journal must hold every
valid event once, the mirror a point for every claim the journal's projection holds, with that state in its
payload. The report names missing, extra and stale ids per store; `repair` makes the stores agree."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy import select

from bus.enrolment.registry import AgentRegistry
from bus.enrolment.service_rules import verify_rule
from bus.intake.admission import Admission, Delivery, Rejected, first_of_each_id
from bus.intake.batch_context import BatchContext, batch_erased
from bus.intake.stream_read import read_stream
from bus.model.erasure import erased_digests
from bus.model.ids import point_id
from bus.model.requests import StoreCheckReply, VerifyReply, VerifyRequest
from bus.model.state import ABSENT_RECORD_VALUES, ArtifactState
from bus.services.responder import Service
from bus.subjects import STREAM, VERIFY, events_filter
from observers.journal import Journal
from observers.mirror.observer import STATE_FIELDS, MirrorObserver, claim_payload, state_payload
from observers.mirror.store import Filter, Point, VectorStore
from observers.projection import FORGOTTEN, row_to_state
from observers.schema import artifacts, events

SAMPLE = 10


@dataclass
class StoreReport:
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # the id holds another event than the stream's first

    @property
    def clean(self) -> bool:
        return not (self.missing or self.extra or self.stale or self.mismatched)

    def check(self) -> StoreCheckReply:
        """What a node tells its askers: counts, and a sample of the ids behind each."""
        return StoreCheckReply(
            missing=len(self.missing),
            extra=len(self.extra),
            stale=len(self.stale),
            mismatched=len(self.mismatched),
            clean=self.clean,
            sample_missing=self.missing[:SAMPLE],
            sample_extra=self.extra[:SAMPLE],
            sample_stale=self.stale[:SAMPLE],
            sample_mismatched=self.mismatched[:SAMPLE],
        )

    def as_dict(self) -> dict[str, Any]:
        return self.check().model_dump()


@dataclass
class VerifyReport:
    stream_events: int
    journal: StoreReport
    mirror: StoreReport | None
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return self.journal.clean and (self.mirror is None or self.mirror.clean)

    def reply(self, node: str) -> VerifyReply:
        mirror = self.mirror.check() if self.mirror else None
        return VerifyReply(
            node=node,
            stream_events=self.stream_events,
            journal=self.journal.check(),
            mirror=mirror,
            repaired=self.repaired,
            clean=self.clean,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "stream_events": self.stream_events,
            "journal": self.journal.as_dict(),
            "mirror": self.mirror.as_dict() if self.mirror else None,
            "repaired": self.repaired,
            "clean": self.clean,
        }


async def _stream_deliveries(js: JetStreamContext, project: str | None) -> list[Delivery]:
    """What every store should hold: the stream's events as admission admits them, the first under each id."""
    admission = Admission(AgentRegistry(js))
    found: list[Delivery] = []
    async for messages in read_stream(js, STREAM, filter_subject=events_filter(project)):
        for msg in messages:
            try:
                found.append(await admission.admit_msg(msg))
            except Rejected:
                continue  # dead-lettered by the live consumers, never journaled
    found = await BatchContext(js, admission).attach(found)
    # Ids a forget erased stay taken: a later message under one is refused by every store.
    taken: dict[str, str | None] = dict(erased_digests(batch_erased(found)))
    kept, _conflicts = first_of_each_id(found, taken)
    return kept


@dataclass
class JournalSide:
    digests: dict[str, str | None]  # every row, the redacted audit rows of forgotten events included
    forgotten: set[str]  # rows a forget redacted: the stream may have erased their messages, or not yet
    states: dict[tuple[str, str], ArtifactState]


def _journal_side(journal: Journal, project: str | None) -> JournalSide:
    with journal.reading("reading event digests and states for verify") as conn:
        query = select(events.c.event_id, events.c.digest, events.c.status)
        states_query = select(artifacts)
        if project is not None:
            query = query.where(events.c.project == project)
            states_query = states_query.where(artifacts.c.project == project)
        rows = conn.execute(query).all()
        states = {(r.project, r.artifact_id): row_to_state(r._mapping) for r in conn.execute(states_query)}
    return JournalSide(
        {r.event_id: r.digest for r in rows}, {r.event_id for r in rows if r.status == FORGOTTEN}, states
    )


async def verify(
    js: JetStreamContext,
    journal: Journal,
    mirror: MirrorObserver | None,
    *,
    project: str | None = None,
    repair: bool = False,
) -> VerifyReport:
    """Compare the stream, the journal and the mirror by event id and by content digest. With repair: journal
    the missing events, index missing claims, delete extra points, rewrite stale payloads and mismatched points;
    then report again. A journal row that holds another event than the stream's first is reported, not
    rewritten: the journal is append-only."""
    deliveries = await _stream_deliveries(js, project)
    in_stream = {str(d.event.event_id): d for d in deliveries}
    side = await asyncio.to_thread(_journal_side, journal, project)
    journal_report = StoreReport(
        missing=sorted(set(in_stream) - set(side.digests)),
        extra=sorted(set(side.digests) - set(in_stream) - side.forgotten),
        mismatched=sorted(
            e for e, d in side.digests.items() if e in in_stream and d not in (None, in_stream[e].digest)
        ),
    )
    mirror_report = None
    if mirror is not None:
        mirror_report = await _mirror_side(mirror.store, side.states, in_stream, project)
    report = VerifyReport(len(deliveries), journal_report, mirror_report)
    if not repair or report.clean:
        return report
    if journal_report.missing:
        await asyncio.to_thread(journal.write, [in_stream[e] for e in journal_report.missing])
    if mirror is not None and mirror_report is not None:
        side = await asyncio.to_thread(_journal_side, journal, project)
        await _repair_mirror(mirror, side.states, mirror_report, in_stream)
    again = await verify(js, journal, mirror, project=project, repair=False)
    again.repaired = True
    return again


async def _mirror_side(
    store: VectorStore,
    states: dict[tuple[str, str], ArtifactState],
    in_stream: dict[str, Delivery],
    project: str | None,
) -> StoreReport:
    expected = {point_id(uuid.UUID(s.created_event_id)): s for s in states.values()}
    present = set(await store.point_ids(Filter(equals={"project": project}) if project else None))
    report = StoreReport(
        missing=sorted(s.created_event_id for p, s in expected.items() if p not in present),
        extra=sorted(str(p) for p in present - set(expected)),
    )
    for found in await store.retrieve([p for p in present if p in expected]):
        state = expected[found.id]
        delivery = in_stream.get(state.created_event_id)
        if delivery is not None and found.payload.get("event_digest") != delivery.digest:
            report.mismatched.append(state.created_event_id)
            continue
        want = state_payload(state)
        have = {k: found.payload.get(k, ABSENT_RECORD_VALUES.get(k)) for k in STATE_FIELDS}
        if any(have[k] != want[k] for k in STATE_FIELDS if k not in ("last_seq", "updated_at")):
            report.stale.append(state.created_event_id)
    return report


async def _repair_mirror(
    mirror: MirrorObserver,
    states: dict[tuple[str, str], ArtifactState],
    report: StoreReport,
    in_stream: dict[str, Delivery],
) -> None:
    store = mirror.store
    by_event = {s.created_event_id: s for s in states.values()}
    if report.extra:
        await store.delete([uuid.UUID(p) for p in report.extra])
    rewrite = [
        (by_event[e], in_stream[e]) for e in report.missing + report.mismatched if e in by_event and e in in_stream
    ]
    if rewrite:
        vectors = await mirror.embedder.embed([s.content for s, _ in rewrite])
        await store.upsert(
            [
                Point(point_id(d.event.event_id), v, claim_payload(s, d, mirror.node))
                for (s, d), v in zip(rewrite, vectors, strict=True)
            ]
        )
    for event_id in report.stale:
        state = by_event.get(event_id)
        if state is None:
            continue
        fields = {k: v for k, v in state_payload(state).items() if k in STATE_FIELDS}
        await store.set_payload(Filter(equals={"project": state.project, "artifact_id": state.artifact_id}), fields)


def verify_service(
    js: JetStreamContext, journal: Journal, mirror: Callable[[], MirrorObserver | None], *, node: str
) -> Service[VerifyRequest]:
    """The VERIFY service: reconcile this node's journal and its mirror as it stands (`mirror`, None without
    one) against the stream, and repair them when asked."""

    async def answer(request: VerifyRequest) -> VerifyReply:
        report = await verify(js, journal, mirror(), project=request.project, repair=request.repair)
        return report.reply(node)

    return Service(VERIFY, VerifyRequest, VerifyReply, answer, verify_rule)
