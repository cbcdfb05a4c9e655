"""The epistemic state of artifacts and the one function that decides what an event does to it.

`decide` is pure: given an event, a way to look up current artifact states and the enrolments in force
(`bus.model.authority`), it returns the Change the event makes, or raises Forbidden (the actor may not) or
IllegalTransition (nobody may). The client runs it before publishing (validation), the journal's projection
runs it at apply time in stream order, the mirror on its payloads, and `bus.model.fold.Fold` in memory: one set
of rules."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from bus.errors import EpibusError, Forbidden, IllegalTransition
from bus.model.authority import Authority, authorize, human_review
from bus.model.event import Envelope
from bus.model.kinds import ContradictedBody, FindingBody, ForgottenBody, ResolvedBody, RolledBackBody, VerifiedBody
from bus.model.tombstones import FLAG_PREVIOUSLY_RETRACTED, Tombstone, content_hash
from bus.model.vocab import EpistemicSource, Lifecycle, ResolutionKind, Trust
from bus.subjects import POLICY_PROJECT

# The legal trust moves. verified → verified appends a verification record.
TRUST_TRANSITIONS: dict[Trust, frozenset[Trust]] = {
    Trust.unverified: frozenset({Trust.verified, Trust.contradicted, Trust.rolled_back}),
    Trust.verified: frozenset({Trust.verified, Trust.contradicted, Trust.rolled_back}),
    Trust.contradicted: frozenset({Trust.rolled_back}),
    Trust.rolled_back: frozenset(),
}
TRANSITION_TRUST: dict[str, Trust] = {
    "verified": Trust.verified,
    "contradicted": Trust.contradicted,
    "rolled_back": Trust.rolled_back,
}
# Never shown by the safe door, whatever the lifecycle.
UNSAFE_TRUST = frozenset({Trust.contradicted, Trust.rolled_back})
UNSAFE_RESOLUTIONS = frozenset({ResolutionKind.retracted, ResolutionKind.mistyped})
UNEARNED_CONFIDENCE = 0.8

# What `decide` raises for an event that changes nothing: every path records it as rejected with its reason.
REFUSED: tuple[type[EpibusError], ...] = (IllegalTransition, Forbidden)

FLAG_UNEARNED = "unearned_confidence"


class IdUse(StrEnum):
    new = "new"  # no event is kept under this id yet
    repeat = "repeat"  # the same event again (a redelivery, a resend): nothing to do
    conflict = "conflict"  # another event already holds the id: refused, the first one is kept


def id_use(kept: Mapping[str, str | None], event_id: str, digest: str) -> IdUse:
    """What an event is, given the digests kept per event id (None: kept, digest unknown). Every store keeps
    the first event in stream order under an id; JetStream deduplicates ids only inside its window."""
    if event_id not in kept:
        return IdUse.new
    held = kept[event_id]
    return IdUse.conflict if held is not None and held != digest else IdUse.repeat


@dataclass(frozen=True)
class Verification:
    event_id: str
    artifact_id: str
    verifier: str
    recorded_at: datetime
    stream_seq: int
    note: str | None
    human_review: bool = False  # the verifier was enrolled as a person


@dataclass(frozen=True)
class ArtifactState:
    project: str
    artifact_id: str
    kind: str
    author: str
    created_event_id: str
    created_at: datetime
    content: str
    content_hash: str
    impact: float | None
    confidence: float | None
    source: EpistemicSource | None
    goal_id: str | None = None
    revises: str | None = None
    supersedes: str | None = None
    superseded_by: str | None = None
    contradicted_by: str | None = None
    trust: Trust = Trust.unverified
    lifecycle: Lifecycle = Lifecycle.active
    resolution: ResolutionKind | None = None
    forgotten: bool = False
    flags: frozenset[str] = frozenset()
    last_seq: int = 0
    updated_at: datetime | None = None
    # Who vouched: agents that verified it (distinct, in order), persons who reviewed it (distinct, the last
    # reviewer last) and when the last person did.
    verified_by: tuple[str, ...] = ()
    reviewed_by: tuple[str, ...] = ()
    reviewed_at: datetime | None = None
    # Rebuilt from a `forgotten` event's history (the content was erased): rules may read it, stores never
    # write it.
    erased: bool = False

    @property
    def state_label(self) -> str:
        life = f"resolved({self.resolution})" if self.lifecycle is Lifecycle.resolved else "active"
        return f"{self.trust.value}/{life}"

    def to_record(self) -> dict[str, Any]:
        """This state as plain JSON values, one key per field a store keeps (`erased` is never stored): times
        as ISO text, vocabularies as their values, flags as a sorted list. The journal's rows, the mirror's
        payloads and the read doors' answers are all derived from it."""
        return {
            "project": self.project,
            "artifact_id": self.artifact_id,
            "kind": self.kind,
            "author": self.author,
            "created_event_id": self.created_event_id,
            "created_at": self.created_at.isoformat(),
            "content": self.content,
            "content_hash": self.content_hash,
            "impact": self.impact,
            "confidence": self.confidence,
            "source": self.source.value if self.source else None,
            "goal_id": self.goal_id,
            "revises": self.revises,
            "supersedes": self.supersedes,
            "superseded_by": self.superseded_by,
            "contradicted_by": self.contradicted_by,
            "trust": self.trust.value,
            "lifecycle": self.lifecycle.value,
            "resolution": self.resolution.value if self.resolution else None,
            "forgotten": self.forgotten,
            "flags": sorted(self.flags),
            "last_seq": self.last_seq,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
            "verified_by": list(self.verified_by),
            "reviewed_by": list(self.reviewed_by),
            "reviewed_at": self.reviewed_at.isoformat() if self.reviewed_at else None,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ArtifactState:
        """The state `to_record` made this record of. Keys it does not know are ignored, and the optional
        fields may be missing (a payload written before they existed)."""
        resolution = record.get("resolution")
        updated_at = record.get("updated_at")
        reviewed_at = record.get("reviewed_at")
        return cls(
            project=record["project"],
            artifact_id=record["artifact_id"],
            kind=record["kind"],
            author=record["author"],
            created_event_id=record["created_event_id"],
            created_at=datetime.fromisoformat(record["created_at"]),
            content=record["content"],
            content_hash=record["content_hash"],
            impact=record.get("impact"),
            confidence=record.get("confidence"),
            source=EpistemicSource(record["source"]) if record.get("source") else None,
            goal_id=record.get("goal_id"),
            revises=record.get("revises"),
            supersedes=record.get("supersedes"),
            superseded_by=record.get("superseded_by"),
            contradicted_by=record.get("contradicted_by"),
            trust=Trust(record["trust"]),
            lifecycle=Lifecycle(record["lifecycle"]),
            resolution=ResolutionKind(resolution) if resolution else None,
            forgotten=bool(record.get("forgotten")),
            flags=frozenset(record.get("flags") or ()),
            last_seq=int(record.get("last_seq") or 0),
            updated_at=datetime.fromisoformat(updated_at) if updated_at else None,
            verified_by=tuple(record.get("verified_by") or ()),
            reviewed_by=tuple(record.get("reviewed_by") or ()),
            reviewed_at=datetime.fromisoformat(reviewed_at) if reviewed_at else None,
        )

    def with_verification(self, verifier: str, *, by_person: bool, at: datetime, seq: int) -> ArtifactState:
        """This state verified by `verifier` at `at` (stream sequence `seq`): an agent joins `verified_by` once;
        a person moves to the end of `reviewed_by`, the last person to review."""
        vouched: dict[str, Any]
        if by_person:
            people = (*(p for p in self.reviewed_by if p != verifier), verifier)
            vouched = {"reviewed_by": people, "reviewed_at": at}
        else:
            agents = self.verified_by if verifier in self.verified_by else (*self.verified_by, verifier)
            vouched = {"verified_by": agents}
        return replace(self, trust=Trust.verified, last_seq=seq, updated_at=at, **vouched)

    def vouched(self) -> dict[str, Any]:
        """Who vouched for it, as every read shows it (see `vouched_of`)."""
        return vouched_of(self.verified_by, self.reviewed_by, self.reviewed_at)

    def safe(self, *, include_resolved: bool = False) -> bool:
        """What the safe door may show: never contradicted, rolled back, retracted, mistyped or forgotten;
        other resolved artifacts only when asked."""
        if self.forgotten or self.trust in UNSAFE_TRUST:
            return False
        if self.lifecycle is Lifecycle.resolved:
            return include_resolved and self.resolution not in UNSAFE_RESOLUTIONS
        return True

    @property
    def longevity(self) -> float:
        """Impact for findings and others that carry it; confidence for assumptions."""
        if self.kind == "assumption":
            return self.confidence or 0.0
        if self.impact is not None:
            return self.impact
        return self.confidence or 0.0


def time_weight(age_days: float | None, longevity: float) -> float:
    """exp(-age/tau) with tau = 30 days * (1 + 2 * longevity); an unknown age is neutral (0.5)."""
    if age_days is None or math.isnan(age_days):
        return 0.5
    tau = 30.0 * (1.0 + 2.0 * longevity)
    return math.exp(-max(0.0, age_days) / tau)


def relevance(state: ArtifactState, now: datetime) -> float:
    """Time weight combined with impact: a neutral impact (0.5) when the kind has none."""
    age_days = (now - state.created_at).total_seconds() / 86_400 if state.created_at.tzinfo else None
    impact = state.impact if state.impact is not None else 0.5
    return time_weight(age_days, state.longevity) * (0.5 + 0.5 * impact)


@dataclass(frozen=True)
class Change:
    """What one event does: artifact states to write, at most one verification record and one tombstone."""

    event_id: str
    artifacts: tuple[ArtifactState, ...] = ()
    verification: Verification | None = None
    tombstone: Tombstone | None = None
    flags: frozenset[str] = frozenset()


Lookup = Callable[[str], ArtifactState | None]


def event_references(event: Envelope) -> set[str]:
    """Every artifact id `decide` may look up for this event: its own and those its body links to."""
    body = event.body
    refs = {event.artifact_id}
    if isinstance(body, FindingBody):
        refs |= {r for r in (body.revises, body.supersedes) if r}
    elif isinstance(body, ResolvedBody) and body.superseded_by:
        refs.add(body.superseded_by)
    elif isinstance(body, ContradictedBody):
        refs.add(body.contradicted_by)
    return refs


def claim_flags(event: Envelope, is_tombstoned: Callable[[str], bool]) -> frozenset[str]:
    """Unearned confidence (>= 0.8 on intuition alone) and repeats of retracted or rolled-back claims."""
    flags = set()
    confidence = getattr(event.body, "confidence", None)
    if confidence is not None and confidence >= UNEARNED_CONFIDENCE and event.source is EpistemicSource.intuition:
        flags.add(FLAG_UNEARNED)
    if is_tombstoned(content_hash(event.body.content_text())):
        flags.add(FLAG_PREVIOUSLY_RETRACTED)
    return frozenset(flags)


def decide(
    event: Envelope, stream_seq: int, lookup: Lookup, is_tombstoned: Callable[[str], bool], authority: Authority
) -> Change:
    """The change `event` makes at `stream_seq` given current states and the enrolments in force. Raises
    Forbidden naming the rule the actor breaks (`bus.model.authority.authorize`, asked first), or IllegalTransition
    naming the artifact, its current state and what would be legal. Pure: reads through `lookup`, writes nothing."""
    authorize(event, stream_seq, lookup, authority)
    if event.body.system_record and event.project == POLICY_PROJECT:
        return Change(str(event.event_id))  # an enrolment or a review policy: changes rules from here on
    if event.body.transition:
        return _decide_transition(event, stream_seq, lookup, authority)
    return _decide_new_artifact(event, stream_seq, lookup, is_tombstoned)


def _require(lookup: Lookup, artifact_id: str, role: str, requested: str) -> ArtifactState:
    state = lookup(artifact_id)
    if state is None:
        raise IllegalTransition(artifact_id, "absent", requested, f"{role} {artifact_id!r} does not exist")
    return state


def _decide_new_artifact(event: Envelope, seq: int, lookup: Lookup, is_tombstoned: Callable[[str], bool]) -> Change:
    aid = event.artifact_id
    if lookup(aid) is not None:
        raise IllegalTransition(aid, "exists", event.kind, "an artifact with this id already exists")
    body = event.body
    content = body.content_text()
    digest = content_hash(content)
    impact = getattr(body, "impact", None)
    confidence = getattr(body, "confidence", None)
    flags = claim_flags(event, is_tombstoned)
    revises = supersedes = None
    if isinstance(body, FindingBody):
        revises, supersedes = body.revises, body.supersedes
    if revises is not None:
        if revises == aid:
            raise IllegalTransition(aid, "absent", event.kind, "an artifact cannot revise itself")
        _require(lookup, revises, "revised artifact", event.kind)
    state = ArtifactState(
        project=event.project,
        artifact_id=aid,
        kind=event.kind,
        author=event.actor.agent_id,
        created_event_id=str(event.event_id),
        created_at=event.recorded_at,
        content=content,
        content_hash=digest,
        impact=impact,
        confidence=confidence,
        source=event.source,
        goal_id=event.goal_id,
        revises=revises,
        supersedes=supersedes,
        flags=flags,
        last_seq=seq,
        updated_at=event.recorded_at,
    )
    changed = [state]
    if supersedes is not None:
        changed.append(_supersede(_require(lookup, supersedes, "superseded artifact", event.kind), aid, event, seq))
    return Change(str(event.event_id), tuple(changed), flags=flags)


def _legal_trust_moves(state: ArtifactState) -> str:
    moves = sorted(t.value for t in TRUST_TRANSITIONS[state.trust])
    return ("legal: " + ", ".join(moves)) if moves else "nothing is legal (terminal)"


def _supersede(old: ArtifactState, successor: str, event: Envelope, seq: int) -> ArtifactState:
    """Both sides or nothing: the caller writes the returned state with the successor's, or raises."""
    requested = "resolved(superseded)"
    if old.artifact_id == successor:
        raise IllegalTransition(old.artifact_id, old.state_label, requested, "an artifact cannot supersede itself")
    if old.lifecycle is Lifecycle.resolved:
        raise IllegalTransition(
            old.artifact_id, old.state_label, requested, f"it is already resolved; {_legal_trust_moves(old)}"
        )
    if old.trust is Trust.rolled_back:
        raise IllegalTransition(old.artifact_id, old.state_label, requested, "it is rolled back (terminal)")
    return replace(
        old,
        lifecycle=Lifecycle.resolved,
        resolution=ResolutionKind.superseded,
        superseded_by=successor,
        last_seq=seq,
        updated_at=event.recorded_at,
    )


def _require_usable_successor(successor: ArtifactState, superseded: str) -> None:
    """A successor must itself be current and trusted enough to be shown, or the supersession hides both."""
    if successor.lifecycle is Lifecycle.resolved or successor.trust in UNSAFE_TRUST or successor.forgotten:
        raise IllegalTransition(
            successor.artifact_id,
            successor.state_label,
            f"supersedes {superseded}",
            "a successor must be active and neither contradicted, rolled back nor forgotten",
        )
    if successor.supersedes not in (None, superseded):
        raise IllegalTransition(
            successor.artifact_id,
            successor.state_label,
            f"supersedes {superseded}",
            f"it already supersedes {successor.supersedes}",
        )


def _decide_transition(event: Envelope, seq: int, lookup: Lookup, authority: Authority) -> Change:
    aid = event.artifact_id
    if isinstance(event.body, ForgottenBody) and lookup(aid) is None:
        # Its content may have been erased before this reader saw it: forgetting nothing changes nothing.
        return Change(str(event.event_id))
    current = _require(lookup, aid, "artifact", event.kind)
    if current.project != event.project:
        raise IllegalTransition(aid, current.state_label, event.kind, f"it belongs to project {current.project}")
    body = event.body
    at = event.recorded_at
    if isinstance(body, ResolvedBody):
        return _decide_resolution(event, body, current, seq, lookup)
    if isinstance(body, ForgottenBody):
        return Change(str(event.event_id), (replace(current, forgotten=True, last_seq=seq, updated_at=at),))
    target = TRANSITION_TRUST[event.kind]
    legal = TRUST_TRANSITIONS[current.trust]
    if target not in legal:
        allowed = ", ".join(sorted(t.value for t in legal)) or "nothing (terminal)"
        raise IllegalTransition(aid, current.state_label, target.value, f"from {current.trust} only {allowed}")
    if isinstance(body, VerifiedBody):
        if event.actor.agent_id == current.author:
            raise IllegalTransition(
                aid, current.state_label, "verified", f"{current.author} is the author; another agent must verify"
            )
        reviewed = human_review(event, seq, authority)
        record = Verification(str(event.event_id), aid, event.actor.agent_id, at, seq, body.note, reviewed)
        updated = current.with_verification(event.actor.agent_id, by_person=reviewed, at=at, seq=seq)
        return Change(str(event.event_id), (updated,), verification=record)
    if isinstance(body, ContradictedBody):
        if body.contradicted_by == aid:
            raise IllegalTransition(aid, current.state_label, "contradicted", "an artifact cannot contradict itself")
        _require(lookup, body.contradicted_by, "contradicting artifact", "contradicted")
        updated = replace(
            current, trust=Trust.contradicted, contradicted_by=body.contradicted_by, last_seq=seq, updated_at=at
        )
        return Change(str(event.event_id), (updated,))
    assert isinstance(body, RolledBackBody)
    updated = replace(current, trust=Trust.rolled_back, last_seq=seq, updated_at=at)
    tomb = Tombstone(current.content_hash, aid, str(event.event_id), "rolled_back")
    return Change(str(event.event_id), (updated,), tombstone=tomb)


def _decide_resolution(event: Envelope, body: ResolvedBody, current: ArtifactState, seq: int, lookup: Lookup) -> Change:
    aid = event.artifact_id
    requested = f"resolved({body.resolution})"
    if current.lifecycle is Lifecycle.resolved:
        raise IllegalTransition(
            aid, current.state_label, requested, f"it is already resolved; {_legal_trust_moves(current)}"
        )
    if current.trust is Trust.rolled_back:
        raise IllegalTransition(aid, current.state_label, requested, "it is rolled back (terminal)")
    at = event.recorded_at
    if body.resolution is ResolutionKind.superseded:
        assert body.superseded_by is not None  # the body model requires it
        successor = _require(lookup, body.superseded_by, "successor", requested)
        _require_usable_successor(successor, aid)
        old = _supersede(current, successor.artifact_id, event, seq)
        new = replace(successor, supersedes=aid, last_seq=seq, updated_at=at)
        return Change(str(event.event_id), (old, new))
    updated = replace(current, lifecycle=Lifecycle.resolved, resolution=body.resolution, last_seq=seq, updated_at=at)
    tomb = None
    if body.resolution is ResolutionKind.retracted:
        tomb = Tombstone(current.content_hash, aid, str(event.event_id), "retracted")
    return Change(str(event.event_id), (updated,), tombstone=tomb)


def vouched_of(verified_by: Sequence[str], reviewed_by: Sequence[str], reviewed_at: datetime | None) -> dict[str, Any]:
    """Who vouched for an artifact: how many agents and people verified it, and the last person's name and time
    (None when no person did)."""
    return {
        "agents": len(verified_by),
        "people": len(reviewed_by),
        "last_person": reviewed_by[-1] if reviewed_by else None,
        "last_person_at": reviewed_at.isoformat() if reviewed_at else None,
    }


def vouched_text(vouched: Mapping[str, Any]) -> str:
    """`ArtifactState.vouched()` in words, as tables show it: "2 agents, 1 person (dana, 2026-12-07 22:10Z)"."""
    agents, people = int(vouched["agents"]), int(vouched["people"])
    if not agents and not people:
        return "no one"
    parts = [f"{agents} agent{'s' if agents != 1 else ''}"] if agents else []
    if people:
        at = str(vouched["last_person_at"] or "")[:16].replace("T", " ")
        parts.append(f"{people} {'person' if people == 1 else 'people'} ({vouched['last_person']}, {at}Z)")
    return ", ".join(parts)


# A record key a store may lack (written before it existed) reads as this value.
ABSENT_RECORD_VALUES: dict[str, Any] = {"verified_by": [], "reviewed_by": [], "reviewed_at": None}


def by_id(states: Iterable[ArtifactState]) -> Mapping[str, ArtifactState]:
    return {s.artifact_id: s for s in states}
