"""The authority policy, pure: who may publish in a project, verify, resolve, roll back, forget or supersede whose
claim, and how enrolment records apply from their place in the stream on. Every path decides with
`bus.model.state.decide`, which asks `bus.model.authority.authorize` first, so these rules hold wherever events
are applied."""

from __future__ import annotations

from typing import Any

import pytest

from bus.errors import Forbidden, IllegalTransition
from bus.identity.signing import AgentKey, node_event_key
from bus.model.auth import ANY_PROJECT
from bus.model.authority import NO_RECORDS, Authority, enrolment_event, enrolment_record
from bus.model.event import Envelope, draft_event
from bus.model.fold import Fold
from bus.model.review import AWAITING_REVIEW, vouched_cells
from bus.model.state import ArtifactState, decide, vouched_text
from bus.model.vocab import Lifecycle, Role, Trust
from bus.subjects import POLICY_PROJECT
from tests.bus.test_state import P, claim, ev, standing, state


@pytest.fixture(scope="module")
def keys() -> dict[str, AgentKey]:
    return {name: AgentKey.generate(name) for name in ("alice", "alice2", "bob", "root", "rita", "olga")}


def never(_hash: str) -> bool:
    return False


def refusal(event: Envelope, authority: Authority, lookup: Any = None, seq: int = 10) -> str:
    with pytest.raises(Forbidden) as raised:
        decide(event, seq, lookup or {"a1": state("a1")}.get, never, authority)
    return str(raised.value)


def test_an_event_outside_the_actors_projects_is_refused_naming_the_membership_rule(keys: dict[str, AgentKey]) -> None:
    authority = Authority.of([(1, standing("bob", projects=("other",)))])
    message = refusal(claim(keys["bob"], "b1"), authority)
    assert message == (
        f"agent 'bob' may not publish finding in project {P}: rule membership: it is not a member of project {P} "
        "(its projects: other)"
    )
    assert decide(claim(keys["alice"], "b2"), 10, lambda _aid: None, never, authority).artifacts[0].author == "alice"


def test_an_agent_without_a_record_stands_as_a_first_use_agent_of_every_project_but_the_fleets_own(
    keys: dict[str, AgentKey],
) -> None:
    change = decide(claim(keys["bob"], "b1"), 10, lambda _aid: None, never, NO_RECORDS)
    assert [s.artifact_id for s in change.artifacts] == ["b1"]
    into_policy = draft_event(
        "finding",
        {"text": "t", "impact": 0.5, "confidence": 0.5, "subject": "s"},
        project=POLICY_PROJECT,
        actor=keys["bob"].actor,
        session_id="s",
    )
    assert "rule enrolment-records: project epibus holds only enrolment records" in refusal(into_policy, NO_RECORDS)


def test_a_revocation_refuses_what_comes_after_it_in_the_stream_and_keeps_what_came_before(
    keys: dict[str, AgentKey],
) -> None:
    revoked = standing("bob").revoked(standing("bob").enrolled_at)
    authority = Authority.of([(1, standing("bob")), (5, revoked)])
    fold = Fold(authority=authority)
    before, after = claim(keys["bob"], "b1"), claim(keys["bob"], "b2", text="later")
    fold.apply(before, 4)
    fold.apply(after, 6)
    assert set(fold.artifacts) == {"b1"}
    assert fold.rejected[str(after.event_id)].startswith("agent 'bob' may not publish finding")
    assert "rule revoked" in fold.rejected[str(after.event_id)]


def test_a_role_granted_later_in_the_stream_does_not_reach_back_to_earlier_events(keys: dict[str, AgentKey]) -> None:
    """The same events with the same records give the same state whatever order a reader learns them in."""
    authority = Authority.of([(3, standing("bob", Role.agent, Role.admin))])
    early = ev(keys["bob"], "rolled_back", {"reason": "r"}, artifact_id="a1")
    late = ev(keys["bob"], "rolled_back", {"reason": "r"}, artifact_id="a2")
    lookup = {"a1": state("a1"), "a2": state("a2")}.get
    assert "rule author-or-admin" in refusal(early, authority, lookup, seq=2)
    assert decide(late, 4, lookup, never, authority).artifacts[0].trust is Trust.rolled_back


