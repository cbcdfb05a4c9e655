"""The mirror observer: embeds every claim and upserts it as one point with the deterministic point id of
DESIGN §2, and carries every state transition into the payload of the affected artifacts' points (§10.5),
so the safe door never shows a retracted, contradicted or rolled-back item once the transition is mirrored.

A store or model that fails raises Unavailable: the runner holds the batch and retries (the mirror reports
degraded, the journal is never blocked), and no placeholder vector is ever written (§10.4)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import Any

from bus.errors import IllegalTransition
from bus.ids import point_id
from bus.runner import Delivery
from bus.state import ArtifactState, decide, event_references
from bus.vocab import EpistemicSource, Lifecycle, ResolutionKind, Trust
from observers.mirror.embed import Embedder
from observers.mirror.store import Filter, Point, VectorStore

STATE_FIELDS = (
    "trust",
    "lifecycle",
    "resolution",
    "superseded_by",
    "supersedes",
    "contradicted_by",
    "forgotten",
    "last_seq",
    "updated_at",
)


def state_payload(state: ArtifactState) -> dict[str, Any]:
    """An artifact's state as JSON-friendly payload fields (times as ISO text and as epoch seconds)."""
    return {
        "project": state.project,
        "artifact_id": state.artifact_id,
        "kind": state.kind,
        "author": state.author,
        "actor": state.author,
        "created_event_id": state.created_event_id,
        "event_id": state.created_event_id,
        "created_at": state.created_at.isoformat(),
        "created_ts": state.created_at.timestamp(),
        "content": state.content,
        "content_hash": state.content_hash,
        "impact": state.impact,
        "confidence": state.confidence,
        "source": state.source.value if state.source else None,
        "goal_id": state.goal_id,
        "revises": state.revises,
        "supersedes": state.supersedes,
        "superseded_by": state.superseded_by,
        "contradicted_by": state.contradicted_by,
        "trust": state.trust.value,
        "lifecycle": state.lifecycle.value,
        "resolution": state.resolution.value if state.resolution else "none",
        "forgotten": state.forgotten,
        "flags": sorted(state.flags),
        "last_seq": state.last_seq,
        "updated_at": state.updated_at.isoformat() if state.updated_at else None,
    }


def payload_state(payload: Mapping[str, Any]) -> ArtifactState:
    resolution = payload.get("resolution")
    updated_at = payload.get("updated_at")
    return ArtifactState(
        project=payload["project"],
        artifact_id=payload["artifact_id"],
        kind=payload["kind"],
        author=payload["author"],
        created_event_id=payload["created_event_id"],
        created_at=datetime.fromisoformat(payload["created_at"]),
        content=payload["content"],
        content_hash=payload["content_hash"],
        impact=payload.get("impact"),
        confidence=payload.get("confidence"),
        source=EpistemicSource(payload["source"]) if payload.get("source") else None,
        goal_id=payload.get("goal_id"),
        revises=payload.get("revises"),
        supersedes=payload.get("supersedes"),
        superseded_by=payload.get("superseded_by"),
        contradicted_by=payload.get("contradicted_by"),
        trust=Trust(payload["trust"]),
        lifecycle=Lifecycle(payload["lifecycle"]),
        resolution=ResolutionKind(resolution) if resolution and resolution != "none" else None,
        forgotten=bool(payload.get("forgotten")),
        flags=frozenset(payload.get("flags") or ()),
        last_seq=int(payload.get("last_seq") or 0),
        updated_at=datetime.fromisoformat(updated_at) if updated_at else None,
    )


class MirrorObserver:
    """The runner's mirror sink. `name` is the durable consumer: mirrors sharing one store share it."""

    def __init__(self, store: VectorStore, embedder: Embedder, *, name: str, node: str = "local") -> None:
        self.store = store
        self.embedder = embedder
        self.name = name
        self.node = node
        self.indexed = 0
        self.transitions = 0
        self.illegal = 0

    async def handle(self, batch: Sequence[Delivery]) -> None:
        ordered = sorted(batch, key=lambda d: d.stream_seq)
        states = await self._prefetch(ordered)
        changed: dict[tuple[str, str], ArtifactState] = {}
        claims: list[tuple[Delivery, ArtifactState]] = []
        for delivery in ordered:
            event = delivery.event
            lookup = partial(_state_of, states, event.project)
            try:
                change = decide(event, delivery.stream_seq, lookup, _no_tombstones)
            except IllegalTransition:
                self.illegal += 1  # the journal records why; the mirror mirrors only what the state allows
                continue
            for state in change.artifacts:
                key = (state.project, state.artifact_id)
                states[key] = changed[key] = state
            if not event.body.transition:
                claims.append((delivery, change.artifacts[0]))
        await self._index_claims(claims)
        new = {(s.project, s.artifact_id) for _, s in claims}
        for (project, artifact_id), state in changed.items():
            if (project, artifact_id) in new:
                continue
            where = Filter(equals={"project": project, "artifact_id": artifact_id})
            if state.forgotten:  # a privacy delete: the content leaves the mirror, not just the safe door
                await self.store.delete(await self.store.point_ids(where))
                self.transitions += 1
                continue
            fields = {k: v for k, v in state_payload(state).items() if k in STATE_FIELDS}
            await self.store.set_payload(where, fields)
            self.transitions += 1

    async def _prefetch(self, batch: Sequence[Delivery]) -> dict[tuple[str, str], ArtifactState]:
        """Current states, read from the points' payloads, of every artifact the batch refers to."""
        wanted: dict[str, set[str]] = {}
        for delivery in batch:
            wanted.setdefault(delivery.event.project, set()).update(event_references(delivery.event))
        states: dict[tuple[str, str], ArtifactState] = {}
        for project, artifact_ids in wanted.items():
            ids = await self.store.point_ids(
                Filter(equals={"project": project}, any_of={"artifact_id": sorted(artifact_ids)})
            )
            for found in await self.store.retrieve(ids):
                state = payload_state(found.payload)
                states[(state.project, state.artifact_id)] = state
        return states

    async def _index_claims(self, claims: list[tuple[Delivery, ArtifactState]]) -> None:
        if not claims:
            return
        vectors = await self.embedder.embed([state.content for _, state in claims])
        points = [
            Point(
                point_id(delivery.event.event_id),
                vector,
                state_payload(state)
                | {"node": self.node, "stream_seq": delivery.stream_seq, "evidence": _evidence(delivery)},
            )
            for (delivery, state), vector in zip(claims, vectors, strict=True)
        ]
        await self.store.upsert(points)
        self.indexed += len(points)


def _state_of(states: dict[tuple[str, str], ArtifactState], project: str, artifact_id: str) -> ArtifactState | None:
    return states.get((project, artifact_id))


def _no_tombstones(_digest: str) -> bool:
    return False  # flags are the journal's business; the mirror carries trust and lifecycle


def _evidence(delivery: Delivery) -> list[dict[str, Any]]:
    evidence = getattr(delivery.event.body, "evidence", ())
    return [e.model_dump(mode="json") for e in evidence]
