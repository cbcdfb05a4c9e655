"""The state rules, pure: the transition matrix, links, rollback planning, decay."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from bus.errors import IllegalTransition
from bus.identity.signing import AgentKey
from bus.model.auth import Enrolment
from bus.model.authority import Authority
from bus.model.event import Envelope, draft_event
from bus.model.fold import Fold
from bus.model.rollback import plan_rollback
from bus.model.state import FLAG_UNEARNED, ArtifactState, decide, relevance, time_weight
from bus.model.tombstones import FLAG_PREVIOUSLY_RETRACTED, content_hash
from bus.model.vocab import Identity, Lifecycle, ResolutionKind, Role, Trust

P = "proj"
RECORD_KEY = AgentKey.generate("record").public_key  # records apply by agent id; the key is not consulted


def standing(
    agent: str,
    *roles: Role,
    owner: str | None = None,
    projects: tuple[str, ...] = ("*",),
    identity: Identity | None = None,
) -> Enrolment:
    """An enrolment record for the rules (`bus.model.authority`): roles default to agent, owner to the agent itself,
    the identity to a person's where it holds reviewer (only persons may)."""
    if identity is None:
        identity = Identity.person if Role.reviewer in roles else Identity.agent
    return Enrolment(
        agent_id=agent,
        public_key=RECORD_KEY,
        owner=owner or agent,
        roles=roles or (Role.agent,),
        projects=projects,
        enrolled_by="tests",
        enrolled_at=datetime(2024, 1, 1, tzinfo=UTC),
        identity=identity,
    )


# These tests are about what each change does, not who may make it (tests/bus/test_authority_rules.py): bob and
# carol are admins from the start, so they may resolve, roll back and forget alice's claims.
STAFF = Authority.of([(0, standing("bob", Role.agent, Role.admin)), (0, standing("carol", Role.agent, Role.admin))])


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AgentKey]:
    root: Path = tmp_path_factory.mktemp("keys")
    return {name: AgentKey.load_or_create(root, name) for name in ("alice", "bob", "carol")}


def ev(
    key: AgentKey, kind: str, body: dict[str, Any], *, artifact_id: str | None = None, source: str | None = None
) -> Envelope:
    return draft_event(kind, body, project=P, actor=key.actor, session_id="s", artifact_id=artifact_id, source=source)


def claim(key: AgentKey, aid: str, text: str = "the cache is cold", **extra: object) -> Envelope:
    body = {"text": text, "impact": 0.5, "confidence": 0.6, "subject": "cache", **extra}
    return ev(key, "finding", body, artifact_id=aid)


def state(
    aid: str, trust: Trust = Trust.unverified, lifecycle: Lifecycle = Lifecycle.active, **kw: Any
) -> ArtifactState:
    base = ArtifactState(
        project=P,
        artifact_id=aid,
        kind="finding",
        author="alice",
        created_event_id="e",
        created_at=datetime.now(UTC),
        content=f"claim {aid}",
        content_hash=content_hash(f"claim {aid}"),
        impact=0.5,
        confidence=0.5,
        source=None,
        trust=trust,
        lifecycle=lifecycle,
    )
    return replace(base, **kw)


# Every trust move is checked against a table written out by hand in test_state_rules.py.


@pytest.mark.parametrize(
    ("trust", "lifecycle", "resolution"),
    list(itertools.product(Trust, [Lifecycle.active, Lifecycle.resolved], ResolutionKind)),
)
def test_every_resolution_is_legal_only_on_an_active_artifact_that_is_not_rolled_back(
    agents: dict[str, AgentKey], trust: Trust, lifecycle: Lifecycle, resolution: ResolutionKind
) -> None:
    states = {
        "a1": state(
            "a1", trust, lifecycle, resolution=ResolutionKind.stale if lifecycle is Lifecycle.resolved else None
        ),
        "a2": state("a2"),
    }
    body = {"resolution": resolution.value} | (
        {"superseded_by": "a2"} if resolution is ResolutionKind.superseded else {}
    )
    event = ev(agents["bob"], "resolved", body, artifact_id="a1")
    if lifecycle is Lifecycle.active and trust is not Trust.rolled_back:
        change = decide(event, 10, states.get, lambda _h: False, STAFF)
        assert change.artifacts[0].resolution is resolution
        assert change.artifacts[0].trust is trust  # the two axes never share a field
    else:
        with pytest.raises(IllegalTransition, match="a1"):
            decide(event, 10, states.get, lambda _h: False, STAFF)


def test_the_author_cannot_verify_their_own_claim(agents: dict[str, AgentKey]) -> None:
    states = {"a1": state("a1")}
    with pytest.raises(IllegalTransition, match="alice is the author"):
        decide(ev(agents["alice"], "verified", {}, artifact_id="a1"), 2, states.get, lambda _h: False, STAFF)


