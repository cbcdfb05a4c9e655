"""The lineage of an artifact: the revisions, supersessions and contradictions around it, each member with its
state. Pure: read from a project's artifact states. A hostile history may hold a cycle or point at an artifact
the states lack (forgotten, or never seen); both are reported, never looped over nor dropped."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bus.errors import NotFound
from bus.model.state import ArtifactState
from bus.model.vocab import Lifecycle, ResolutionKind, Trust


@dataclass(frozen=True)
class Member:
    """One artifact of a lineage as its state has it (a forgotten one's content as redacted there), with
    its own links so that a reader can redraw the graph from the lineage alone."""

    artifact_id: str
    kind: str
    author: str
    trust: Trust
    lifecycle: Lifecycle
    resolution: ResolutionKind | None
    forgotten: bool
    content: str
    created_at: datetime
    revises: str | None
    supersedes: str | None
    superseded_by: str | None
    contradicted_by: str | None

    @classmethod
    def of(cls, state: ArtifactState) -> Member:
        return cls(
            artifact_id=state.artifact_id,
            kind=state.kind,
            author=state.author,
            trust=state.trust,
            lifecycle=state.lifecycle,
            resolution=state.resolution,
            forgotten=state.forgotten,
            content=state.content,
            created_at=state.created_at,
            revises=state.revises,
            supersedes=state.supersedes,
            superseded_by=state.superseded_by,
            contradicted_by=state.contradicted_by,
        )

    @property
    def state_label(self) -> str:
        life = f"resolved({self.resolution})" if self.lifecycle is Lifecycle.resolved else "active"
        return f"{self.trust.value}/{life}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "artifact_id": self.artifact_id,
            "kind": self.kind,
            "author": self.author,
            "trust": self.trust.value,
            "lifecycle": self.lifecycle.value,
            "resolution": self.resolution.value if self.resolution else None,
            "forgotten": self.forgotten,
            "content": self.content,
            "created_at": self.created_at.isoformat(),
            "revises": self.revises,
            "supersedes": self.supersedes,
            "superseded_by": self.superseded_by,
            "contradicted_by": self.contradicted_by,
        }


@dataclass(frozen=True)
class Descendant:
    member: Member
    depth: int  # 1: revises the artifact itself; 2: revises one of those; ...

    def as_dict(self) -> dict[str, Any]:
        return self.member.as_dict() | {"depth": self.depth}


@dataclass(frozen=True)
class MissingLink:
    """`holder`'s `link` names `missing`, which the states do not hold."""

    holder: str
    link: str
    missing: str

    def as_dict(self) -> dict[str, str]:
        return {"holder": self.holder, "link": self.link, "missing": self.missing}


@dataclass(frozen=True)
class Cycle:
    """Following `link` from the artifact came back to `ids[0]`; `ids` is the loop in the order walked."""

    link: str
    ids: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"link": self.link, "ids": list(self.ids)}


@dataclass(frozen=True)
class Lineage:
    project: str
    artifact: Member
    ancestors: tuple[Member, ...]  # along `revises`, nearest first, to the root
    descendants: tuple[Descendant, ...]  # what revises it, transitively, breadth first
    supersedes: tuple[Member, ...]  # what it supersedes, and what that superseded, ... nearest first
    superseded_by: tuple[Member, ...]  # what superseded it, and what superseded that, ... nearest first
    contradicted_by: Member | None  # what contradicts it
    contradicts: tuple[Member, ...]  # the artifacts it contradicts
    cycle: tuple[Cycle, ...] = ()
    missing: tuple[MissingLink, ...] = ()

    def members(self) -> tuple[Member, ...]:
        """Every artifact the lineage shows, the artifact first (one may appear in several roles)."""
        found = [self.artifact, *self.ancestors, *(d.member for d in self.descendants), *self.supersedes]
        found += [*self.superseded_by, *([self.contradicted_by] if self.contradicted_by else []), *self.contradicts]
        return tuple(found)

    def as_dict(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "artifact": self.artifact.as_dict(),
            "ancestors": [m.as_dict() for m in self.ancestors],
            "descendants": [d.as_dict() for d in self.descendants],
            "supersedes": [m.as_dict() for m in self.supersedes],
            "superseded_by": [m.as_dict() for m in self.superseded_by],
            "contradicted_by": self.contradicted_by.as_dict() if self.contradicted_by else None,
            "contradicts": [m.as_dict() for m in self.contradicts],
            "cycle": [c.as_dict() for c in self.cycle],
            "missing": [m.as_dict() for m in self.missing],
        }


