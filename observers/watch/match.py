"""Which standing questions a batch of newly indexed claims answers: one matrix product per project and batch,
never a search per watch, and one rule (`notifiable`) for whether a watch may be told of a claim."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import numpy.typing as npt
from threadpoolctl import ThreadpoolController

from bus.errors import ModelMismatch
from bus.model.event import Actor
from bus.model.state import ArtifactState
from bus.model.watch import NOTICE_WINDOW_S, WatchRecord
from observers.mirror.listener import IndexedClaim

Matrix = npt.NDArray[np.float32]


@dataclass(frozen=True)
class WatchMatch:
    watch: WatchRecord
    claim: IndexedClaim
    score: float


def member_at(watch: WatchRecord, claim: IndexedClaim) -> bool:
    """Whether the watch's owner was an active member of the claim's project where the claim stands in the
    stream: every node reads the same enrolment records there, so every node decides alike."""
    owner = Actor(agent_id=watch.agent_id, public_key=watch.owner_key)
    standing = claim.authority.standing(owner, claim.stream_seq)
    return standing.active and standing.public_key == watch.owner_key and standing.member_of(claim.state.project)


def notifiable(watch: WatchRecord, state: ArtifactState, recorded_at: datetime, now: datetime, member: bool) -> bool:
    """Whether `watch` may be told of the claim whose state is `state`: a live watch of a member of the claim's
    project and kind, a claim recorded after the watch was made and within the notice window (a node catching up
    on old history pushes nothing), and a claim the safe door shows unless the watch is an audit one. A forgotten
    claim is never pushed, not even to an audit watch."""
    if watch.expired(now) or not member or state.forgotten:
        return False
    if state.project not in watch.projects or (watch.kinds is not None and state.kind not in watch.kinds):
        return False
    if recorded_at < watch.created_at or (now - recorded_at).total_seconds() > NOTICE_WINDOW_S:
        return False
    return watch.audit or state.safe()


_blas: list[ThreadpoolController] = []  # made at the first product, once numpy's BLAS is loaded


def product(claims: Matrix, watches: Matrix) -> Matrix:
    """Claims x watches cosine scores on one BLAS thread: OpenBLAS's idle threads spin after a call, and on 2
    cores they took a fifth of the CPU the node's model needed (`python -m bench --only watch`: mirror ingest
    0.80 of a project nobody watches with its default threads, 1.0 with one)."""
    if not _blas:
        _blas.append(ThreadpoolController())
    with _blas[0].limit(limits=1, user_api="blas"):
        return claims @ watches.T


def unit_rows(vectors: Iterable[Sequence[float]], dimension: int) -> Matrix:
    """Vectors as rows of unit length, so a product of two is their cosine. Raises ModelMismatch for a vector of
    another dimension."""
    rows = np.asarray(list(vectors), dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != dimension:
        raise ModelMismatch(f"vectors shaped {rows.shape}", f"{dimension}-d")
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return (rows / np.where(norms == 0, 1.0, norms)).astype(np.float32)


@dataclass
class WatchBook:
    """The watches a node matches claims against, with their vectors (of this node's model) as one matrix per
    project. `put` and `remove` are idempotent; the matrices are rebuilt on the next match after a change."""

    model_id: str
    dimension: int
    _watches: dict[str, tuple[WatchRecord, Matrix]] = field(default_factory=dict)
    _by_project: dict[str, tuple[list[WatchRecord], Matrix]] | None = None

    def put(self, record: WatchRecord, vector: Sequence[float]) -> None:
        """Hold `record`, matched with `vector` (its words under this node's model). Raises ModelMismatch for a
        vector of another dimension."""
        if len(vector) != self.dimension:
            raise ModelMismatch(f"a {len(vector)}-d vector for watch {record.watch_id}", f"{self.dimension}-d")
        self._watches[record.watch_id] = (record, unit_rows([vector], self.dimension))
        self._by_project = None

    def remove(self, watch_id: str) -> None:
        if self._watches.pop(watch_id, None) is not None:
            self._by_project = None

    def get(self, watch_id: str) -> WatchRecord | None:
        held = self._watches.get(watch_id)
        return held[0] if held is not None else None

    def records(self) -> list[WatchRecord]:
        return [record for record, _ in self._watches.values()]

    def __len__(self) -> int:
        return len(self._watches)

    def _project_matrices(self) -> dict[str, tuple[list[WatchRecord], Matrix]]:
        if self._by_project is None:
            grouped: dict[str, list[tuple[WatchRecord, Matrix]]] = {}
            for record, row in self._watches.values():
                for project in record.projects:
                    grouped.setdefault(project, []).append((record, row))
            self._by_project = {
                project: ([record for record, _ in held], np.vstack([row for _, row in held]))
                for project, held in grouped.items()
            }
        return self._by_project

    def match(self, claims: Sequence[IndexedClaim], now: datetime) -> list[WatchMatch]:
        """Every (watch, claim) pair at or above the watch's threshold that `notifiable` allows, best first per
        claim. Raises ModelMismatch for a claim vector of another dimension."""
        by_project: dict[str, list[IndexedClaim]] = {}
        for claim in claims:
            by_project.setdefault(claim.state.project, []).append(claim)
        matrices = self._project_matrices()
        found: list[WatchMatch] = []
        for project, held in by_project.items():
            if project not in matrices:
                continue
            watches, matrix = matrices[project]
            scores = product(unit_rows([c.vector for c in held], self.dimension), matrix)
            rows, columns = np.nonzero(scores >= np.array([w.threshold for w in watches], dtype=np.float32))
            for i, j in zip(rows, columns, strict=True):
                claim, watch = held[int(i)], watches[int(j)]
                if notifiable(watch, claim.state, claim.recorded_at, now, member_at(watch, claim)):
                    found.append(WatchMatch(watch, claim, float(scores[i, j])))
        return found
