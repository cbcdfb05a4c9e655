"""What a client knows before it changes state: a project's events folded from the stream with the stream's
enrolment records, the last stream sequence on each artifact's subjects (for compare-and-set), and tombstones."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from bus.admission import Admission, Delivery, EnrolmentLog, ForgottenArtifacts, Rejected, forgets_in
from bus.authority import NO_RECORDS, Authority
from bus.erasure import ErasedMap
from bus.errors import InvalidEvent, MalformedRecord, Unavailable
from bus.event import Envelope
from bus.fold import Fold
from bus.jetstream import JS_TIMEOUT_S, NATS_OR_API_ERROR, open_bucket
from bus.reader import read_stream
from bus.records import Quarantine, decode_tombstone_key
from bus.registry import AgentRegistry
from bus.state import FLAG_PREVIOUSLY_RETRACTED, Tombstone, claim_flags
from bus.subjects import (
    STREAM,
    TOMBSTONES_BUCKET,
    EventAddress,
    artifact_filter,
    events_filter,
    parse_event_subject,
)

log = logging.getLogger(__name__)

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"


@dataclass
class ProjectView:
    """A project as the stream has it now. `subject_seq[artifact_id]` is the last stream sequence on any of
    the artifact's subjects: the value compare-and-set expects."""

    project: str
    fold: Fold = field(default_factory=Fold)
    subject_seq: dict[str, int] = field(default_factory=dict)
    # every message on each artifact's subjects: (stream seq, event id or None when it was not an event)
    messages: dict[str, list[tuple[int, str | None]]] = field(default_factory=dict)
    invalid: int = 0
    erased: ErasedMap = field(default_factory=dict)  # what the project's forgets recorded (ForgottenArtifacts)
    authority: Authority = NO_RECORDS  # the stream's enrolment records, read after the project's events

    @property
    def next_seq(self) -> int:
        """Past everything this view read: where an event published now lands, as far as the rules can tell."""
        return max(self.fold.last_seq, self.authority.last_seq, *self.subject_seq.values(), 0) + 1


async def load_project(js: JetStreamContext, project: str, registry: AgentRegistry | None = None) -> ProjectView:
    """Fold every event of the project in stream order, skipping exactly what the live consumer
    dead-letters (invalid, wrongly signed, or signed with a key not bound to its agent), so the client's
    view and the journal's projection agree. Raises Unavailable."""
    admission = Admission(registry or AgentRegistry(js))
    view = ProjectView(project)
    read: list[tuple[int, EventAddress | None, Delivery | None]] = []
    async for messages in read_stream(js, STREAM, filter_subject=events_filter(project)):
        for msg, checked in zip(messages, await admission.check_msgs(messages), strict=True):
            seq = msg.metadata.sequence.stream
            try:
                delivery: Delivery | None = await admission.admit_checked(msg, checked)
            except Rejected:
                delivery = None  # the live consumer dead-letters it; it changes no state here either
            read.append((seq, parse_event_subject(msg.subject), delivery))
    # Forgets and enrolment records from reads the broker lets an agent make: its project, and the records.
    forgets = forgets_in([d for _, _, d in read if d is not None])
    authority = await EnrolmentLog(js, admission).read_filtered()
    erased = ForgottenArtifacts.records(forgets, authority)
    view.erased, view.authority, view.fold.authority = erased, authority, authority
    for seq, address, delivery in read:
        if address is not None:
            view.subject_seq[address.artifact_id] = seq
        if delivery is None:
            view.invalid += 1
            if address is not None:
                view.messages.setdefault(address.artifact_id, []).append((seq, None))
            continue
        event = delivery.event
        view.messages.setdefault(event.artifact_id, []).append((seq, str(event.event_id)))
        view.fold.apply(event, seq, erased)
    return view


def cas_headers(project: str, artifact_id: str, expected_seq: int) -> dict[str, str]:
    """Refused by JetStream (10071) if any event landed on the artifact's subjects after expected_seq."""
    return {
        EXPECTED_LAST_SUBJECT_SEQ: str(expected_seq),
        EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: artifact_filter(project, artifact_id),
    }


class TombstoneRegistry:
    """Content hashes of retracted and rolled-back claims per project, in a KV bucket `<project>.<hash>`."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None
        self.quarantine = Quarantine("tombstone registry")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(self._js, TOMBSTONES_BUCKET)
        return self._kv

    async def hashes(self, project: str, *, timeout_s: float = JS_TIMEOUT_S) -> set[str]:
        """Every tombstoned content hash of a project, in one request (the keys of the KV stream). A key that
        is not `<project>.<content hash>` is quarantined and left out: it can flag or refuse nothing."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._bucket()
                info = await self._js.stream_info(
                    f"KV_{TOMBSTONES_BUCKET}", subjects_filter=f"$KV.{TOMBSTONES_BUCKET}.{project}.>"
                )
        except NATS_OR_API_ERROR as e:
            raise Unavailable("nats", f"tombstones of {project}: {type(e).__name__} {e}") from e
        found: set[str] = set()
        for subject in info.state.subjects or {}:
            try:
                found.add(decode_tombstone_key(subject, project=project))
            except MalformedRecord as e:
                self.quarantine.add(e)
        return found

    async def record(self, project: str, tombstone: Tombstone) -> None:
        value = json.dumps(
            {"artifact_id": tombstone.artifact_id, "event_id": tombstone.event_id, "reason": tombstone.reason}
        ).encode()
        try:
            async with asyncio.timeout(JS_TIMEOUT_S):
                kv = await self._bucket()
                await kv.put(f"{project}.{tombstone.content_hash}", value)
        except NATS_OR_API_ERROR as e:
            raise Unavailable("nats", f"recording a tombstone: {type(e).__name__} {e}") from e


async def prepublish_flags(
    registry: TombstoneRegistry | None, events: Sequence[Envelope], *, strict: bool, timeout_s: float
) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Flags of the claims among `events` before they are published, and the projects whose tombstones
    could not be checked (registry None: not connected). Strict refuses a repeat of a retracted claim
    (InvalidEvent) and an unchecked project (Unavailable)."""
    claims = [e for e in events if not e.body.transition and not e.body.system_record]
    tombstoned: dict[str, set[str]] = {}
    unchecked: list[str] = []
    for project in sorted({e.project for e in claims}):
        try:
            if registry is None:
                raise Unavailable("nats", "not connected")
            tombstoned[project] = await registry.hashes(project, timeout_s=timeout_s)
        except Unavailable as e:
            if strict:
                raise Unavailable("nats", f"tombstones cannot be checked ({e.cause}); retry, or drop strict") from e
            # Publishing must not wait on the check: the journal's projection flags the claim anyway.
            unchecked.append(project)
            log.warning("tombstones of %s not checked before publishing: %s", project, e)
    flags: dict[str, tuple[str, ...]] = {}
    for event in claims:
        found = claim_flags(event, tombstoned.get(event.project, set()).__contains__)
        if strict and FLAG_PREVIOUSLY_RETRACTED in found:
            raise InvalidEvent(
                f"event {event.event_id}",
                "repeats a claim that was retracted or rolled back in this project; "
                "publish without strict to record it anyway (flagged previously_retracted)",
            )
        if found:
            flags[str(event.event_id)] = tuple(sorted(found))
    return flags, unchecked
