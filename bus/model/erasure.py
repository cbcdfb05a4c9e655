"""What a forget keeps of the artifact it erases, and how every path uses it. The client's `forget` publishes a
`forgotten` event carrying the artifact's states (without content) and the ids and digests of the events it
erases, then erases them from the stream; a path that reads the stream afterwards (catch-up, replay, reindex,
a rebuilt projection, a client's fold, an as-of read) decides links to the artifact as the live nodes did, and
keeps its erased event ids taken."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from bus.errors import Forbidden
from bus.model.authority import Authority, authorize
from bus.model.event import Envelope
from bus.model.kinds import ErasedEvent, ErasedState, ForgottenBody
from bus.model.state import ArtifactState, Lookup


@dataclass(frozen=True)
class ErasedRecord:
    """A forgotten artifact as its `forgotten` event left it: where the forget is in the stream, and the
    artifact's states before it."""

    forget_seq: int
    history: tuple[ErasedState, ...]
    digests: Mapping[str, str] = field(default_factory=dict)  # event id -> digest of each erased event


# (project, artifact_id) -> the artifact's forgets in stream order, for artifacts the stream has a `forgotten`
# event for (an id can be claimed again after a forget, and forgotten again).
ErasedMap = Mapping[tuple[str, str], tuple[ErasedRecord, ...]]


def erased_record(event: Envelope, stream_seq: int, authority: Authority) -> ErasedRecord | None:
    """The record a `forgotten` event keeps of its artifact. None for any other event, and for a forget its actor
    may not make on the artifact its history describes (`bus.model.authority`): every path rejects it, so it erased
    nothing and takes no event id."""
    if not isinstance(event.body, ForgottenBody):
        return None
    digests = {str(e.event_id): e.digest for e in event.body.events}
    record = ErasedRecord(stream_seq, event.body.history, digests)
    before = erased_state_at(replace(record, forget_seq=stream_seq + 1), event.project, event.artifact_id, stream_seq)
    try:
        authorize(event, stream_seq, lambda aid: before if aid == event.artifact_id else None, authority)
    except Forbidden:
        return None
    return record


def erased_digests(erased: ErasedMap) -> dict[str, str]:
    """Every event id the stream's forgets erased, with its digest: taken for good, on every path."""
    found: dict[str, str] = {}
    for records in erased.values():
        for record in records:
            found.update(record.digests)
    return found


def erased_state_at(record: ErasedRecord, project: str, artifact_id: str, seq: int) -> ArtifactState | None:
    """The state a forgotten artifact had just before stream sequence `seq`, without its content; None at or
    after its forget, or before it existed."""
    if seq >= record.forget_seq:
        return None
    before = [h for h in record.history if h.seq < seq]
    if not before or before[-1].forgotten:
        return None
    h = before[-1]
    return ArtifactState(
        project=project,
        artifact_id=artifact_id,
        kind=h.kind,
        author=h.author,
        created_event_id=str(h.created_event_id),
        created_at=h.created_at,
        content="",
        content_hash="",
        impact=h.impact,
        confidence=h.confidence,
        source=None,
        revises=h.revises,
        supersedes=h.supersedes,
        superseded_by=h.superseded_by,
        contradicted_by=h.contradicted_by,
        trust=h.trust,
        lifecycle=h.lifecycle,
        resolution=h.resolution,
        last_seq=h.seq,
        erased=True,
    )


def with_erased(lookup: Lookup, erased: ErasedMap, project: str, seq: int) -> Lookup:
    """`lookup`, falling back on what a later `forgotten` event recorded of an artifact whose messages were
    erased: every path that reads the stream after a forget decides as the live nodes did before it."""

    def get(artifact_id: str) -> ArtifactState | None:
        found = lookup(artifact_id)
        if found is not None or not erased:
            return found
        # The first forget after `seq` describes what the artifact was at `seq`.
        later = [r for r in erased.get((project, artifact_id), ()) if r.forget_seq > seq]
        return erased_state_at(later[0], project, artifact_id, seq) if later else None

    return get


def erased_events(
    kept: Mapping[str, str | None], messages: Iterable[tuple[int, str | None]], earlier: Sequence[ErasedRecord] = ()
) -> tuple[ErasedEvent, ...]:
    """What a `forgotten` event keeps of the events it erases: their ids and digests, and those earlier
    forgets of the same artifact id kept (this forget erases those forgets' events too)."""
    digests = {event_id: digest for record in earlier for event_id, digest in record.digests.items()}
    for _, event_id in messages:
        if event_id is not None and (digest := kept.get(event_id)) is not None:
            digests.setdefault(event_id, digest)
    return tuple(ErasedEvent(event_id=uuid.UUID(e), digest=d) for e, d in sorted(digests.items()))


def erased_history(states: Sequence[ArtifactState], earlier: Sequence[ErasedRecord] = ()) -> tuple[ErasedState, ...]:
    """What a `forgotten` event keeps of an artifact: each of its states in stream order, content left out,
    after those earlier forgets of the same artifact id kept (this forget erases those forgets too)."""
    kept: list[ErasedState] = []
    for record in earlier:
        kept += record.history
        if record.history:  # from its forget on, that artifact was gone
            kept.append(record.history[-1].model_copy(update={"seq": record.forget_seq, "forgotten": True}))
    kept = sorted({(h.seq, h.forgotten): h for h in kept}.values(), key=lambda h: (h.seq, h.forgotten))
    after = max((h.seq for h in kept), default=0)
    return tuple(kept) + tuple(
        ErasedState(
            seq=s.last_seq,
            kind=s.kind,
            author=s.author,
            created_event_id=uuid.UUID(s.created_event_id),
            created_at=s.created_at,
            impact=s.impact,
            confidence=s.confidence,
            revises=s.revises,
            supersedes=s.supersedes,
            superseded_by=s.superseded_by,
            contradicted_by=s.contradicted_by,
            trust=s.trust,
            lifecycle=s.lifecycle,
            resolution=s.resolution,
        )
        for s in states
        if not s.erased and s.last_seq > after
    )
