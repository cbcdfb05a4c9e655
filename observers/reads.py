"""Reads of the epistemic state from the journal: the safe door `artifacts`, the separate audit
door `audit_artifacts`, `briefing`, `vocab_report` and `artifact_lineage`. Every read takes `as_of`: with it,
the state is folded from the append-only events recorded by then; without it, the live projection is read."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import false, func, select
from sqlalchemy.engine import Connection

from bus.model.auth import ReviewPolicy
from bus.model.event import validate_event
from bus.model.fold import Fold
from bus.model.ids import SHOWN_MATCHES
from bus.model.lineage import Lineage, lineage
from bus.model.review import review_status, safe_review_order
from bus.model.state import FLAG_UNEARNED, UNSAFE_TRUST, ArtifactState, Verification, relevance
from bus.model.tombstones import FLAG_PREVIOUSLY_RETRACTED
from bus.model.vocab import EpistemicSource, Lifecycle, ResolutionKind, Trust
from observers.journal import Journal
from observers.projection import FORGOTTEN, enrolments_in_journal, forgets_in_journal, row_to_state
from observers.schema import artifacts as artifacts_table
from observers.schema import as_utc, events, review_policies, stored_at, verifications

RECENT = timedelta(days=14)
UNKNOWN_KIND = "unknown"
# What an answer shows of each artifact's record, in this order.
VIEW_FIELDS = (
    "artifact_id",
    "kind",
    "author",
    "content",
    "trust",
    "lifecycle",
    "resolution",
    "impact",
    "confidence",
    "source",
    "goal_id",
    "revises",
    "supersedes",
    "superseded_by",
    "contradicted_by",
    "forgotten",
    "flags",
    "created_at",
    "created_event_id",
)


@dataclass(frozen=True)
class ArtifactView:
    state: ArtifactState
    relevance: float
    verifications: tuple[Verification, ...] = ()
    review: str | None = None  # under the project's review policy: awaiting review, reviewed, or nothing asked

    def as_dict(self) -> dict[str, Any]:
        record = self.state.to_record()
        return {name: record[name] for name in VIEW_FIELDS} | {
            "vouched": self.state.vouched(),
            "review": self.review,
            "relevance": round(self.relevance, 6),
            "verifications": [
                {
                    "verifier": v.verifier,
                    "event_id": v.event_id,
                    "at": v.recorded_at.isoformat(),
                    "note": v.note,
                    "human_review": v.human_review,
                }
                for v in self.verifications
            ],
        }


@dataclass(frozen=True)
class Snapshot:
    """A project's artifacts and verification log, now or as of a time."""

    project: str
    at: datetime
    states: dict[str, ArtifactState]
    verifications: tuple[Verification, ...]
    policy: ReviewPolicy | None = None  # the project's review policy then

    def view(self, state: ArtifactState, *, with_log: bool = False) -> ArtifactView:
        log = tuple(v for v in self.verifications if v.artifact_id == state.artifact_id) if with_log else ()
        return ArtifactView(state, relevance(state, self.at), log, review_status(state, self.policy))

    def safe_ranked(self, views: list[ArtifactView], limit: int) -> list[ArtifactView]:
        """The safe door's order: by relevance, then the review policy (awaiting review last, or withheld)."""
        return safe_review_order(_ranked(views, len(views)), lambda v: v.review, self.policy)[:limit]


def snapshot(journal: Journal, project: str, *, as_of: datetime | None = None) -> Snapshot:
    """Raises Unavailable or ComponentFailed."""
    with journal.reading(f"reading the state of {project}", one_snapshot=True) as conn:
        if as_of is None:
            rows = conn.execute(select(artifacts_table).where(artifacts_table.c.project == project))
            states = {r.artifact_id: row_to_state(r._mapping) for r in rows}
            found = conn.execute(
                select(verifications).where(verifications.c.project == project).order_by(verifications.c.stream_seq)
            )
            log = tuple(
                Verification(
                    r.event_id, r.artifact_id, r.verifier, as_utc(r.recorded_at), r.stream_seq, r.note, r.human_review
                )
                for r in found
            )
            return Snapshot(project, datetime.now(UTC), states, log, _newest_policy(conn, project))
        cutoff = as_of.astimezone(UTC)
        rows = conn.execute(
            select(events.c.envelope, events.c.stream_seq)
            # JetStream's clock, not the publisher's: what had reached the stream by then is a prefix of it
            .where(
                events.c.project == project,
                stored_at() <= cutoff,
                events.c.status != FORGOTTEN,  # erased content is not part of any past either
            )
            .order_by(events.c.stream_seq)
        )
        authority = enrolments_in_journal(conn, policies=True)
        erased = forgets_in_journal(conn, authority)
        fold = Fold.of([(validate_event(json.loads(r.envelope)), r.stream_seq) for r in rows], erased, authority)
    then = [p for _, p in authority.policies.get(project, ()) if p.set_at <= cutoff]
    return Snapshot(project, cutoff, fold.artifacts, tuple(fold.verifications), then[-1] if then else None)


