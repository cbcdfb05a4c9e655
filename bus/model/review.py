"""A project's review policy: claims at or above an impact need a person's review. Until a person verifies one
(`ArtifactState.reviewed_by`), it is `awaiting review`, and the safe door ranks it after the rest or withholds
it. An admin asks a node to set it; the node records it on the stream in the policy project, next to the
enrolments, so every path reads the same policy at the same point of the stream. `review_status` and
`safe_review_order` are the one rule every read door applies."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from bus.model.auth import ReviewPolicy
from bus.model.state import ArtifactState
from bus.model.vocab import ReviewMode

AWAITING_REVIEW = "awaiting review"
REVIEWED = "reviewed"
T = TypeVar("T")


def review_status(state: ArtifactState, policy: ReviewPolicy | None) -> str | None:
    """`awaiting review` when the policy asks a person to review this claim and none has; `reviewed` when one
    has; None when the policy asks nothing of it."""
    if policy is None or policy.human_review_impact is None:
        return None
    if state.impact is None or state.impact < policy.human_review_impact:
        return None
    return REVIEWED if state.reviewed_by else AWAITING_REVIEW


def vouched_cells(vouched: Mapping[str, Any], review: str | None = None) -> tuple[str, str]:
    """Who vouched (`ArtifactState.vouched()`) as two narrow table cells, agents and people: ("1", "dana"),
    ("2", "dana+1") (the last person and how many more), ("", "awaiting") for a claim awaiting a person's
    review under its project's policy, ("", "") when no one vouched."""
    people, agents = int(vouched["people"]), int(vouched["agents"])
    named = f"{vouched['last_person']}" + (f"+{people - 1}" if people > 1 else "") if people else ""
    return (str(agents) if agents else "", named or ("awaiting" if review == AWAITING_REVIEW else ""))


def withheld(status: str | None, policy: ReviewPolicy | None) -> bool:
    """Whether the safe door leaves out a claim of this `review_status` under the policy."""
    return status == AWAITING_REVIEW and policy is not None and policy.mode is ReviewMode.withhold


def safe_review_order(items: Sequence[T], status_of: Callable[[T], str | None], policy: ReviewPolicy | None) -> list[T]:
    """The safe door's items under the policy, order otherwise kept: those whose `review_status` is awaiting
    review after the rest (`rank`), or left out (`withhold`)."""
    waiting = [status_of(item) == AWAITING_REVIEW for item in items]
    kept = [item for item, wait in zip(items, waiting, strict=True) if not wait]
    last = [item for item, wait in zip(items, waiting, strict=True) if wait and not withheld(AWAITING_REVIEW, policy)]
    return kept + last
