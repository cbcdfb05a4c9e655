"""What deciding a batch needs from the rest of the stream, attached to each delivery the same way on every path
(live, replayed, repaired, reindexed, caught up, folded): what `forgotten` events recorded of the erased artifacts
the batch refers to, and the fleet's enrolment records in force."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime

import nats.js.errors
from nats.js import JetStreamContext

from bus.broker.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, nats_call
from bus.enrolment.enrolment_view import EnrolmentView, enrolment_view
from bus.errors import Unavailable
from bus.identity.confinement import confined_key
from bus.intake.admission import Admission, Delivery, Rejected
from bus.intake.stream_read import read_stream
from bus.model.auth import Enrolment, ReviewPolicy
from bus.model.authority import NO_RECORDS, Authority, enrolment_record, policy_record
from bus.model.erasure import ErasedMap, ErasedRecord, erased_record
from bus.model.event import Envelope
from bus.subjects import (
    AUTHORITY_FILTER,
    STREAM,
    events_filter,
    parse_event_subject,
)


def batch_authority(deliveries: Sequence[Delivery]) -> Authority:
    """The enrolment records the deliveries of one batch carry (the most recently read, if they differ)."""
    return max((d.authority for d in deliveries), key=lambda a: a.last_seq, default=NO_RECORDS)


def batch_erased(deliveries: Sequence[Delivery]) -> dict[tuple[str, str], tuple[ErasedRecord, ...]]:
    """The records of erased artifacts the deliveries of one batch carry."""
    erased: dict[tuple[str, str], tuple[ErasedRecord, ...]] = {}
    for delivery in deliveries:
        erased.update(delivery.erased)
    return erased


def forgets_in(deliveries: Sequence[Delivery]) -> list[tuple[Envelope, int]]:
    """The admitted `forgotten` events among `deliveries`, with their stream sequences: what
    ForgottenArtifacts.read finds by asking the stream, for a path that has read a whole project itself (an
    agent's fold, which the broker lets read only its own projects' subjects)."""
    return [
        (d.event, d.stream_seq)
        for d in sorted(deliveries, key=lambda d: d.stream_seq)
        if (address := parse_event_subject(d.subject)) is not None and address.kind == "forgotten"
    ]


class ForgottenArtifacts:
    """What the stream's `forgotten` events recorded of the artifacts a batch refers to. A path that reads
    the stream after a forget erased an artifact's messages asks this, so links to that artifact (contradicted
    by it, superseding it) are decided as the live nodes decided them. Forgotten events are admitted like any
    other message: a forged one records nothing."""

    def __init__(self, js: JetStreamContext, admission: Admission) -> None:
        self._js = js
        self._admission = admission
        # (project, artifact_id) -> (messages on its `forgotten` subject when read, the admitted forgets there)
        self._forgets: dict[tuple[str, str], tuple[int, tuple[tuple[Envelope, int], ...]]] = {}

    async def read(self, deliveries: Sequence[Delivery]) -> list[tuple[Envelope, int]]:
        """Every admitted forget of the batch's projects, with its stream sequence. Raises Unavailable."""
        found: list[tuple[Envelope, int]] = []
        for project in sorted({d.event.project for d in deliveries}):
            # Every forget of the project, not only those the batch links to: an erased event's id stays
            # taken whatever artifact a later message under it names.
            for subject, count in sorted((await self._forget_subjects(project)).items()):
                found += await self._forgets_on(project, subject, count)
        return found

    @staticmethod
    def records(forgets: Sequence[tuple[Envelope, int]], authority: Authority) -> ErasedMap:
        """What the forgets their actors were allowed to make recorded (`erasure.erased_record`): a forget every
        path rejects erased nothing. `authority` must hold every enrolment record before the forgets."""
        found: dict[tuple[str, str], tuple[ErasedRecord, ...]] = {}
        for event, seq in sorted(forgets, key=lambda f: f[1]):
            record = erased_record(event, seq, authority)
            if record is not None:
                key = (event.project, event.artifact_id)
                found[key] = (*found.get(key, ()), record)
        return found

    async def _forget_subjects(self, project: str) -> dict[str, int]:
        async with nats_call(f"forgotten artifacts of {project}"):
            info = await self._js.stream_info(STREAM, subjects_filter=events_filter(project, "forgotten"))
        return dict(info.state.subjects or {})

    async def _forgets_on(self, project: str, subject: str, count: int) -> tuple[tuple[Envelope, int], ...]:
        """Every admitted forget on one artifact's `forgotten` subject, in stream order (an artifact id can be
        claimed again after a forget, and forgotten again)."""
        key = (project, subject.rsplit(".", 1)[1])
        cached = self._forgets.get(key)
        if cached is not None and cached[0] == count:
            return cached[1]
        forgets: list[tuple[Envelope, int]] = []
        seq = 1
        for _ in range(count):
            try:
                async with asyncio.timeout(JS_TIMEOUT_S):
                    msg = await self._js.get_msg(STREAM, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                break
            except NATS_OR_API_ERROR as e:
                raise Unavailable("nats", f"the forgets on {subject}: {type(e).__name__} {e}") from e
            if msg.seq is None or msg.data is None or msg.time is None:
                break
            seq = msg.seq + 1
            try:
                event = await self._admission.admit(subject, msg.data, msg.time, msg.headers)
            except Rejected:
                continue  # dead-lettered wherever it was read: it forgot nothing
            forgets.append((event, msg.seq))
        self._forgets[key] = (count, tuple(forgets))
        return tuple(forgets)


class EnrolmentLog:
    """The stream's enrolment records (`epi.epibus.enrolment.*`) and review policies (`epi.epibus.review_policy.*`),
    each admitted like any message and kept only if it is a valid record (`bus.model.authority`). Read on from
    where the last read stopped: a record is never erased, and one stored before an event is in the stream
    whenever that event is read."""

    def __init__(self, js: JetStreamContext, admission: Admission) -> None:
        self._js = js
        self._admission = admission
        self._records: list[tuple[int, Enrolment]] = []
        self._policies: list[tuple[int, ReviewPolicy]] = []  # projects' review policies, recorded beside them
        self._seen: set[str] = set()  # event ids read: a record resent later is a repeat, never a new record
        self._next_seq = 1
        self._authority = NO_RECORDS
        self._served_version = 0  # the version of a node's enrolment view the authority was made of

    @property
    def last_seq(self) -> int:
        """The stream sequence the next read starts after: every record up to it has been read."""
        return self._next_seq - 1

    async def read(self) -> Authority:
        """Every record up to now (on a confined connection, those a node's enrolment view shows it). Raises
        Unavailable."""
        key = confined_key(self._js)
        if key is not None:
            return await self._read_served(enrolment_view(self._js._nc, key))  # nats-py keeps its connection there
        read = False
        while True:
            try:
                async with asyncio.timeout(JS_TIMEOUT_S):
                    msg = await self._js.get_msg(STREAM, seq=self._next_seq, subject=AUTHORITY_FILTER, next=True)
            except nats.js.errors.NotFoundError:
                break
            except NATS_OR_API_ERROR as e:
                raise Unavailable("nats", f"enrolment records: {type(e).__name__} {e}") from e
            if msg.seq is None or msg.data is None or msg.time is None or msg.subject is None:
                break
            await self._take(msg.seq, msg.subject, msg.data, msg.time, msg.headers)
            read = True
        if read:
            self._authority = Authority.of(self._records, self._policies)
        return self._authority

    async def _read_served(self, view: EnrolmentView) -> Authority:
        """The records a node shows this agent: checked by the node, which alone may read them all."""
        await view.refresh()
        if view.version != self._served_version:
            self._authority = Authority.of(view.records)
            self._served_version = view.version
        return self._authority

    async def read_filtered(self) -> Authority:
        """Every record up to now, read through a consumer filtered to the records (the read an unconfined
        client without message gets makes); a confined agent's comes from a node's view. Raises Unavailable."""
        key = confined_key(self._js)
        if key is not None:
            return await self._read_served(enrolment_view(self._js._nc, key))
        read = False
        async for batch in read_stream(self._js, STREAM, filter_subject=AUTHORITY_FILTER, start_seq=self._next_seq):
            for msg in batch:
                await self._take(
                    msg.metadata.sequence.stream, msg.subject, msg.data, msg.metadata.timestamp, msg.headers
                )
                read = True
        if read:
            self._authority = Authority.of(self._records, self._policies)
        return self._authority

    async def _take(
        self, seq: int, subject: str, data: bytes, stream_time: datetime, headers: Mapping[str, str] | None
    ) -> None:
        try:
            event: Envelope | None = await self._admission.admit(subject, data, stream_time, headers)
        except Rejected:
            event = None  # dead-lettered wherever it was read: it enrols nobody
        if event is not None and str(event.event_id) not in self._seen:
            self._seen.add(str(event.event_id))
            record = enrolment_record(event)
            if record is not None:
                self._records.append((seq, record))
            policy = policy_record(event)
            if policy is not None:
                self._policies.append((seq, policy))
        self._next_seq = seq + 1


class BatchContext:
    """What deciding a batch needs from the rest of the stream, attached to each delivery the same way on
    every path: the records of erased artifacts and the enrolment records in force."""

    def __init__(self, js: JetStreamContext, admission: Admission) -> None:
        self.forgotten = ForgottenArtifacts(js, admission)
        self.enrolments = EnrolmentLog(js, admission)

    async def read(self, deliveries: Sequence[Delivery]) -> tuple[ErasedMap, Authority]:
        """Raises Unavailable. The enrolment records are read after the batch and its forgets, so none that
        comes before them in the stream is missed."""
        forgets = await self.forgotten.read(deliveries)
        authority = await self.enrolments.read()
        return ForgottenArtifacts.records(forgets, authority), authority

    async def attach(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Raises Unavailable."""
        erased, authority = await self.read(deliveries)
        return [replace(d, erased=erased, authority=authority) for d in deliveries]
