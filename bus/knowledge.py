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
from bus.event import Envelope, FindingBody, ResolvedBody
from bus.fold import Fold
from bus.jetstream import JS_TIMEOUT_S, NATS_OR_API_ERROR, open_bucket
from bus.reader import read_stream
from bus.records import Quarantine, decode_tombstone_key
from bus.registry import AgentRegistry
from bus.state import FLAG_PREVIOUSLY_RETRACTED, Tombstone, claim_flags, event_references
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


# What a read admitted: (stream seq, the address its subject names, the admitted event or None when refused).
Read = list[tuple[int, EventAddress | None, Delivery | None]]
# How many artifacts one state change may read directly; a longer chain of links is folded with the project.
MAX_LINKED = 256


async def _read_admitted(js: JetStreamContext, admission: Admission, filter_subject: str) -> Read:
    """Every message on `filter_subject`, admitted exactly as the live consumer admits it: what it
    dead-letters (invalid, wrongly signed, a key not bound to its agent) comes back as None."""
    read: Read = []
    async for messages in read_stream(js, STREAM, filter_subject=filter_subject):
        for msg, checked in zip(messages, await admission.check_msgs(messages), strict=True):
            try:
                delivery: Delivery | None = await admission.admit_checked(msg, checked)
            except Rejected:
                delivery = None  # the live consumer dead-letters it; it changes no state here either
            read.append((msg.metadata.sequence.stream, parse_event_subject(msg.subject), delivery))
    return read


def _fold_view(project: str, read: Read, forgets: list[tuple[Envelope, int]], authority: Authority) -> ProjectView:
    """The one fold both reads share: `read` in stream order through `Fold.apply`, with what the project's
    forgets recorded and the enrolment records."""
    view = ProjectView(project)
    erased = ForgottenArtifacts.records(forgets, authority)
    view.erased, view.authority, view.fold.authority = erased, authority, authority
    for seq, address, delivery in sorted(read, key=lambda r: r[0]):
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


async def load_project(js: JetStreamContext, project: str, registry: AgentRegistry | None = None) -> ProjectView:
    """Fold every event of the project in stream order, skipping exactly what the live consumer
    dead-letters (invalid, wrongly signed, or signed with a key not bound to its agent), so the client's
    view and the journal's projection agree. Raises Unavailable."""
    admission = Admission(registry or AgentRegistry(js))
    read = await _read_admitted(js, admission, events_filter(project))
    # Forgets and enrolment records from reads the broker lets an agent make: its project, and the records.
    forgets = forgets_in([d for _, _, d in read if d is not None])
    authority = await EnrolmentLog(js, admission).read_filtered()
    return _fold_view(project, read, forgets, authority)


def whole_project_needed(event: Envelope) -> str | None:
    """Why deciding `event` needs the whole project folded (None: the artifacts it names are enough). An
    artifact's lifecycle also changes when a claim on another subject supersedes it, and nothing on its own
    subjects says so: a decision that reads a lifecycle (a resolution, a supersession) reads the project."""
    body = event.body
    if isinstance(body, ResolvedBody):
        return "a resolution reads the artifact's lifecycle, which a claim elsewhere superseding it changes"
    if isinstance(body, FindingBody) and body.supersedes is not None:
        return "a supersession reads the superseded artifact's lifecycle"
    return None


@dataclass(frozen=True)
class ArtifactRead:
    """What `load_artifact` found: the view, or why only the whole project's fold can decide."""

    view: ProjectView | None
    whole_project: str | None = None


async def load_artifact(
    js: JetStreamContext, event: Envelope, registry: AgentRegistry | None = None, *, max_linked: int = MAX_LINKED
) -> ArtifactRead:
    """The view `load_project` gives of what deciding `event` reads, from the subjects of the artifacts it names
    and, transitively, those their events link to (at most `max_linked`), the project's forgets and the
    enrolment records: a cost that grows with the artifact's history, not the project's. The same admission
    and the same fold as `load_project` (`_fold_view`); `subject_seq` of the event's artifact is the value
    compare-and-set expects. Exact for an artifact's existence, author, trust and contradiction: what
    verifying, contradicting, rolling back and forgetting read. When the decision, or the creation of an
    artifact it reads, reads a lifecycle (`whole_project_needed`), or the links run past `max_linked`, the
    view is None with the reason. An event id reused on another subject is not seen here: the stores refuse
    the reuse (and the changes on top of it) as the project's fold does. Raises Unavailable."""
    why = whole_project_needed(event)
    if why is not None:
        return ArtifactRead(None, why)
    admission = Admission(registry or AgentRegistry(js))
    project, read, seen = event.project, [], set[str]()
    wanted = event_references(event)
    while wanted:
        if len(seen) + len(wanted) > max_linked:
            return ArtifactRead(None, f"its artifact links to more than {max_linked} others")
        batch = sorted(wanted)
        seen |= wanted
        reads = await asyncio.gather(*(_read_admitted(js, admission, artifact_filter(project, a)) for a in batch))
        wanted = set()
        for one in reads:
            read += one
            for _, _, delivery in one:
                if delivery is None:
                    continue
                why = whole_project_needed(delivery.event) if not delivery.event.body.transition else None
                if why is not None:
                    return ArtifactRead(None, f"{delivery.event.artifact_id} was claimed superseding another: {why}")
                wanted |= event_references(delivery.event) - seen
    # After the artifacts, as load_project: a forget or a record stored before what was read is never missed.
    forgets = forgets_in(
        [d for _, _, d in await _read_admitted(js, admission, events_filter(project, "forgotten")) if d is not None]
    )
    authority = await EnrolmentLog(js, admission).read_filtered()
    return ArtifactRead(_fold_view(project, read, forgets, authority))


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
