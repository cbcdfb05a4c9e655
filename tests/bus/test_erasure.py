"""What a forget keeps of the artifact it erases, judged without a server: the state an erased artifact had at
a given stream sequence, which forget describes it, and what a second forget of a reused id carries forward."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from bus.erasure import ErasedRecord, erased_digests, erased_events, erased_history, erased_state_at, with_erased
from bus.event import ErasedState
from bus.state import ArtifactState
from bus.vocab import Lifecycle, Trust

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


def test_an_erased_artifact_is_absent_before_its_claim_and_from_its_forget_on():
    assert erased_state_at(RECORD, "p", "a", 3) is None  # its claim is at 3: not there yet
    assert erased_state_at(RECORD, "p", "a", 10) is None
    assert erased_state_at(RECORD, "p", "a", 11) is None


def test_an_erased_artifact_has_the_last_state_recorded_before_the_sequence_without_content():
    at_4 = erased_state_at(RECORD, "p", "a", 4)
    at_9 = erased_state_at(RECORD, "p", "a", 9)
    assert at_4 is not None
    assert at_9 is not None
    assert (at_4.trust, at_4.last_seq, at_9.trust, at_9.last_seq) == (Trust.unverified, 3, Trust.verified, 6)
    assert (at_9.content, at_9.erased, at_9.created_event_id) == ("", True, str(CREATED))


def test_a_forgotten_marker_in_a_history_means_absent():
    record = ErasedRecord(forget_seq=20, history=(shell(3), shell(8, forgotten=True), shell(12)))
    assert erased_state_at(record, "p", "a", 9) is None
    found = erased_state_at(record, "p", "a", 13)
    assert found is not None
    assert found.last_seq == 12


def test_the_store_wins_and_the_first_later_forget_describes_an_erased_artifact():
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


def test_erased_digests_are_every_forgets_ids():
    erased = {
        ("p", "a"): (RECORD, ErasedRecord(30, (), {"e2": "d2"})),
        ("p", "b"): (ErasedRecord(40, (), {"e3": "d3"}),),
    }
    assert erased_digests(erased) == {"e1": "d1", "e2": "d2", "e3": "d3"}


def test_a_second_forget_carries_the_first_forgets_states_and_ids_forward():
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


def test_states_rebuilt_from_a_history_are_never_recorded_again():
    erased_state = erased_state_at(RECORD, "p", "a", 9)
    assert erased_state is not None
    assert erased_history([erased_state]) == ()
    (kept,) = erased_history([state(4, Trust.verified)])
    assert (kept.seq, kept.trust, kept.resolution) == (4, Trust.verified, None)
