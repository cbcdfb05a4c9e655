"""The state rules against tables written out by hand (never read from bus.model.state's own tables): every trust
move from every state, every resolution, forgetting, the safe door, as-of cuts, relevance without an impact,
and the exact change each legal event makes. Pure: no server."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from bus.errors import IllegalTransition
from bus.identity.signing import AgentKey
from bus.model.event import Envelope, draft_event, event_digest
from bus.model.fold import Fold
from bus.model.state import (
    FLAG_UNEARNED,
    ArtifactState,
    Change,
    IdUse,
    Verification,
    decide,
    event_references,
    id_use,
    relevance,
)
from bus.model.tombstones import Tombstone, content_hash
from bus.model.vocab import EpistemicSource, Lifecycle, ResolutionKind, Trust
from tests.bus.test_state import STAFF, agents, claim, ev, state

__all__ = ["agents"]  # the module-scoped key fixture, shared with test_state

U, V, C, R = Trust.unverified, Trust.verified, Trust.contradicted, Trust.rolled_back
BODIES = {
    "verified": {"note": "checked"},
    "contradicted": {"contradicted_by": "other", "reason": "measured otherwise"},
    "rolled_back": {"reason": "built on a bad premise"},
}
# (current trust, event kind) -> the trust after it, or the reason it is refused. Written by hand, not from the code.
TRUST_MOVES: dict[tuple[Trust, str], Trust | str] = {
    (U, "verified"): V,
    (U, "contradicted"): C,
    (U, "rolled_back"): R,
    (V, "verified"): V,
    (V, "contradicted"): C,
    (V, "rolled_back"): R,
    (C, "verified"): "from contradicted only rolled_back",
    (C, "contradicted"): "from contradicted only rolled_back",
    (C, "rolled_back"): R,
    (R, "verified"): "from rolled_back only nothing (terminal)",
    (R, "contradicted"): "from rolled_back only nothing (terminal)",
    (R, "rolled_back"): "from rolled_back only nothing (terminal)",
}


def never(_hash: str) -> bool:
    return False


@pytest.mark.parametrize(("current", "kind"), list(TRUST_MOVES))
def test_each_trust_move_gives_the_hand_written_outcome(agents: dict[str, AgentKey], current: Trust, kind: str) -> None:
    before = state("a1", current, last_seq=3)
    event = ev(agents["bob"], kind, BODIES[kind], artifact_id="a1")
    expected = TRUST_MOVES[(current, kind)]
    lookup = {"a1": before, "other": state("other")}.get
    if not isinstance(expected, Trust):  # Trust is a StrEnum: test for it, not for str
        with pytest.raises(IllegalTransition) as raised:
            decide(event, 10, lookup, never, STAFF)
        assert str(raised.value) == f"artifact a1: {current.value}/active -> {kind} is illegal: {expected}"
        return
    eid, at = str(event.event_id), event.recorded_at
    after = replace(before, trust=expected, last_seq=10, updated_at=at)
    if kind == "verified":
        record = Verification(eid, "a1", "bob", at, 10, "checked")
        vouched = replace(after, verified_by=("bob",))  # an agent's verification, not a person's
        assert decide(event, 10, lookup, never, STAFF) == Change(eid, (vouched,), verification=record)
    elif kind == "contradicted":
        assert decide(event, 10, lookup, never, STAFF) == Change(eid, (replace(after, contradicted_by="other"),))
    else:
        tomb = Tombstone(before.content_hash, "a1", eid, "rolled_back")
        assert decide(event, 10, lookup, never, STAFF) == Change(eid, (after,), tombstone=tomb)


# (trust, lifecycle) -> may it be resolved? Only an active artifact that is not rolled back.
RESOLVABLE = {
    (U, Lifecycle.active): True,
    (V, Lifecycle.active): True,
    (C, Lifecycle.active): True,
    (R, Lifecycle.active): False,
    (U, Lifecycle.resolved): False,
    (V, Lifecycle.resolved): False,
    (C, Lifecycle.resolved): False,
    (R, Lifecycle.resolved): False,
}
REFUSALS = {
    (R, Lifecycle.active): "it is rolled back (terminal)",
    (U, Lifecycle.resolved): "it is already resolved; legal: contradicted, rolled_back, verified",
    (V, Lifecycle.resolved): "it is already resolved; legal: contradicted, rolled_back, verified",
    (C, Lifecycle.resolved): "it is already resolved; legal: rolled_back",
    (R, Lifecycle.resolved): "it is already resolved; nothing is legal (terminal)",
}


@pytest.mark.parametrize("resolution", [ResolutionKind.stale, ResolutionKind.retracted, ResolutionKind.mistyped])
@pytest.mark.parametrize(("trust", "lifecycle"), list(RESOLVABLE))
def test_each_resolution_gives_the_hand_written_outcome(
    agents: dict[str, AgentKey], trust: Trust, lifecycle: Lifecycle, resolution: ResolutionKind
) -> None:
    old_resolution = ResolutionKind.stale if lifecycle is Lifecycle.resolved else None
    before = state("a1", trust, lifecycle, resolution=old_resolution)
    event = ev(agents["bob"], "resolved", {"resolution": resolution.value}, artifact_id="a1")
    if not RESOLVABLE[(trust, lifecycle)]:
        with pytest.raises(IllegalTransition) as raised:
            decide(event, 10, {"a1": before}.get, never, STAFF)
        label = f"{trust.value}/{'resolved(stale)' if old_resolution else 'active'}"
        reason = REFUSALS[(trust, lifecycle)]
        assert str(raised.value) == f"artifact a1: {label} -> resolved({resolution.value}) is illegal: {reason}"
        return
    eid = str(event.event_id)
    after = replace(
        before, lifecycle=Lifecycle.resolved, resolution=resolution, last_seq=10, updated_at=event.recorded_at
    )
    tomb = Tombstone(before.content_hash, "a1", eid, "retracted") if resolution is ResolutionKind.retracted else None
    assert decide(event, 10, {"a1": before}.get, never, STAFF) == Change(eid, (after,), tombstone=tomb)


def test_a_supersession_resolves_the_old_artifact_and_links_the_successor(agents: dict[str, AgentKey]) -> None:
    old, new = state("old", V, last_seq=1), state("new", last_seq=2)
    event = ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "new"}, artifact_id="old")
    at = event.recorded_at
    expected = Change(
        str(event.event_id),
        (
            replace(
                old,
                lifecycle=Lifecycle.resolved,
                resolution=ResolutionKind.superseded,
                superseded_by="new",
                last_seq=9,
                updated_at=at,
            ),
            replace(new, supersedes="old", last_seq=9, updated_at=at),
        ),
    )
    assert decide(event, 9, {"old": old, "new": new}.get, never, STAFF) == expected


def test_an_artifact_cannot_be_superseded_by_itself(agents: dict[str, AgentKey]) -> None:
    event = ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "a1"}, artifact_id="a1")
    with pytest.raises(IllegalTransition) as raised:
        decide(event, 9, {"a1": state("a1")}.get, never, STAFF)
    assert str(raised.value) == (
        "artifact a1: unverified/active -> resolved(superseded) is illegal: an artifact cannot supersede itself"
    )


def test_a_rolled_back_artifact_cannot_be_superseded_by_a_new_finding(agents: dict[str, AgentKey]) -> None:
    lookup = {"old": state("old", R)}.get
    with pytest.raises(IllegalTransition) as raised:
        decide(claim(agents["bob"], "new", supersedes="old"), 9, lookup, never, STAFF)
    assert str(raised.value) == (
        "artifact old: rolled_back/active -> resolved(superseded) is illegal: it is rolled back (terminal)"
    )


def test_a_resolved_artifact_cannot_be_superseded_by_a_new_finding(agents: dict[str, AgentKey]) -> None:
    lookup = {"old": state("old", C, Lifecycle.resolved, resolution=ResolutionKind.stale)}.get
    with pytest.raises(IllegalTransition) as raised:
        decide(claim(agents["bob"], "new", supersedes="old"), 9, lookup, never, STAFF)
    assert str(raised.value) == (
        "artifact old: contradicted/resolved(stale) -> resolved(superseded) is illegal: "
        "it is already resolved; legal: rolled_back"
    )


def test_a_finding_that_supersedes_a_missing_artifact_is_refused(agents: dict[str, AgentKey]) -> None:
    with pytest.raises(IllegalTransition) as raised:
        decide(claim(agents["bob"], "new", supersedes="ghost"), 9, lambda _aid: None, never, STAFF)
    assert str(raised.value) == (
        "artifact ghost: absent -> finding is illegal: superseded artifact 'ghost' does not exist"
    )


def test_a_successor_that_already_supersedes_another_is_refused(agents: dict[str, AgentKey]) -> None:
    lookup = {"a": state("a"), "b": state("b", supersedes="z")}.get
    event = ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "b"}, artifact_id="a")
    with pytest.raises(IllegalTransition) as raised:
        decide(event, 9, lookup, never, STAFF)
    assert str(raised.value) == "artifact b: unverified/active -> supersedes a is illegal: it already supersedes z"


def test_a_new_finding_is_recorded_with_every_field_of_its_event(agents: dict[str, AgentKey]) -> None:
    event = claim(agents["alice"], "new", text="The cache, is cold", revises="base")
    at = event.recorded_at
    expected = ArtifactState(
        project="proj",
        artifact_id="new",
        kind="finding",
        author="alice",
        created_event_id=str(event.event_id),
        created_at=at,
        content="The cache, is cold",
        content_hash=hashlib.sha256(b"the cache is cold").hexdigest(),
        impact=0.5,
        confidence=0.6,
        source=None,
        goal_id=None,
        revises="base",
        last_seq=4,
        updated_at=at,
    )
    assert decide(event, 4, {"base": state("base")}.get, never, STAFF) == Change(str(event.event_id), (expected,))


def test_an_artifact_cannot_revise_itself(agents: dict[str, AgentKey]) -> None:
    with pytest.raises(IllegalTransition) as raised:
        decide(claim(agents["alice"], "a1", revises="a1"), 4, lambda _aid: None, never, STAFF)
    assert str(raised.value) == "artifact a1: absent -> finding is illegal: an artifact cannot revise itself"


def test_a_transition_from_another_project_is_refused(agents: dict[str, AgentKey]) -> None:
    lookup = {"a1": state("a1", project="elsewhere")}.get
    with pytest.raises(IllegalTransition) as raised:
        decide(ev(agents["bob"], "verified", {}, artifact_id="a1"), 4, lookup, never, STAFF)
    assert str(raised.value) == "artifact a1: unverified/active -> verified is illegal: it belongs to project elsewhere"


def test_a_transition_on_a_missing_artifact_names_it(agents: dict[str, AgentKey]) -> None:
    with pytest.raises(IllegalTransition) as raised:
        decide(ev(agents["bob"], "verified", {}, artifact_id="ghost"), 4, lambda _aid: None, never, STAFF)
    assert str(raised.value) == "artifact ghost: absent -> verified is illegal: artifact 'ghost' does not exist"


@pytest.mark.parametrize("trust", list(Trust))
@pytest.mark.parametrize("lifecycle", list(Lifecycle))
def test_forgetting_marks_any_artifact_forgotten_and_changes_nothing_else(
    agents: dict[str, AgentKey], trust: Trust, lifecycle: Lifecycle
) -> None:
    before = state("a1", trust, lifecycle, resolution=ResolutionKind.stale if lifecycle is Lifecycle.resolved else None)
    event = ev(agents["carol"], "forgotten", {"reason": "personal data"}, artifact_id="a1")
    after = replace(before, forgotten=True, last_seq=7, updated_at=event.recorded_at)
    assert decide(event, 7, {"a1": before}.get, never, STAFF) == Change(str(event.event_id), (after,))


def test_forgetting_an_artifact_this_reader_never_saw_changes_nothing(agents: dict[str, AgentKey]) -> None:
    event = ev(agents["carol"], "forgotten", {"reason": "personal data"}, artifact_id="gone")
    assert decide(event, 7, lambda _aid: None, never, STAFF) == Change(str(event.event_id))


def test_a_forgotten_artifact_is_never_safe_in_a_fold(agents: dict[str, AgentKey]) -> None:
    fold = Fold.of(
        [(claim(agents["alice"], "a1"), 1), (ev(agents["bob"], "forgotten", {"reason": "r"}, artifact_id="a1"), 2)],
        authority=STAFF,
    )
    assert fold.rejected == {}
    assert fold.last_seq == 2
    assert "a1" not in fold.artifacts or not fold.artifacts["a1"].safe(include_resolved=True)


# (trust, resolution or None for active, forgotten) -> (safe by default, safe when resolved ones are asked for)
SAFE_DOOR: list[tuple[Trust, ResolutionKind | None, bool, tuple[bool, bool]]] = [
    (U, None, False, (True, True)),
    (V, None, False, (True, True)),
    (C, None, False, (False, False)),
    (R, None, False, (False, False)),
    (U, None, True, (False, False)),
    (V, ResolutionKind.stale, True, (False, False)),
    (U, ResolutionKind.stale, False, (False, True)),
    (V, ResolutionKind.superseded, False, (False, True)),
    (U, ResolutionKind.retracted, False, (False, False)),
    (V, ResolutionKind.mistyped, False, (False, False)),
    (C, ResolutionKind.stale, False, (False, False)),
    (R, ResolutionKind.superseded, False, (False, False)),
]


@pytest.mark.parametrize(("trust", "resolution", "forgotten", "expected"), SAFE_DOOR)
def test_the_safe_door_shows_exactly_what_the_hand_written_table_says(
    trust: Trust, resolution: ResolutionKind | None, forgotten: bool, expected: tuple[bool, bool]
) -> None:
    lifecycle = Lifecycle.active if resolution is None else Lifecycle.resolved
    artifact = state("a", trust, lifecycle, resolution=resolution, forgotten=forgotten)
    assert (artifact.safe(), artifact.safe(include_resolved=True)) == expected


def test_relevance_without_an_impact_uses_a_neutral_impact_and_confidence_as_longevity() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    unknown = state("u", kind="decision", impact=None, confidence=0.5, created_at=now - timedelta(days=60))
    assert relevance(unknown, now) == pytest.approx(0.36787944117144233 * 0.75)  # tau 60 days
    bare = replace(unknown, confidence=None)
    assert relevance(bare, now) == pytest.approx(0.1353352832366127 * 0.75)  # tau 30 days


def test_an_assumption_lasts_by_its_confidence_not_its_impact() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    assumption = state("s", kind="assumption", impact=0.0, confidence=1.0, created_at=now - timedelta(days=90))
    assert relevance(assumption, now) == pytest.approx(0.36787944117144233 * 0.5)  # tau 90 days, impact 0
    assert relevance(replace(assumption, confidence=None), now) == pytest.approx(0.049787068367863944 * 0.5)


def test_an_artifact_without_a_time_zone_is_weighed_as_neutral() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    naive = state("n", impact=1.0, created_at=datetime(2020, 1, 1))
    assert relevance(naive, now) == 0.5


def test_content_hash_ignores_case_punctuation_and_spacing() -> None:
    assert content_hash("  The CACHE,\tis -- cold!") == hashlib.sha256(b"the cache is cold").hexdigest()
    assert content_hash("under_score x2") == hashlib.sha256(b"under_score x2").hexdigest()


def test_event_references_name_every_artifact_an_event_links_to(agents: dict[str, AgentKey]) -> None:
    bob = agents["bob"]
    assert event_references(claim(bob, "a", revises="r", supersedes="s")) == {"a", "r", "s"}
    assert event_references(claim(bob, "a")) == {"a"}
    superseded = ev(bob, "resolved", {"resolution": "superseded", "superseded_by": "b"}, artifact_id="a")
    assert event_references(superseded) == {"a", "b"}
    assert event_references(ev(bob, "resolved", {"resolution": "stale"}, artifact_id="a")) == {"a"}
    assert event_references(ev(bob, "contradicted", BODIES["contradicted"], artifact_id="a")) == {"a", "other"}
    assert event_references(ev(bob, "verified", {}, artifact_id="a")) == {"a"}


def test_a_fold_keeps_the_highest_sequence_and_the_reason_of_each_refusal(agents: dict[str, AgentKey]) -> None:
    bad: Envelope = ev(agents["bob"], "verified", {}, artifact_id="ghost")
    fold = Fold.of([(claim(agents["alice"], "a1"), 5), (claim(agents["alice"], "a2", text="other"), 3), (bad, 9)])
    assert fold.last_seq == 5
    assert fold.rejected == {
        str(bad.event_id): "artifact ghost: absent -> verified is illegal: artifact 'ghost' does not exist"
    }
    assert sorted(fold.artifacts) == ["a1", "a2"]


def test_an_open_question_is_recorded_with_its_goal_and_source_and_no_links(agents: dict[str, AgentKey]) -> None:
    event = draft_event(
        "unknown",
        {"question": "Why is it cold?", "impact": 0.3},
        project="proj",
        actor=agents["alice"].actor,
        session_id="s",
        goal_id="g1",
        source="search",
    )
    change = decide(event, 4, lambda _aid: None, never, STAFF)
    (created,) = change.artifacts
    assert (created.kind, created.impact, created.confidence) == ("unknown", 0.3, None)
    assert (created.goal_id, created.source, created.revises, created.supersedes) == (
        "g1",
        EpistemicSource.search,
        None,
        None,
    )


def test_a_new_claim_carries_its_flags_in_the_change(agents: dict[str, AgentKey]) -> None:
    body = {"text": "sure of it", "impact": 0.5, "confidence": 0.9, "subject": "s"}
    event = ev(agents["alice"], "finding", body, artifact_id="a", source="intuition")
    assert decide(event, 1, lambda _aid: None, never, STAFF).flags == frozenset({FLAG_UNEARNED})


def test_a_finding_that_supersedes_stamps_its_predecessor_with_the_sequence(agents: dict[str, AgentKey]) -> None:
    change = decide(claim(agents["bob"], "new", supersedes="old"), 8, {"old": state("old")}.get, never, STAFF)
    assert [(s.artifact_id, s.last_seq) for s in change.artifacts] == [("new", 8), ("old", 8)]


@pytest.mark.parametrize(
    ("kind", "body", "author", "message"),
    [
        (
            "verified",
            {},
            "alice",
            "unverified/active -> verified is illegal: alice is the author; another agent must verify",
        ),
        (
            "contradicted",
            {"contradicted_by": "a1", "reason": "r"},
            "bob",
            "unverified/active -> contradicted is illegal: an artifact cannot contradict itself",
        ),
        (
            "contradicted",
            {"contradicted_by": "ghost", "reason": "r"},
            "bob",
            "absent -> contradicted is illegal: contradicting artifact 'ghost' does not exist",
        ),
    ],
    ids=["own-verification", "self-contradiction", "missing-contradictor"],
)
def test_a_refused_trust_change_says_exactly_why(
    agents: dict[str, AgentKey], kind: str, body: dict[str, str], author: str, message: str
) -> None:
    with pytest.raises(IllegalTransition) as raised:
        decide(ev(agents[author], kind, body, artifact_id="a1"), 2, {"a1": state("a1")}.get, never, STAFF)
    subject = "ghost" if "ghost" in message else "a1"
    assert str(raised.value) == f"artifact {subject}: {message}"


def test_an_id_already_taken_and_an_unusable_successor_are_refused_with_their_reason(
    agents: dict[str, AgentKey],
) -> None:
    with pytest.raises(IllegalTransition) as raised:
        decide(claim(agents["alice"], "a1"), 2, {"a1": state("a1")}.get, never, STAFF)
    assert str(raised.value) == "artifact a1: exists -> finding is illegal: an artifact with this id already exists"
    event = ev(agents["bob"], "resolved", {"resolution": "superseded", "superseded_by": "b"}, artifact_id="a")
    with pytest.raises(IllegalTransition) as raised:
        decide(event, 5, {"a": state("a"), "b": state("b", R)}.get, never, STAFF)
    assert str(raised.value) == (
        "artifact b: rolled_back/active -> supersedes a is illegal: "
        "a successor must be active and neither contradicted, rolled back nor forgotten"
    )


def test_an_event_id_is_new_repeated_or_in_conflict_by_its_digest() -> None:
    kept: dict[str, str | None] = {"e1": "d1", "e2": None}
    assert id_use(kept, "e0", "d0") is IdUse.new
    assert id_use(kept, "e1", "d1") is IdUse.repeat
    assert id_use(kept, "e1", "other") is IdUse.conflict
    assert id_use(kept, "e2", "anything") is IdUse.repeat  # kept, digest unknown: not called a conflict


def test_a_fold_applies_an_event_once_and_refuses_its_id_reused_with_other_content(agents: dict[str, AgentKey]) -> None:
    first = claim(agents["alice"], "a1")
    reused = draft_event(
        "finding",
        {"text": "something else", "impact": 0.5, "confidence": 0.6, "subject": "x"},
        project="proj",
        actor=agents["alice"].actor,
        session_id="s",
        artifact_id="a2",
        event_id=first.event_id,
    )
    fold = Fold(authority=STAFF)
    assert fold.apply(first, 3) is not None
    assert fold.apply(first, 4) is None
    assert fold.apply(reused, 5) is None
    assert fold.refused == {str(first.event_id): event_digest(reused)}
    assert fold.digests == {str(first.event_id): event_digest(first)}
    assert (list(fold.artifacts), fold.artifacts["a1"].last_seq) == (["a1"], 3)


def test_a_fold_records_the_flags_of_each_flagged_event(agents: dict[str, AgentKey]) -> None:
    body = {"text": "sure of it", "impact": 0.5, "confidence": 0.9, "subject": "s"}
    event = ev(agents["alice"], "finding", body, artifact_id="a", source="intuition")
    assert Fold.of([(event, 1)]).flags == {str(event.event_id): frozenset({FLAG_UNEARNED})}