@dataclass(frozen=True)
class _Walk:
    members: tuple[Member, ...]
    cycle: Cycle | None
    missing: MissingLink | None


def _walk(
    states: Mapping[str, ArtifactState], start: str, link: str, step: Callable[[ArtifactState], str | None]
) -> _Walk:
    """Follow one pointer from `start` until it ends, names an absent artifact, or comes back on itself."""
    path = [start]
    found: list[Member] = []
    current = states[start]
    while (nxt := step(current)) is not None:
        if nxt in path:
            return _Walk(tuple(found), Cycle(link, tuple(path[path.index(nxt) :])), None)
        if nxt not in states:
            return _Walk(tuple(found), None, MissingLink(current.artifact_id, link, nxt))
        current = states[nxt]
        path.append(nxt)
        found.append(Member.of(current))
    return _Walk(tuple(found), None, None)


def _order(state: ArtifactState) -> tuple[datetime, str]:
    return state.created_at, state.artifact_id


def _descendants(states: Mapping[str, ArtifactState], root: str) -> tuple[Descendant, ...]:
    children: dict[str, list[ArtifactState]] = {}
    for state in sorted(states.values(), key=_order):
        if state.revises is not None:
            children.setdefault(state.revises, []).append(state)
    found: list[Descendant] = []
    seen = {root}
    frontier, depth = [root], 0
    while frontier:  # breadth first; `seen` makes a cycle finite (the ancestors' walk reports it)
        depth += 1
        next_frontier = []
        for node in frontier:
            for child in children.get(node, []):
                if child.artifact_id not in seen:
                    seen.add(child.artifact_id)
                    found.append(Descendant(Member.of(child), depth))
                    next_frontier.append(child.artifact_id)
        frontier = next_frontier
    return tuple(found)


def lineage(states: Mapping[str, ArtifactState], artifact_id: str, *, project: str | None = None) -> Lineage:
    """The lineage of `artifact_id` among `states` (one project's artifacts, keyed by id). Raises NotFound
    naming the artifact and the project when the states do not hold it."""
    target = states.get(artifact_id)
    if target is None:
        where = project or next((s.project for s in states.values()), "?")
        raise NotFound(
            "artifact", artifact_id, f"project {where!r} holds no such artifact; `epibus audit -p {where}` lists them"
        )
    walks = (
        _walk(states, artifact_id, "revises", lambda s: s.revises),
        _walk(states, artifact_id, "supersedes", lambda s: s.supersedes),
        _walk(states, artifact_id, "superseded_by", lambda s: s.superseded_by),
    )
    missing = [w.missing for w in walks if w.missing is not None]
    contradicted_by = None
    if target.contradicted_by is not None:
        if target.contradicted_by in states:
            contradicted_by = Member.of(states[target.contradicted_by])
        else:
            missing.append(MissingLink(artifact_id, "contradicted_by", target.contradicted_by))
    contradicts = sorted((s for s in states.values() if s.contradicted_by == artifact_id), key=_order)
    return Lineage(
        project=target.project,
        artifact=Member.of(target),
        ancestors=walks[0].members,
        descendants=_descendants(states, artifact_id),
        supersedes=walks[1].members,
        superseded_by=walks[2].members,
        contradicted_by=contradicted_by,
        contradicts=tuple(Member.of(s) for s in contradicts),
        cycle=tuple(w.cycle for w in walks if w.cycle is not None),
        missing=tuple(missing),
    )
