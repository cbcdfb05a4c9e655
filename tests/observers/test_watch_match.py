"""The watch matching rule, on its own: one matrix product per project gives exactly the pairs a watch-by-watch,
claim-by-claim check gives (hypothesis), and `notifiable` says no to what a watch may not be told."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.model.auth import Enrolment
from bus.model.authority import NO_RECORDS, Authority
from bus.model.state import ArtifactState
from bus.model.vocab import Lifecycle, ResolutionKind, Role, Trust
from bus.model.watch import NOTICE_WINDOW_S, WatchRecord
from observers.mirror.listener import IndexedClaim
from observers.watch.match import WatchBook, notifiable

DIM = 6
NOW = datetime(2026, 12, 1, tzinfo=UTC)
OWNER = "U" + "A" * 55
PROJECTS = ["p1", "p2", "p3"]


def watch(vector: list[float], *, projects: list[str], threshold: float, kinds: list[str] | None = None,
          audit: bool = False, created: datetime = NOW - timedelta(hours=1)) -> WatchRecord:  # fmt: skip
    return WatchRecord(
        watch_id=uuid.uuid4().hex, agent_id="alice", about="words", projects=projects, kinds=kinds,
        threshold=threshold, audit=audit, created_at=created, expires_at=created + timedelta(days=7),
        owner_key=OWNER, model_id="m", dimension=DIM, vector=vector, node="n",
    )  # fmt: skip


def claim(vector: list[float], project: str, *, kind: str = "finding", state: dict[str, object] | None = None,
          recorded: datetime = NOW, authority: Authority = NO_RECORDS) -> IndexedClaim:  # fmt: skip
    made = ArtifactState(
        project=project, artifact_id=f"a{uuid.uuid4().hex[:8]}", kind=kind, author="bob",
        created_event_id=str(uuid.uuid4()), created_at=recorded, content="text", content_hash="0" * 64,
        impact=0.5, confidence=0.5, source=None, **(state or {}),  # type: ignore[arg-type]
    )  # fmt: skip
    return IndexedClaim(made.created_event_id, made, recorded, vector, 10, authority)


vectors = st.lists(st.floats(-1, 1, allow_nan=False, width=32), min_size=DIM, max_size=DIM).filter(
    lambda v: math.sqrt(sum(x * x for x in v)) > 0.1
)


def cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


@settings(max_examples=60, deadline=None)
@given(
    watches=st.lists(
        st.tuples(vectors, st.sets(st.sampled_from(PROJECTS), min_size=1), st.floats(0.05, 0.95)),
        min_size=1,
        max_size=8,
    ),
    claims=st.lists(st.tuples(vectors, st.sampled_from(PROJECTS)), min_size=1, max_size=12),
)
def test_one_product_per_project_finds_exactly_the_pairs_checked_one_by_one(
    watches: list[tuple[list[float], set[str], float]], claims: list[tuple[list[float], str]]
) -> None:
    book = WatchBook("m", DIM)
    made = [watch(v, projects=sorted(p), threshold=t) for v, p, t in watches]
    for record in made:
        book.put(record, record.vector)
    indexed = [claim(v, p) for v, p in claims]
    found = {(m.watch.watch_id, m.claim.event_id) for m in book.match(indexed, NOW)}
    for c in indexed:
        for w in made:
            score = cosine(list(c.vector), w.vector)
            if abs(score - w.threshold) < 1e-4:
                continue  # float32 against float64 at the edge: either answer is right
            wanted = c.state.project in w.projects and score >= w.threshold
            assert ((w.watch_id, c.event_id) in found) == wanted, (score, w.threshold, c.state.project, w.projects)


def test_a_watch_is_told_only_what_it_may_be() -> None:
    w = watch([1.0] * DIM, projects=["p1"], threshold=0.5, kinds=["finding"])
    member = claim([1.0] * DIM, "p1")
    assert notifiable(w, member.state, member.recorded_at, NOW, True)
    assert not notifiable(w, member.state, member.recorded_at, NOW, False)  # no longer a member
    assert not notifiable(w, claim([1.0] * DIM, "p2").state, NOW, NOW, True)  # another project
    assert not notifiable(w, claim([1.0] * DIM, "p1", kind="decision").state, NOW, NOW, True)  # another kind
    before = NOW - timedelta(hours=2)
    assert not notifiable(w, claim([1.0] * DIM, "p1", recorded=before).state, before, NOW, True)  # before the watch
    old = watch([1.0] * DIM, projects=["p1"], threshold=0.5, created=NOW - timedelta(days=30))
    stale = NOW - timedelta(seconds=NOTICE_WINDOW_S + 1)
    assert not notifiable(old, claim([1.0] * DIM, "p1").state, stale, NOW, True)  # past the notice window
    assert not notifiable(w, member.state, member.recorded_at, NOW + timedelta(days=8), True)  # expired
    retracted = claim(
        [1.0] * DIM, "p1", state={"resolution": ResolutionKind.retracted, "lifecycle": Lifecycle.resolved}
    )
    contradicted = claim([1.0] * DIM, "p1", state={"trust": Trust.contradicted})
    for unsafe in (retracted, contradicted):
        assert not notifiable(w, unsafe.state, NOW, NOW, True)
        assert notifiable(w.model_copy(update={"audit": True}), unsafe.state, NOW, NOW, True)  # the audit door
    forgotten = claim([1.0] * DIM, "p1", state={"forgotten": True})
    for door in (w, w.model_copy(update={"audit": True})):  # a forgotten claim is pushed through neither door
        assert not notifiable(door, forgotten.state, NOW, NOW, True)


def test_membership_is_read_where_the_claim_stands_in_the_stream() -> None:
    elsewhere = Enrolment.model_validate(
        {"agent_id": "alice", "public_key": OWNER, "projects": ["p2"], "roles": [Role.agent.value],
         "owner": "alice", "enrolled_at": NOW.isoformat(), "enrolled_by": "admin"}
    )  # fmt: skip
    book = WatchBook("m", DIM)
    w = watch([1.0] * DIM, projects=["p1"], threshold=0.5)
    book.put(w, w.vector)
    moved = Authority.of([(5, elsewhere)])  # from stream sequence 5 on, alice is in p2 only
    assert book.match([claim([1.0] * DIM, "p1")], NOW)  # no record: a first-use agent of every project
    assert not book.match([claim([1.0] * DIM, "p1", authority=moved)], NOW)
