"""The lineage of an artifact, pure: each link type by example, cycles and links to absent artifacts, and
properties over generated link graphs (hostile ones included). No server."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.errors import NotFound
from bus.model.lineage import Cycle, Lineage, Member, MissingLink, lineage
from bus.model.state import ArtifactState
from bus.model.tombstones import content_hash
from bus.model.vocab import Lifecycle, ResolutionKind, Trust

P = "proj"
T0 = datetime(2024, 5, 1, tzinfo=UTC)
LINKS = ("revises", "supersedes", "superseded_by", "contradicted_by")


def art(aid: str, order: int = 0, **kw: Any) -> ArtifactState:
    base = ArtifactState(
        project=P,
        artifact_id=aid,
        kind="finding",
        author="alice",
        created_event_id=f"e-{aid}",
        created_at=T0 + timedelta(minutes=order),
        content=f"claim {aid}",
        content_hash=content_hash(f"claim {aid}"),
        impact=0.5,
        confidence=0.5,
        source=None,
    )
    return replace(base, **kw)


def states_of(*items: ArtifactState) -> dict[str, ArtifactState]:
    return {s.artifact_id: s for s in items}


def ids(members: tuple[Member, ...]) -> list[str]:
    return [m.artifact_id for m in members]


def test_ancestors_walk_revises_nearest_first_and_descendants_come_breadth_first_with_their_depth() -> None:
    states = states_of(
        art("root", 0),
        art("a", 1, revises="root"),
        art("b", 2, revises="a"),
        art("c", 3, revises="a"),
        art("d", 4, revises="b"),
        art("other", 5),
    )
    found = lineage(states, "b")
    assert ids(found.ancestors) == ["a", "root"]
    assert [(d.member.artifact_id, d.depth) for d in found.descendants] == [("d", 1)]
    from_root = lineage(states, "root")
    assert from_root.ancestors == ()
    assert [(d.member.artifact_id, d.depth) for d in from_root.descendants] == [("a", 1), ("b", 2), ("c", 2), ("d", 3)]
    assert (found.cycle, found.missing) == ((), ())


def test_a_supersession_chain_is_shown_whole_from_any_of_its_members() -> None:
    states = states_of(
        art("A", 0, superseded_by="B", lifecycle=Lifecycle.resolved, resolution=ResolutionKind.superseded),
        art(
            "B",
            1,
            supersedes="A",
            superseded_by="C",
            lifecycle=Lifecycle.resolved,
            resolution=ResolutionKind.superseded,
        ),
        art("C", 2, supersedes="B"),
    )
    assert (ids(lineage(states, "A").supersedes), ids(lineage(states, "A").superseded_by)) == ([], ["B", "C"])
    assert (ids(lineage(states, "B").supersedes), ids(lineage(states, "B").superseded_by)) == (["A"], ["C"])
    assert (ids(lineage(states, "C").supersedes), ids(lineage(states, "C").superseded_by)) == (["B", "A"], [])


def test_what_contradicts_an_artifact_and_what_it_contradicts_are_both_shown() -> None:
    states = states_of(
        art("claim", 0, trust=Trust.contradicted, contradicted_by="proof"),
        art("proof", 1),
        art("rumour", 2, trust=Trust.contradicted, contradicted_by="proof"),
    )
    found = lineage(states, "claim")
    assert (found.contradicted_by, found.contradicts) == (Member.of(states["proof"]), ())
    proof = lineage(states, "proof")
    assert proof.contradicted_by is None
    assert ids(proof.contradicts) == ["claim", "rumour"]
    assert proof.contradicts[0].trust is Trust.contradicted


def test_each_member_shows_its_state_and_a_forgotten_ones_content_as_the_states_hold_it() -> None:
    states = states_of(
        art("old", 0, content="[forgotten]", forgotten=True, trust=Trust.verified, author="bob", kind="assumption"),
        art("new", 1, revises="old"),
    )
    parent = lineage(states, "new").ancestors[0]
    assert (parent.content, parent.forgotten) == ("[forgotten]", True)
    assert (parent.kind, parent.author, parent.trust, parent.created_at) == ("assumption", "bob", Trust.verified, T0)
    shown = lineage(states, "new").as_dict()["ancestors"][0]
    assert (shown["content"], shown["trust"], shown["lifecycle"]) == ("[forgotten]", "verified", "active")


def test_a_revises_cycle_is_reported_by_its_ids_and_the_walk_ends() -> None:
    states = states_of(art("a", 0, revises="c"), art("b", 1, revises="a"), art("c", 2, revises="b"), art("x", 3))
    found = lineage(states, "a")
    assert found.cycle == (Cycle("revises", ("a", "c", "b")),)
    assert ids(found.ancestors) == ["c", "b"]
    assert [(d.member.artifact_id, d.depth) for d in found.descendants] == [("b", 1), ("c", 2)]
    tail = lineage(states_of(*states.values(), art("t", 4, revises="b")), "t")
    assert tail.cycle == (Cycle("revises", ("b", "a", "c")),)
    assert ids(tail.ancestors) == ["b", "a", "c"]


def test_a_supersession_cycle_is_reported_in_both_directions() -> None:
    states = states_of(art("a", 0, supersedes="b", superseded_by="b"), art("b", 1, supersedes="a", superseded_by="a"))
    found = lineage(states, "a")
    assert found.cycle == (Cycle("supersedes", ("a", "b")), Cycle("superseded_by", ("a", "b")))
    assert (ids(found.supersedes), ids(found.superseded_by)) == (["b"], ["b"])


def test_links_to_absent_artifacts_are_reported_as_missing_not_dropped() -> None:
    states = states_of(
        art("a", 0, revises="gone", supersedes="older", superseded_by="b", contradicted_by="erased"),
        art("b", 1, supersedes="a", superseded_by="lost"),
    )
    found = lineage(states, "a")
    assert found.missing == (
        MissingLink("a", "revises", "gone"),
        MissingLink("a", "supersedes", "older"),
        MissingLink("b", "superseded_by", "lost"),
        MissingLink("a", "contradicted_by", "erased"),
    )
    assert (found.ancestors, found.supersedes, ids(found.superseded_by)) == ((), (), ["b"])
    assert found.contradicted_by is None


def test_an_unknown_artifact_is_not_found_naming_it_and_its_project() -> None:
    with pytest.raises(NotFound) as raised:
        lineage(states_of(art("a")), "ghost")
    assert str(raised.value).startswith("artifact 'ghost' not found; project 'proj' holds no such artifact")
    with pytest.raises(NotFound, match="project 'empty'"):
        lineage({}, "ghost", project="empty")


def test_the_lineage_as_a_dict_is_json_and_names_every_field() -> None:
    states = states_of(art("a", 0), art("b", 1, revises="a", trust=Trust.contradicted, contradicted_by="a"))
    shown = json.loads(json.dumps(lineage(states, "a").as_dict()))
    assert shown["descendants"] == [Member.of(states["b"]).as_dict() | {"depth": 1}]
    assert (shown["contradicts"][0]["artifact_id"], shown["cycle"], shown["missing"]) == ("b", [], [])
    assert set(shown["artifact"]) == {
        "artifact_id",
        "kind",
        "author",
        "trust",
        "lifecycle",
        "resolution",
        "forgotten",
        "content",
        "created_at",
        *LINKS,
    }


# -- properties over generated link graphs --------------------------------------------------------------------

NAMES = [f"a{i}" for i in range(7)]
GHOSTS = ["g0", "g1"]  # ids no state holds


@st.composite
def hostile_graphs(draw: st.DrawFn) -> dict[str, ArtifactState]:
    """Any link from any artifact to any id, itself and absent ones included: what a hostile history may hold."""
    count = draw(st.integers(1, len(NAMES)))
    target = st.none() | st.sampled_from(NAMES[:count] + GHOSTS)
    return states_of(*(art(aid, i, **{link: draw(target) for link in LINKS}) for i, aid in enumerate(NAMES[:count])))


@st.composite
def consistent_graphs(draw: st.DrawFn) -> dict[str, ArtifactState]:
    """What the rules allow: revisions of earlier artifacts, supersession chains linked on both sides."""
    count = draw(st.integers(1, len(NAMES)))
    names = NAMES[:count]
    states = {aid: art(aid, i) for i, aid in enumerate(names)}
    for i, aid in enumerate(names[1:], start=1):
        parent = draw(st.none() | st.sampled_from(names[:i]))
        states[aid] = replace(states[aid], revises=parent)
    order = draw(st.permutations(names))
    cuts = draw(st.sets(st.integers(1, count), max_size=count))
    for old, new in itertools.pairwise(order):
        if order.index(new) not in cuts:
            states[old] = replace(states[old], superseded_by=new)
            states[new] = replace(states[new], supersedes=old)
    return states


def revision_chain(found: Lineage) -> list[str]:
    return [found.artifact.artifact_id, *ids(found.ancestors)]


def supersession_chain(found: Lineage) -> list[str]:
    return [*reversed(ids(found.supersedes)), found.artifact.artifact_id, *ids(found.superseded_by)]


def steps_to(states: Mapping[str, ArtifactState], start: str, goal: str) -> int | None:
    """How many `revises` steps lead from `start` to `goal`, walked by brute force with a bound."""
    current: str | None = start
    for step in range(1, len(states) + 2):
        current = states[current].revises if current is not None and current in states else None
        if current is None:
            return None
        if current == goal:
            return step
    return None


def assert_members_are_reachable(found: Lineage) -> None:
    """From the artifact, following only the links the lineage's members name, every member is reached."""
    members = {m.artifact_id: m for m in found.members()}
    edges: dict[str, set[str]] = {aid: set() for aid in members}
    for member in members.values():
        for other in (getattr(member, link) for link in LINKS):
            if other in members:
                edges[member.artifact_id].add(other)
                edges[other].add(member.artifact_id)
    reached, frontier = {found.artifact.artifact_id}, [found.artifact.artifact_id]
    while frontier:
        frontier = [n for node in frontier for n in edges[node] if n not in reached]
        reached |= set(frontier)
    assert reached == set(members)