def test_verifying_a_verified_claim_appends_a_second_record(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    fold.apply(claim(agents["alice"], "a1"), 1)
    fold.apply(ev(agents["bob"], "verified", {"note": "ran it"}, artifact_id="a1"), 2)
    fold.apply(ev(agents["carol"], "verified", {"note": "ran it too"}, artifact_id="a1"), 3)
    assert [v.verifier for v in fold.verifications] == ["bob", "carol"]
    assert fold.artifacts["a1"].trust is Trust.verified
    assert fold.rejected == {}


def test_self_contradiction_and_a_missing_contradictor_are_refused(agents: dict[str, AgentKey]) -> None:
    states = {"a1": state("a1")}
    with pytest.raises(IllegalTransition, match="cannot contradict itself"):
        decide(
            ev(agents["bob"], "contradicted", {"contradicted_by": "a1", "reason": "r"}, artifact_id="a1"),
            2,
            states.get,
            lambda _h: False,
            STAFF,
        )
    with pytest.raises(IllegalTransition, match="'ghost' does not exist"):
        decide(
            ev(agents["bob"], "contradicted", {"contradicted_by": "ghost", "reason": "r"}, artifact_id="a1"),
            2,
            states.get,
            lambda _h: False,
            STAFF,
        )


def test_a_transition_on_a_missing_artifact_is_refused(agents: dict[str, AgentKey]) -> None:
    with pytest.raises(IllegalTransition, match="absent"):
        decide(
            ev(agents["bob"], "rolled_back", {"reason": "r"}, artifact_id="nope"),
            2,
            lambda _aid: None,
            lambda _h: False,
            STAFF,
        )


def test_supersession_sets_both_sides_or_nothing(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    fold.apply(claim(agents["alice"], "old"), 1)
    fold.apply(claim(agents["alice"], "new", text="the cache is warm"), 2)
    fold.apply(
        ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "new"}, artifact_id="old"), 3
    )
    assert (fold.artifacts["old"].superseded_by, fold.artifacts["new"].supersedes) == ("new", "old")
    assert fold.artifacts["old"].resolution is ResolutionKind.superseded
    # A third claim cannot also be superseded by "new": refused whole, nothing changes on either side.
    fold.apply(claim(agents["alice"], "third", text="other"), 4)
    before = dict(fold.artifacts)
    bad = ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "new"}, artifact_id="third")
    assert fold.apply(bad, 5) is None
    assert "already supersedes old" in fold.rejected[str(bad.event_id)]
    assert fold.artifacts == before


