"""What a forget keeps of the artifact it erases, judged without a server: the state an erased artifact had at
a given stream sequence, which forget describes it, and what a second forget of a reused id carries forward."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime

from bus.identity.signing import AgentKey
from bus.model.authority import NO_RECORDS, Authority
from bus.model.erasure import (
    ErasedRecord,
    erased_digests,
    erased_events,
    erased_history,
    erased_record,
    erased_state_at,
    with_erased,
)
from bus.model.event import draft_event
from bus.model.kinds import ErasedState
from bus.model.state import ArtifactState
from bus.model.vocab import Lifecycle, ResolutionKind, Role, Trust
from tests.bus.test_state import standing

AT = datetime(2026, 12, 1, tzinfo=UTC)
CREATED = uuid.UUID("01a23a00-0000-7000-8000-000000000001")


def shell(seq: int, trust: Trust = Trust.unverified, *, forgotten: bool = False) -> ErasedState:
    return ErasedState(
        seq=seq,
        kind="finding",
        author="alice",
        created_event_id=CREATED,
        created_at=AT,
        trust=trust,
        lifecycle=Lifecycle.active,
        forgotten=forgotten,
    )


def state(seq: int, trust: Trust = Trust.unverified) -> ArtifactState:
    return ArtifactState(
        project="p",
        artifact_id="a",
        kind="finding",
        author="alice",
        created_event_id=str(CREATED),
        created_at=AT,
        content="secret words",
        content_hash="h",
        impact=0.5,
        confidence=0.5,
        source=None,
        trust=trust,
        last_seq=seq,
    )


RECORD = ErasedRecord(forget_seq=10, history=(shell(3), shell(6, Trust.verified)), digests={"e1": "d1"})


def test_an_erased_artifact_is_absent_before_its_claim_and_from_its_forget_on() -> None:
    assert erased_state_at(RECORD, "p", "a", 3) is None  # its claim is at 3: not there yet
    assert erased_state_at(RECORD, "p", "a", 10) is None
    assert erased_state_at(RECORD, "p", "a", 11) is None


def test_an_erased_artifact_has_the_last_state_recorded_before_the_sequence_without_content() -> None:
    at_4 = erased_state_at(RECORD, "p", "a", 4)
    at_9 = erased_state_at(RECORD, "p", "a", 9)
    assert at_4 is not None
    assert at_9 is not None
    assert (at_4.trust, at_4.last_seq, at_9.trust, at_9.last_seq) == (Trust.unverified, 3, Trust.verified, 6)
    assert (at_9.content, at_9.erased, at_9.created_event_id) == ("", True, str(CREATED))


def test_a_forgotten_marker_in_a_history_means_absent() -> None:
    record = ErasedRecord(forget_seq=20, history=(shell(3), shell(8, forgotten=True), shell(12)))
    assert erased_state_at(record, "p", "a", 9) is None
    found = erased_state_at(record, "p", "a", 13)
    assert found is not None
    assert found.last_seq == 12


def test_the_store_wins_and_the_first_later_forget_describes_an_erased_artifact() -> None:
    first = ErasedRecord(forget_seq=10, history=(shell(3),))
    second = ErasedRecord(forget_seq=30, history=(shell(3), shell(10, forgotten=True), shell(20, Trust.verified)))
    erased = {("p", "a"): (first, second)}
    lookup = with_erased(lambda _aid: None, erased, "p", 5)
    assert (lookup("a") or state(0)).last_seq == 3
    assert with_erased(lambda _aid: None, erased, "p", 15)("a") is None
    found = with_erased(lambda _aid: None, erased, "p", 25)("a")
    assert found is not None
    assert found.trust is Trust.verified
    assert with_erased(lambda _aid: None, erased, "p", 31)("a") is None
    assert with_erased(lambda _aid: None, erased, "other", 5)("a") is None
    live = state(4, Trust.contradicted)
    assert with_erased(lambda _aid: live, erased, "p", 5)("a") is live


def test_erased_digests_are_every_forgets_ids() -> None:
    erased = {
        ("p", "a"): (RECORD, ErasedRecord(30, (), {"e2": "d2"})),
        ("p", "b"): (ErasedRecord(40, (), {"e3": "d3"}),),
    }
    assert erased_digests(erased) == {"e1": "d1", "e2": "d2", "e3": "d3"}


def test_a_second_forget_carries_the_first_forgets_states_and_ids_forward() -> None:
    e1, e2 = "01a23a00-0000-7000-8000-000000000001", "01a23a00-0000-7000-8000-000000000002"
    d1, d2 = "1" * 64, "2" * 64
    earlier = (ErasedRecord(forget_seq=10, history=(shell(3), shell(6, Trust.verified)), digests={e1: d1}),)
    history = erased_history([state(15), state(18, Trust.contradicted)], earlier)
    assert [(h.seq, h.trust, h.forgotten) for h in history] == [
        (3, Trust.unverified, False),
        (6, Trust.verified, False),
        (10, Trust.verified, True),
        (15, Trust.unverified, False),
        (18, Trust.contradicted, False),
    ]
    events = erased_events({e2: d2, "not-erased": "3" * 64}, [(15, e2), (16, None)], earlier)
    assert [(str(e.event_id), e.digest) for e in events] == [(e1, d1), (e2, d2)]


def test_states_rebuilt_from_a_history_are_never_recorded_again() -> None:
    erased_state = erased_state_at(RECORD, "p", "a", 9)
    assert erased_state is not None
    assert erased_history([erased_state]) == ()
    (kept,) = erased_history([state(4, Trust.verified)])
    assert (kept.seq, kept.trust, kept.resolution) == (4, Trust.verified, None)


def full_state(seq: int) -> ArtifactState:
    """A state with every field that a forget keeps set to something other than its default."""
    return replace(
        state(seq, Trust.contradicted),
        impact=0.25,
        confidence=0.75,
        revises="r",
        supersedes="s",
        superseded_by="n",
        contradicted_by="c",
        lifecycle=Lifecycle.resolved,
        resolution=ResolutionKind.superseded,
    )


def test_a_state_kept_by_a_forget_comes_back_whole_but_for_its_content() -> None:
    kept = full_state(7)
    record = ErasedRecord(forget_seq=9, history=erased_history([kept]))
    back = erased_state_at(record, "p", "a", 8)
    assert back == replace(kept, content="", content_hash="", erased=True)
    found = with_erased(lambda _aid: None, {("p", "a"): (record,)}, "p", 8)("a")
    assert found == back


def test_a_forgotten_event_is_read_into_its_record_and_no_other_event_is() -> None:
    key = AgentKey.generate("alice")
    e1, d1 = uuid.UUID("01a23a00-0000-7000-8000-000000000001"), "1" * 64
    history = erased_history([full_state(7)])
    body = {
        "reason": "privacy",
        "history": [h.model_dump(mode="json") for h in history],
        "events": [{"event_id": str(e1), "digest": d1}],
    }
    forget = key.sign(draft_event("forgotten", body, project="p", actor=key.actor, session_id="s", artifact_id="a"))
    assert erased_record(forget, 42, NO_RECORDS) == ErasedRecord(42, history, {str(e1): d1})
    claim = key.sign(
        draft_event("unknown", {"question": "q?", "impact": 0.1}, project="p", actor=key.actor, session_id="s")
    )
    assert erased_record(claim, 43, NO_RECORDS) is None


def test_a_forget_its_actor_may_not_make_records_nothing_and_takes_no_event_id() -> None:
    """Every path rejects bob's forget of alice's claim (bus/model/authority.py), so no path may treat what it lists as
    erased: a reader of the stream would skip events the live nodes kept."""
    bob = AgentKey.generate("bob")
    history = erased_history([full_state(7)])  # alice's claim
    body = {
        "reason": "privacy",
        "history": [h.model_dump(mode="json") for h in history],
        "events": [{"event_id": str(CREATED), "digest": "1" * 64}],
    }
    forget = bob.sign(draft_event("forgotten", body, project="p", actor=bob.actor, session_id="s", artifact_id="a"))
    assert erased_record(forget, 42, NO_RECORDS) is None
    as_admin = Authority.of([(41, standing("bob", Role.admin))])
    assert erased_record(forget, 42, as_admin) == ErasedRecord(42, history, {str(CREATED): "1" * 64})


def test_the_marker_of_an_earlier_forget_copies_its_last_state_and_later_states_start_after_it() -> None:
    earlier = (ErasedRecord(forget_seq=10, history=(shell(3), shell(5), shell(6, Trust.verified))),)
    history = erased_history([state(10), state(11)], earlier)
    assert [(h.seq, h.trust, h.forgotten) for h in history] == [
        (3, Trust.unverified, False),
        (5, Trust.unverified, False),
        (6, Trust.verified, False),
        (10, Trust.verified, True),
        (11, Trust.unverified, False),
    ]
    assert [h.seq for h in erased_history([state(1)])] == [1]