def test_another_identity_of_the_authors_owner_may_not_verify_and_another_owner_may(keys: dict[str, AgentKey]) -> None:
    authority = Authority.of([(1, standing("alice", owner="alice@corp")), (2, standing("alice2", owner="alice@corp"))])
    message = refusal(ev(keys["alice2"], "verified", {}, artifact_id="a1"), authority)
    assert "rule one-owner: it and the author alice have one owner (alice@corp); another owner must verify" in message
    change = decide(ev(keys["bob"], "verified", {}, artifact_id="a1"), 10, {"a1": state("a1")}.get, never, authority)
    assert change.verification is not None
    assert change.verification.verifier == "bob"
    with pytest.raises(IllegalTransition, match="alice is the author"):  # the same identity: the state rule says so
        decide(ev(keys["alice"], "verified", {}, artifact_id="a1"), 10, {"a1": state("a1")}.get, never, authority)


def test_agents_and_reviewers_verify_and_only_a_persons_verification_is_marked_a_human_review(
    keys: dict[str, AgentKey],
) -> None:
    authority = Authority.of(
        [
            (1, standing("rita", Role.reviewer)),  # a person
            (1, standing("root", Role.admin)),
            (1, standing("bob", Role.agent)),
            # Enrolled before identities had a kind: it keeps its reviewer role, its verifications pass for no
            # person's.
            (1, standing("olga", Role.agent, Role.reviewer).model_copy(update={"identity": None})),
        ]
    )
    lookup = {"a1": state("a1")}.get
    reviews = {
        name: decide(ev(keys[name], "verified", {}, artifact_id="a1"), 10, lookup, never, authority).verification
        for name in ("rita", "bob", "olga")
    }
    assert {name: v.human_review for name, v in reviews.items() if v is not None} == {
        "rita": True,
        "bob": False,
        "olga": False,
    }
    message = refusal(ev(keys["root"], "verified", {}, artifact_id="a1"), authority)
    assert "rule verifier-role: only an agent or a reviewer verifies; its roles are admin" in message


@pytest.mark.parametrize(
    ("kind", "body", "action"),
    [
        ("resolved", {"resolution": "retracted"}, "retract"),
        ("resolved", {"resolution": "stale"}, "resolve (as stale)"),
        ("resolved", {"resolution": "superseded", "superseded_by": "a2"}, "resolve (as superseded)"),
        ("rolled_back", {"reason": "r"}, "roll back"),
        ("forgotten", {"reason": "r"}, "forget"),
    ],
)
def test_only_the_author_or_an_admin_may_retract_resolve_roll_back_or_forget_a_claim(
    keys: dict[str, AgentKey], kind: str, body: dict[str, Any], action: str
) -> None:
    lookup = {"a1": state("a1"), "a2": state("a2")}.get
    message = refusal(ev(keys["bob"], kind, body, artifact_id="a1"), NO_RECORDS, lookup)
    assert message == (
        f"agent 'bob' may not {action} alice's claim a1 in project {P}: rule author-or-admin: only the author's "
        f"identities (owner alice) or an admin may {action} another's claim"
    )
    admins = Authority.of([(1, standing("root", Role.admin)), (1, standing("alice2", owner="alice"))])
    for actor in ("alice", "alice2", "root"):  # the author, another identity of her owner, an admin
        change = decide(ev(keys[actor], kind, body, artifact_id="a1"), 10, lookup, never, admins)
        assert change.event_id