def test_a_finding_that_supersedes_resolves_its_predecessor(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    fold.apply(claim(agents["alice"], "v1"), 1)
    fold.apply(claim(agents["bob"], "v2", text="revised claim", supersedes="v1"), 2)
    assert fold.artifacts["v1"].lifecycle is Lifecycle.resolved
    assert fold.artifacts["v1"].superseded_by == "v2"
    assert fold.artifacts["v2"].supersedes == "v1"


def test_superseded_by_a_missing_artifact_is_refused(agents: dict[str, AgentKey]) -> None:
    states = {"a1": state("a1")}
    body = {"resolution": "superseded", "superseded_by": "ghost"}
    with pytest.raises(IllegalTransition, match="successor 'ghost' does not exist"):
        decide(ev(agents["bob"], "resolved", body, artifact_id="a1"), 2, states.get, lambda _h: False, STAFF)


def test_revising_a_missing_artifact_is_refused(agents: dict[str, AgentKey]) -> None:
    with pytest.raises(IllegalTransition, match="revised artifact 'ghost'"):
        decide(claim(agents["alice"], "a1", revises="ghost"), 1, lambda _aid: None, lambda _h: False, STAFF)


def test_an_artifact_id_cannot_be_created_twice(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    fold.apply(claim(agents["alice"], "a1"), 1)
    again = claim(agents["bob"], "a1", text="different")
    assert fold.apply(again, 2) is None
    assert "already exists" in fold.rejected[str(again.event_id)]


def test_retraction_leaves_a_tombstone_and_the_same_claim_is_flagged_later(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    fold.apply(claim(agents["alice"], "a1", text="The cache is COLD!"), 1)
    fold.apply(ev(agents["alice"], "resolved", {"resolution": "retracted"}, artifact_id="a1"), 2)
    assert content_hash("the cache is cold") in fold.tombstones
    fold.apply(claim(agents["bob"], "a2", text="the   cache is cold"), 3)
    assert FLAG_PREVIOUSLY_RETRACTED in fold.artifacts["a2"].flags


def test_rollback_leaves_a_tombstone(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    fold.apply(claim(agents["alice"], "a1"), 1)
    fold.apply(ev(agents["bob"], "rolled_back", {"reason": "r"}, artifact_id="a1"), 2)
    assert fold.tombstones[content_hash("the cache is cold")].reason == "rolled_back"


def test_unearned_confidence_is_flagged_only_for_confident_intuition(agents: dict[str, AgentKey]) -> None:
    fold = Fold(authority=STAFF)
    body = {"text": "x", "impact": 0.5, "subject": "s"}
    fold.apply(ev(agents["alice"], "finding", body | {"confidence": 0.8}, artifact_id="a", source="intuition"), 1)
    fold.apply(ev(agents["alice"], "finding", body | {"confidence": 0.79}, artifact_id="b", source="intuition"), 2)
    fold.apply(ev(agents["alice"], "finding", body | {"confidence": 0.95}, artifact_id="c", source="search"), 3)
    assert [a for a, s in fold.artifacts.items() if FLAG_UNEARNED in s.flags] == ["a"]


def chain(length: int, verified_at: int) -> dict[str, ArtifactState]:
    """c0 ← c1 ← … ← c{length-1} (each revises the previous); c{verified_at} is verified."""
    states = {}
    for i in range(length):
        trust = Trust.verified if i == verified_at else Trust.unverified
        states[f"c{i}"] = state(f"c{i}", trust, revises=f"c{i - 1}" if i else None)
    return states


def test_rollback_over_a_chain_of_ten_with_a_branch() -> None:
    states = chain(10, verified_at=3)
    states["branch"] = state("branch", revises="c6")  # built on an intermediate
    states["leaf"] = state("leaf", revises="branch")
    states["side"] = state("side", revises="c2")  # built on the verified part: untouched
    plan = plan_rollback(states, "c8")
    assert plan.verified_ancestor == "c3"
    assert plan.intermediates == ("c8", "c7", "c6", "c5", "c4")
    assert plan.tainted == ("c9", "branch", "leaf")
    assert plan.to_roll_back == plan.intermediates
    cascade = plan_rollback(states, "c8", cascade=True)
    assert cascade.to_roll_back == ("c8", "c7", "c6", "c5", "c4", "c9", "branch", "leaf")


def test_rollback_with_a_cycle_is_an_error_not_a_loop() -> None:
    states = chain(5, verified_at=99)
    states["c0"] = replace(states["c0"], revises="c4")
    with pytest.raises(IllegalTransition, match="cycle: c4 → c3 → c2 → c1 → c0 → c4"):
        plan_rollback(states, "c4")


def test_rollback_with_a_broken_chain_or_no_verified_ancestor_is_an_error() -> None:
    states = chain(4, verified_at=99)
    with pytest.raises(IllegalTransition, match="no verified ancestor"):
        plan_rollback(states, "c3")
    del states["c1"]
    with pytest.raises(IllegalTransition, match="broken: c2 revises missing c1"):
        plan_rollback(states, "c3")


def test_a_descendant_cycle_does_not_hang_taint_reporting() -> None:
    states = chain(4, verified_at=0)
    states["x"] = state("x", revises="c3")
    states["y"] = state("y", revises="x")
    states["x"] = replace(states["x"], revises="c3")
    plan = plan_rollback(states, "c2")
    assert plan.tainted == ("c3", "x", "y")


def test_a_thirty_day_old_item_with_zero_longevity_weighs_one_over_e() -> None:
    assert time_weight(30.0, 0.0) == pytest.approx(math.exp(-1))


def test_higher_impact_decays_slower() -> None:
    assert time_weight(60.0, 0.9) > time_weight(60.0, 0.5) > time_weight(60.0, 0.0)
    assert time_weight(0.0, 0.0) == 1.0


def test_an_unparseable_time_is_neutral() -> None:
    assert time_weight(None, 0.7) == 0.5
    assert time_weight(float("nan"), 0.7) == 0.5


def test_relevance_combines_time_weight_and_impact() -> None:
    now = datetime.now(UTC)
    old = state("a", impact=0.0, created_at=now - timedelta(days=30))
    assert relevance(old, now) == pytest.approx(math.exp(-1) * 0.5)
    high = state("b", impact=1.0, created_at=now - timedelta(days=30))
    assert relevance(high, now) == pytest.approx(math.exp(-30 / 90) * 1.0)


@pytest.mark.parametrize(
    "successor",
    [
        state("b", Trust.rolled_back),
        state("b", Trust.contradicted),
        state("b", lifecycle=Lifecycle.resolved, resolution=ResolutionKind.stale),
        state("b", forgotten=True),
    ],
    ids=["rolled_back", "contradicted", "resolved", "forgotten"],
)
def test_a_successor_that_could_not_be_shown_is_refused(agents: dict[str, AgentKey], successor: ArtifactState) -> None:
    states = {"a": state("a"), "b": successor}
    event = ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "b"}, artifact_id="a")
    with pytest.raises(IllegalTransition, match="a successor must be active"):
        decide(event, 5, states.get, lambda _h: False, STAFF)


def test_a_rollback_stopped_halfway_is_resumed_by_planning_again() -> None:
    states = chain(5, verified_at=0)
    states["c4"] = replace(states["c4"], trust=Trust.rolled_back)  # the first link went through
    plan = plan_rollback(states, "c4")
    assert plan.already_rolled_back == ("c4",)
    assert plan.to_roll_back == ("c3", "c2", "c1")


def test_an_error_on_a_resolved_artifact_lists_the_trust_moves_still_legal(agents: dict[str, AgentKey]) -> None:
    states = {"a": state("a", lifecycle=Lifecycle.resolved, resolution=ResolutionKind.stale)}
    with pytest.raises(IllegalTransition, match="legal: contradicted, rolled_back, verified"):
        decide(
            ev(agents["bob"], "resolved", {"resolution": "retracted"}, artifact_id="a"),
            2,
            states.get,
            lambda _h: False,
            STAFF,
        )
