"""Recall by meaning: `recall` is the safe door, `audit_recall` the separate audit door. Hits are
ranked by similarity x relevance and carry their state and provenance. A mirror that is missing or fails is an
error, never an empty list that looks like "no matches"."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from bus.errors import ConfigError
from bus.intake.admission import TimeBounds
from bus.model.auth import ReviewPolicy
from bus.model.review import review_status, safe_review_order
from bus.model.state import ArtifactState, relevance
from observers.journal import Journal
from observers.mirror.embed import Embedder
from observers.mirror.observer import payload_state
from observers.mirror.store import Filter, Hit, VectorStore
from observers.reads import snapshot

OVERFETCH = 4  # candidates per wanted hit: relevance reorders what similarity found


@dataclass(frozen=True)
class RecallHit:
    artifact_id: str
    event_id: str
    kind: str
    content: str
    similarity: float
    relevance: float
    score: float
    state: Mapping[str, Any]
    provenance: Mapping[str, Any]
    vouched: Mapping[str, Any]
    review: str | None = None  # under the project's review policy: awaiting review, reviewed, or nothing asked

    def as_dict(self) -> dict[str, Any]:
        return {
            "artifact_id": self.artifact_id,
            "event_id": self.event_id,
            "kind": self.kind,
            "content": self.content,
            "similarity": round(self.similarity, 6),
            "relevance": round(self.relevance, 6),
            "score": round(self.score, 6),
            "state": dict(self.state),
            "provenance": dict(self.provenance),
            "vouched": dict(self.vouched),
            "review": self.review,
        }


@dataclass(frozen=True)
class RecallResult:
    query: str
    project: str
    hits: list[RecallHit]
    nodes: list[str] = field(default_factory=list)  # which nodes answered
    missing_nodes: list[str] = field(default_factory=list)  # asked, did not answer in time

    def as_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "project": self.project,
            "hits": [h.as_dict() for h in self.hits],
            "nodes": self.nodes,
            "missing_nodes": self.missing_nodes,
        }


def safe_filter(project: str, *, kinds: Sequence[str] | None, include_resolved: bool) -> Filter:
    """What the safe door may return: never contradicted, rolled back, retracted or mistyped."""
    equals: dict[str, Any] = {"project": project}  # forgotten artifacts have no points: the mirror deletes them
    if not include_resolved:
        equals["lifecycle"] = "active"
    return Filter(
        equals=equals,
        any_of={"kind": list(kinds)} if kinds else {},
        none_of={"trust": ["contradicted", "rolled_back"], "resolution": ["retracted", "mistyped"]},
    )


# What a hit shows of its artifact's state.
HIT_STATE_FIELDS = ("trust", "lifecycle", "resolution", "superseded_by", "contradicted_by")


def _hit(found: Hit, state: ArtifactState, now: datetime, policy: ReviewPolicy | None = None) -> RecallHit:
    weight = relevance(state, now)
    payload = found.payload
    record = state.to_record()
    return RecallHit(
        artifact_id=state.artifact_id,
        event_id=str(payload.get("event_id")),
        kind=state.kind,
        content=state.content,
        similarity=found.score,
        relevance=weight,
        score=found.score * weight,
        state={name: record[name] for name in HIT_STATE_FIELDS},
        provenance={
            "actor": state.author,
            "event_id": state.created_event_id,
            "node": payload.get("node"),
            "evidence": payload.get("evidence", []),
            "recorded_at": record["created_at"],
            "commit": next((e["ref"] for e in payload.get("evidence", []) if e.get("kind") == "commit"), None),
        },
        vouched=state.vouched(),
        review=review_status(state, policy),
    )


async def _candidates(
    store: VectorStore, embedder: Embedder, query: str, where: Filter, k: int, timings: dict[str, float] | None
) -> list[Hit]:
    if not query.strip():
        raise ConfigError("query", "is empty; say what to recall")
    started = time.perf_counter()
    (vector,) = await embedder.embed([query])
    embedded = time.perf_counter()
    found = await store.search(vector, where, limit=k * OVERFETCH)
    if timings is not None:  # where a recall's time goes: the node's metrics add them up
        timings["embed"] = timings.get("embed", 0.0) + embedded - started
        timings["search"] = timings.get("search", 0.0) + time.perf_counter() - embedded
    return found


async def recall(
    store: VectorStore,
    embedder: Embedder,
    query: str,
    project: str,
    *,
    k: int = 10,
    kinds: Sequence[str] | None = None,
    include_resolved: bool = False,
    as_of: datetime | None = None,
    journal: Journal | None = None,
    timings: dict[str, float] | None = None,
    policy: ReviewPolicy | None = None,
) -> RecallResult:
    """The safe door. With as_of, candidates recorded by then are judged by the state the journal says they
    had then (the mirror holds only the current state). `policy`: the project's review policy (claims awaiting
    a person's review ranked after the rest, or withheld). `timings` (when given) adds up the seconds spent
    embedding the query and searching. Raises Unavailable if the store or model fails."""
    if as_of is None:
        where = safe_filter(project, kinds=kinds, include_resolved=include_resolved)
        found = await _candidates(store, embedder, query, where, k, timings)
        now = datetime.now(UTC)
        hits = [_hit(h, payload_state(h.payload), now, policy) for h in found]
    else:
        if journal is None:
            raise ConfigError("as_of", "recall as of a time needs the journal (pass journal=)")
        where = Filter(
            equals={"project": project},
            any_of={"kind": list(kinds)} if kinds else {},
            # A claim is in the past at as_of if the stream had it by then; its recorded_at is at most the
            # admitted clock skew later than that, so this only narrows the candidates the journal then judges.
            at_most={"created_ts": as_of.timestamp() + TimeBounds.from_env().future_skew_s},
        )
        found = await _candidates(store, embedder, query, where, k * 2, timings)
        then = snapshot(journal, project, as_of=as_of)
        policy = then.policy  # the policy in force then
        hits = [
            _hit(h, then.states[aid], then.at, policy)
            for h in found
            if (aid := str(h.payload.get("artifact_id"))) in then.states
            and then.states[aid].safe(include_resolved=include_resolved)
        ]
    ranked = sorted(hits, key=lambda h: -h.score)
    return RecallResult(query, project, safe_review_order(ranked, lambda h: h.review, policy)[:k])


async def audit_recall(
    store: VectorStore,
    embedder: Embedder,
    query: str,
    project: str,
    *,
    k: int = 10,
    kinds: Sequence[str] | None = None,
    timings: dict[str, float] | None = None,
) -> RecallResult:
    """The audit door: everything the mirror holds for the project, whatever its state, with that state."""
    where = Filter(equals={"project": project}, any_of={"kind": list(kinds)} if kinds else {})
    found = await _candidates(store, embedder, query, where, k, timings)
    now = datetime.now(UTC)
    hits = [_hit(h, payload_state(h.payload), now) for h in found]
    return RecallResult(query, project, sorted(hits, key=lambda h: -h.score)[:k])
