"""What a client knows before it changes state: a project's (or one artifact's) events folded from the stream
with the stream's enrolment records, and the last stream sequence on each artifact's subjects, the value
compare-and-set expects (`bus.subjects.cas_headers`); and a client's views, read on its connection."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from bus.client.connection import Connection
from bus.enrolment.registry import AgentRegistry
from bus.intake.admission import Admission, Delivery, Rejected
from bus.intake.batch_context import EnrolmentLog, ForgottenArtifacts, forgets_in
from bus.intake.stream_read import read_stream
from bus.model.authority import NO_RECORDS, Authority
from bus.model.erasure import ErasedMap
from bus.model.event import Envelope
from bus.model.fold import Fold
from bus.model.kinds import FindingBody, ResolvedBody
from bus.model.state import event_references
from bus.services.tombstone_registry import TombstoneRegistry
from bus.subjects import STREAM, EventAddress, artifact_filter, events_filter, parse_event_subject

log = logging.getLogger(__name__)


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


class ProjectViews:
    """Views read on `connection`, with the agent registry it keeps."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._tombstones: TombstoneRegistry | None = None
        self._tombstones_js: JetStreamContext | None = None

    async def project(self, project: str) -> ProjectView:
        """The project folded from the stream now (the client's view for validating state changes)."""
        return await load_project(self.connection.js, project, self.connection.registry)

    async def for_change(self, event: Envelope) -> ProjectView:
        """What deciding `event` reads: the artifacts it names and those they link to, read from their own
        subjects (a cost that does not grow with the project), or the whole project when the decision reads
        what only its fold knows (`bus.client.project_view.load_artifact`)."""
        read = await load_artifact(self.connection.js, event, self.connection.registry)
        if read.view is not None:
            return read.view
        log.debug(
            "folding project %s to decide %s on %s: %s",
            event.project,
            event.kind,
            event.artifact_id,
            read.whole_project,
        )
        return await self.project(event.project)

    @property
    def tombstones(self) -> TombstoneRegistry:
        js = self.connection.js
        if self._tombstones is None or self._tombstones_js is not js:
            self._tombstones, self._tombstones_js = TombstoneRegistry(js), js
        return self._tombstones