def _newest_policy(conn: Connection, project: str) -> ReviewPolicy | None:
    newest = conn.execute(
        select(review_policies.c.policy)
        .where(review_policies.c.project == project)
        .order_by(review_policies.c.stream_seq.desc())
        .limit(1)
    ).scalar()
    return ReviewPolicy.model_validate_json(newest) if newest is not None else None


def review_policy(journal: Journal, project: str) -> ReviewPolicy | None:
    """The project's review policy as this journal last recorded it (None: none was ever set). Raises
    Unavailable or ComponentFailed."""
    with journal.reading(f"reading the review policy of {project}") as conn:
        return _newest_policy(conn, project)


def _ranked(views: list[ArtifactView], limit: int) -> list[ArtifactView]:
    return sorted(views, key=lambda v: (-v.relevance, v.state.artifact_id))[:limit]


def artifacts(
    journal: Journal,
    project: str,
    *,
    kinds: set[str] | None = None,
    include_resolved: bool = False,
    as_of: datetime | None = None,
    limit: int = 50,
) -> list[ArtifactView]:
    """The safe door: never contradicted, rolled back, retracted, mistyped or forgotten artifacts; other
    resolved ones only with include_resolved. Ranked by relevance."""
    snap = snapshot(journal, project, as_of=as_of)
    chosen = [
        snap.view(s)
        for s in snap.states.values()
        if s.safe(include_resolved=include_resolved) and (kinds is None or s.kind in kinds)
    ]
    return snap.safe_ranked(chosen, limit)


def audit_artifacts(
    journal: Journal, project: str, *, kinds: set[str] | None = None, as_of: datetime | None = None, limit: int = 500
) -> list[ArtifactView]:
    """The audit door: everything, whatever its state, with its verification log."""
    snap = snapshot(journal, project, as_of=as_of)
    chosen = [snap.view(s, with_log=True) for s in snap.states.values() if kinds is None or s.kind in kinds]
    return _ranked(chosen, limit)


def artifact_lineage(journal: Journal, project: str, artifact_id: str, *, as_of: datetime | None = None) -> Lineage:
    """The revises, supersedes and contradiction links around an artifact, each member with its state, from
    the same states as the audit door. Raises NotFound naming the artifact and the project."""
    return lineage(snapshot(journal, project, as_of=as_of).states, artifact_id, project=project)


@dataclass(frozen=True)
class Briefing:
    project: str
    goal: str | None
    at: datetime
    top: list[ArtifactView]
    for_goal: list[ArtifactView]
    open_unknowns: list[ArtifactView]
    recent_mistakes_and_dead_ends: list[ArtifactView]
    recently_superseded: list[ArtifactView]
    unearned_confidence: list[ArtifactView]
    previously_retracted: list[ArtifactView]

    def as_dict(self) -> dict[str, Any]:
        sections = (
            "top",
            "for_goal",
            "open_unknowns",
            "recent_mistakes_and_dead_ends",
            "recently_superseded",
            "unearned_confidence",
            "previously_retracted",
        )
        return {"project": self.project, "goal": self.goal, "at": self.at.isoformat()} | {
            name: [v.as_dict() for v in getattr(self, name)] for name in sections
        }


def briefing(
    journal: Journal, project: str, goal: str | None = None, *, as_of: datetime | None = None, limit: int = 10
) -> Briefing:
    """What a starting agent needs without a query."""
    snap = snapshot(journal, project, as_of=as_of)
    safe = [snap.view(s) for s in snap.states.values() if s.safe()]
    recent_since = snap.at - RECENT
    superseded = [
        snap.view(s)
        for s in snap.states.values()
        if s.resolution is ResolutionKind.superseded
        and not s.forgotten
        and s.trust not in UNSAFE_TRUST
        and (s.updated_at or s.created_at) >= recent_since
    ]
    return Briefing(
        project=project,
        goal=goal,
        at=snap.at,
        top=snap.safe_ranked([v for v in safe if v.state.kind != UNKNOWN_KIND], limit),
        for_goal=snap.safe_ranked([v for v in safe if goal is not None and v.state.goal_id == goal], limit),
        open_unknowns=snap.safe_ranked([v for v in safe if v.state.kind == UNKNOWN_KIND], limit),
        recent_mistakes_and_dead_ends=sorted(
            (v for v in safe if v.state.kind in ("mistake", "dead_end") and v.state.created_at >= recent_since),
            key=lambda v: v.state.created_at,
            reverse=True,
        )[:limit],
        recently_superseded=sorted(superseded, key=lambda v: v.state.updated_at or v.state.created_at, reverse=True)[
            :limit
        ],
        unearned_confidence=snap.safe_ranked([v for v in safe if FLAG_UNEARNED in v.state.flags], limit),
        previously_retracted=snap.safe_ranked([v for v in safe if FLAG_PREVIOUSLY_RETRACTED in v.state.flags], limit),
    )