def assert_links_are_as_named(states: Mapping[str, ArtifactState], found: Lineage) -> None:
    aid = found.artifact.artifact_id
    for member in found.members():
        assert member == Member.of(states[member.artifact_id])
    for walked, link in ((found.ancestors, "revises"), (found.supersedes, "supersedes")):
        for prior, member in zip((found.artifact, *walked), walked, strict=False):
            assert getattr(prior, link) == member.artifact_id
    for prior, member in zip((found.artifact, *found.superseded_by), found.superseded_by, strict=False):
        assert prior.superseded_by == member.artifact_id
    assert all(m.contradicted_by == aid for m in found.contradicts)
    assert ids(found.contradicts) == sorted(s.artifact_id for s in states.values() if s.contradicted_by == aid)
    expected = {d: steps_to(states, d, aid) for d in states if d != aid and steps_to(states, d, aid) is not None}
    assert {d.member.artifact_id: d.depth for d in found.descendants} == expected
    assert [d.depth for d in found.descendants] == sorted(d.depth for d in found.descendants)


@given(hostile_graphs())
def test_every_member_of_any_lineage_is_reachable_through_the_links_it_names(states: dict[str, ArtifactState]) -> None:
    for aid in states:
        found = lineage(states, aid)
        assert_members_are_reachable(found)
        assert_links_are_as_named(states, found)
        # the chain stops at a cycle or at an absent artifact, and says which
        last = (found.ancestors or (found.artifact,))[-1]
        ended = last.revises is None or any(c.link == "revises" for c in found.cycle)
        assert ended or MissingLink(last.artifact_id, "revises", str(last.revises)) in found.missing


@given(hostile_graphs())
def test_each_member_of_a_revises_chain_sees_the_same_chain(states: dict[str, ArtifactState]) -> None:
    for aid in states:
        chain = revision_chain(lineage(states, aid))
        looped = any(c.link == "revises" for c in lineage(states, aid).cycle)
        for i, member in enumerate(chain):
            seen = revision_chain(lineage(states, member))
            if looped:  # from inside the loop the same ids, entered at another place
                assert set(seen) <= set(chain)
            else:
                assert seen == chain[i:]


@given(consistent_graphs())
def test_a_consistent_history_shows_each_chain_whole_from_any_member(states: dict[str, ArtifactState]) -> None:
    for aid in states:
        found = lineage(states, aid)
        assert (found.cycle, found.missing) == ((), ())
        assert_links_are_as_named(states, found)
        chain = supersession_chain(found)
        assert all(supersession_chain(lineage(states, m)) == chain for m in chain)
        root = revision_chain(found)[-1]
        assert all(revision_chain(lineage(states, d.member.artifact_id))[-1] == root for d in found.descendants)
