"""Project knowledge folded in memory from events in stream order: the client's view before it changes state,
and as-of reads. The same rules as the journal's projection and the mirror: `decide` with the stream's
enrolment records, one event per id, and what forgets recorded of erased artifacts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from bus.model.authority import NO_RECORDS, Authority
from bus.model.erasure import ErasedMap, erased_digests, with_erased
from bus.model.event import Envelope, event_digest
from bus.model.state import REFUSED, ArtifactState, Change, IdUse, Verification, decide, id_use
from bus.model.tombstones import Tombstone


@dataclass
class Fold:
    """Project knowledge folded in memory from events in stream order (as-of reads, client validation).
    Illegal and forbidden events are recorded in `rejected` with their reason and change nothing. `authority`
    holds the enrolment records of the stream the events come from."""

    authority: Authority = NO_RECORDS
    artifacts: dict[str, ArtifactState] = field(default_factory=dict)
    verifications: list[Verification] = field(default_factory=list)
    tombstones: dict[str, Tombstone] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    flags: dict[str, frozenset[str]] = field(default_factory=dict)
    digests: dict[str, str | None] = field(default_factory=dict)  # the event kept under each id
    refused: dict[str, str] = field(default_factory=dict)  # event ids reused with other content
    history: dict[str, list[ArtifactState]] = field(default_factory=dict)  # each artifact's states in order
    last_seq: int = 0

    def apply(self, event: Envelope, stream_seq: int, erased: ErasedMap | None = None) -> Change | None:
        event_id, digest = str(event.event_id), event_digest(event)
        taken = erased_digests(erased) if erased else {}
        use = id_use(self.digests if event_id not in taken else {**taken, **self.digests}, event_id, digest)
        if use is not IdUse.new:
            if use is IdUse.conflict:
                self.refused[event_id] = digest
            return None
        self.digests[event_id] = digest
        lookup = with_erased(self.artifacts.get, erased or {}, event.project, stream_seq)
        try:
            change = decide(event, stream_seq, lookup, self.tombstones.__contains__, self.authority)
        except REFUSED as e:
            self.rejected[event_id] = str(e)
            return None
        self.absorb(change)
        self.last_seq = max(self.last_seq, stream_seq)
        return change

    def absorb(self, change: Change) -> None:
        for state in change.artifacts:
            if state.erased:
                continue  # its forget's history already holds this state
            if state.forgotten:  # a privacy delete: the artifact leaves the state, as it leaves every store
                self.artifacts.pop(state.artifact_id, None)
                continue
            self.artifacts[state.artifact_id] = state
            self.history.setdefault(state.artifact_id, []).append(state)
        if change.verification is not None:
            self.verifications.append(change.verification)
        if change.tombstone is not None:
            self.tombstones.setdefault(change.tombstone.content_hash, change.tombstone)
        if change.flags:
            self.flags[change.event_id] = change.flags

    @classmethod
    def of(
        cls, events: Iterable[tuple[Envelope, int]], erased: ErasedMap | None = None, authority: Authority = NO_RECORDS
    ) -> Fold:
        fold = cls(authority=authority)
        for event, seq in events:
            fold.apply(event, seq, erased)
        return fold