def open_unknown_counts(journal: Journal) -> dict[str, int]:
    """How many open unknowns each project has now (projects with none left out): the count of what
    `briefing(...).open_unknowns` lists before its limit, i.e. `unknown` artifacts the safe door shows (not
    forgotten, contradicted or rolled back, and not resolved), in one grouped query over the live projection.
    Raises Unavailable or ComponentFailed."""
    a = artifacts_table.c
    query = (
        select(a.project, func.count())
        .where(
            a.kind == UNKNOWN_KIND,
            a.forgotten == false(),
            a.trust.not_in(sorted(t.value for t in UNSAFE_TRUST)),
            a.lifecycle != Lifecycle.resolved.value,
        )
        .group_by(a.project)
    )
    with journal.reading("counting open unknowns") as conn:
        return {project: int(count) for project, count in conn.execute(query)}


@dataclass(frozen=True)
class VocabReport:
    project: str
    at: datetime
    artifacts: int
    resolutions: dict[str, int]
    trust: dict[str, int]
    sources: dict[str, int]
    unearned_confidence: int
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "at": self.at.isoformat(),
            "artifacts": self.artifacts,
            "resolutions": self.resolutions,
            "trust": self.trust,
            "sources": self.sources,
            "unearned_confidence": self.unearned_confidence,
            "warnings": self.warnings,
        }


def vocab_report(journal: Journal, project: str, *, as_of: datetime | None = None) -> VocabReport:
    """Whether errors are being recorded at all: counts of resolutions per kind, trust states and sources."""
    snap = snapshot(journal, project, as_of=as_of)
    states = list(snap.states.values())
    resolutions = Counter(s.resolution.value for s in states if s.lifecycle is Lifecycle.resolved and s.resolution)
    trust = Counter(s.trust.value for s in states)
    sources = Counter(s.source.value if s.source else "untagged" for s in states)
    unearned = sum(FLAG_UNEARNED in s.flags for s in states)
    warnings = []
    resolved_total = sum(resolutions.values())
    if resolved_total and resolutions.get("stale", 0) == resolved_total:
        warnings.append(
            f"every resolution ({resolved_total}) is 'stale': nothing was ever retracted, superseded or mistyped; "
            "are errors being recorded as 'retracted'?"
        )
    if states and trust.get("verified", 0) == 0:
        warnings.append(f"none of {len(states)} artifacts is verified: claims are not being checked by a second agent")
    if states and sources.get("untagged", 0) == len(states):
        warnings.append("no artifact says how it was arrived at (source): unearned confidence cannot be detected")
    if unearned:
        warnings.append(f"{unearned} claim(s) with confidence >= 0.8 rest on intuition alone (unearned confidence)")
    return VocabReport(
        project=project,
        at=snap.at,
        artifacts=len(states),
        resolutions={k.value: resolutions.get(k.value, 0) for k in ResolutionKind},
        trust={k.value: trust.get(k.value, 0) for k in Trust},
        sources={k.value: sources.get(k.value, 0) for k in EpistemicSource} | {"untagged": sources.get("untagged", 0)},
        unearned_confidence=unearned,
        warnings=warnings,
    )


def artifact_ids_like(journal: Journal, project: str | None, value: str, digits: str) -> list[str]:
    """The artifact ids of a project (of every project when None) that `value` may abbreviate: the id equal to
    it, and those whose digits (bus.model.ids.id_digits) start with `digits`; sorted, at most SHOWN_MATCHES + 1."""
    column = events.c.artifact_id
    where = [] if project is None else [events.c.project == project]
    exact = select(column).where(column == value, *where).limit(1)
    starting = func.lower(func.replace(column, "-", "")).like(digits + "%")  # digits only: no LIKE wildcards
    prefixed = select(column).where(starting, *where).distinct().order_by(column).limit(SHOWN_MATCHES + 1)
    with journal.reading("looking up artifact ids") as conn:
        found = list(conn.execute(exact).scalars())
        return found + [i for i in conn.execute(prefixed).scalars() if i not in found]
