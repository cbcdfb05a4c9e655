"""What the mirror tells a listener after each batch it wrote (the watches' matcher listens): the claims it
indexed with their vectors, the artifacts whose state changed, and the artifacts forgotten."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from bus.model.authority import Authority
from bus.model.state import ArtifactState


@dataclass(frozen=True)
class IndexedClaim:
    """A claim the mirror has just written, with the vector it wrote, where it stands in the stream, and the
    stream's enrolment records as of then (who was a member of what)."""

    event_id: str
    state: ArtifactState
    recorded_at: datetime
    vector: Sequence[float]
    stream_seq: int
    authority: Authority


class MirrorListener(Protocol):
    """Called once the batch's writes are in the store. A listener that raises Unavailable makes the runner hold
    the batch and deliver it again (the mirror's writes are idempotent), so a listener must be idempotent too."""

    async def indexed(self, claims: Sequence[IndexedClaim]) -> None:
        """New claims, with the state they have at the end of the batch."""

    async def changed(self, states: Sequence[ArtifactState]) -> None:
        """Artifacts indexed before whose state a transition of this batch changed."""

    async def forgotten(self, artifacts: Sequence[tuple[str, str]]) -> None:
        """(project, artifact_id) of artifacts forgotten in this batch: their content must go everywhere."""