def test_superseding_anothers_claim_with_a_new_finding_is_a_resolution_and_takes_the_author_or_an_admin(
    keys: dict[str, AgentKey],
) -> None:
    lookup = {"old": state("old")}.get
    message = refusal(claim(keys["bob"], "new", supersedes="old"), NO_RECORDS, lookup)
    assert "may not supersede alice's claim old" in message
    change = decide(claim(keys["alice"], "new", supersedes="old"), 10, lookup, never, NO_RECORDS)
    assert {s.artifact_id: s.lifecycle for s in change.artifacts}["old"] is Lifecycle.resolved
    revising = decide(claim(keys["bob"], "rev", revises="old"), 10, lookup, never, NO_RECORDS)  # revising: members
    assert revising.artifacts[0].revises == "old"


def test_contradicting_anothers_claim_stays_open_to_every_member(keys: dict[str, AgentKey]) -> None:
    lookup = {"a1": state("a1"), "b1": state("b1", author="bob")}.get
    body = {"contradicted_by": "b1", "reason": "measured"}
    change = decide(ev(keys["bob"], "contradicted", body, artifact_id="a1"), 10, lookup, never, NO_RECORDS)
    assert change.artifacts[0].trust is Trust.contradicted


def test_an_enrolment_record_counts_only_from_a_node_identity_filed_under_the_agent_it_enrols(
    keys: dict[str, AgentKey],
) -> None:
    node = node_event_key(AgentKey.generate("node"))
    record = standing("bob", Role.admin)
    genuine = enrolment_event(node, record)
    assert enrolment_record(genuine) == record
    assert decide(genuine, 3, lambda _aid: None, never, NO_RECORDS).artifacts == ()  # it changes who may, not what is
    by_agent = enrolment_event(keys["bob"], record)  # an agent granting itself a role
    assert enrolment_record(by_agent) is None
    assert "rule enrolment-records: only a node publishes enrolment records" in refusal(by_agent, NO_RECORDS)
    impostor = AgentKey.generate(node.agent_id)  # a node's name over another key
    assert enrolment_record(enrolment_event(impostor, record)) is None
    node_record = standing(node.agent_id, Role.admin)  # nodes are not enrolled
    assert enrolment_record(enrolment_event(node, node_record)) is None


def test_no_enrolment_can_make_an_agent_a_member_of_the_fleets_own_project() -> None:
    with pytest.raises(ValueError, match="holds the fleet's enrolment records"):
        standing("bob", projects=(POLICY_PROJECT,))
    assert not standing("bob", projects=(ANY_PROJECT,)).member_of(POLICY_PROJECT)


def test_a_record_names_its_change_in_words_for_tail_and_recall(keys: dict[str, AgentKey]) -> None:
    node = node_event_key(AgentKey.generate("node"))
    record = standing("bob", Role.reviewer, owner="bob@corp", projects=("ops", "web"))
    text = enrolment_event(node, record).body.content_text()
    assert text == "bob enrolled by tests: owner bob@corp, roles reviewer, projects ops, web, active"


def test_who_vouched_counts_agents_once_and_names_the_last_person(keys: dict[str, AgentKey]) -> None:
    authority = Authority.of(
        [(1, standing("rita", Role.reviewer)), (1, standing("olga", Role.reviewer)), (1, standing("bob", Role.agent))]
    )
    current = state("a1")
    for name in ("bob", "rita", "bob", "olga", "rita"):
        event = ev(keys[name], "verified", {}, artifact_id="a1")
        (current,) = decide(event, 10, {"a1": current}.get, never, authority).artifacts
        last = event.recorded_at
    assert (current.verified_by, current.reviewed_by, current.reviewed_at) == (("bob",), ("olga", "rita"), last)
    assert current.vouched() == {"agents": 1, "people": 2, "last_person": "rita", "last_person_at": last.isoformat()}
    assert vouched_text(current.vouched()) == f"1 agent, 2 people (rita, {last.isoformat()[:16].replace('T', ' ')}Z)"
    assert ArtifactState.from_record(current.to_record()) == current  # every store keeps it whole
    assert vouched_text(state("a2").vouched()) == "no one"
    assert [vouched_cells(v) for v in (current.vouched(), state("a2").vouched())] == [("1", "rita+1"), ("", "")]
    assert vouched_cells(state("a2").vouched(), AWAITING_REVIEW) == ("", "awaiting")
