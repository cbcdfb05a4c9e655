"""Rollback planning: walk `revises` back to the nearest verified ancestor, roll back the
intermediates, and report every descendant built on them as tainted (rolled back too with cascade).
Pure: plans from artifact states; a cycle or a broken chain is an IllegalTransition, never a loop."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bus.errors import IllegalTransition
from bus.model.state import ArtifactState
from bus.model.vocab import Trust


@dataclass(frozen=True)
class RollbackPlan:
    target: str
    verified_ancestor: str
    intermediates: tuple[str, ...]  # the target first, walking up to (not including) the verified ancestor
    tainted: tuple[str, ...]  # descendants of the intermediates, nearest first
    already_rolled_back: tuple[str, ...]
    cascade: bool

    @property
    def to_roll_back(self) -> tuple[str, ...]:
        return self.intermediates + (self.tainted if self.cascade else ())

    def as_dict(self) -> dict[str, object]:
        return {
            "target": self.target,
            "verified_ancestor": self.verified_ancestor,
            "intermediates": list(self.intermediates),
            "tainted": list(self.tainted),
            "already_rolled_back": list(self.already_rolled_back),
            "cascade": self.cascade,
            "to_roll_back": list(self.to_roll_back),
        }


def plan_rollback(artifacts: Mapping[str, ArtifactState], artifact_id: str, *, cascade: bool = False) -> RollbackPlan:
    """Raises IllegalTransition when the target is missing or terminal, the chain has a cycle or a missing
    link, or no verified ancestor exists."""
    target = artifacts.get(artifact_id)
    if target is None:
        raise IllegalTransition(artifact_id, "absent", "rolled_back", "no such artifact")
    # An already rolled-back target is planned anyway: a rollback stopped halfway (a Conflict on one link)
    # is resumed by running it again; what is done already is reported in `already_rolled_back`.
    chain = [target]
    seen = {artifact_id}
    parent_id = target.revises
    while True:
        if parent_id is None:
            path = " → ".join(s.artifact_id for s in chain)
            raise IllegalTransition(
                artifact_id,
                target.state_label,
                "rolled_back",
                f"no verified ancestor on its revises chain ({path}); contradict or retract it instead",
            )
        if parent_id in seen:
            path = " → ".join([*(s.artifact_id for s in chain), parent_id])
            raise IllegalTransition(
                artifact_id, target.state_label, "rolled_back", f"revises chain has a cycle: {path}"
            )
        parent = artifacts.get(parent_id)
        if parent is None:
            raise IllegalTransition(
                artifact_id,
                target.state_label,
                "rolled_back",
                f"revises chain is broken: {chain[-1].artifact_id} revises missing {parent_id}",
            )
        if parent.trust is Trust.verified:
            break
        seen.add(parent_id)
        chain.append(parent)
        parent_id = parent.revises
    intermediates = [s.artifact_id for s in chain]
    tainted = _descendants(artifacts, intermediates)
    done = tuple(a for a in [*intermediates, *tainted] if artifacts[a].trust is Trust.rolled_back)
    return RollbackPlan(
        target=artifact_id,
        verified_ancestor=parent.artifact_id,
        intermediates=tuple(a for a in intermediates if a not in done),
        tainted=tuple(a for a in tainted if a not in done),
        already_rolled_back=done,
        cascade=cascade,
    )


def _descendants(artifacts: Mapping[str, ArtifactState], roots: list[str]) -> list[str]:
    children: dict[str, list[str]] = {}
    for state in artifacts.values():
        if state.revises is not None:
            children.setdefault(state.revises, []).append(state.artifact_id)
    found: list[str] = []
    seen = set(roots)
    frontier = list(roots)
    while frontier:  # breadth first: nearest descendants first; `seen` makes a cycle finite
        next_frontier = []
        for node in frontier:
            for child in sorted(children.get(node, [])):
                if child not in seen:
                    seen.add(child)
                    found.append(child)
                    next_frontier.append(child)
        frontier = next_frontier
    return found
