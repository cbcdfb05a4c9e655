"""The audit's one rule, judged without servers: every acknowledged event present once with its published
content, whatever mix of outcomes and copies a store holds."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.errors import ConfigError
from epibus.chaos.faults import FAULTS, parse_faults
from epibus.chaos.ledger import Attempt, audit_store
from epibus.chaos.run import ChaosReport, FaultRecord

LEVELS = ("published", "outboxed", "error")


def attempt(level: str, digest: str = "d") -> Attempt:
    return Attempt(str(uuid.uuid4()), digest, "p0", "chaos-x", level)


@st.composite
def ledgers_and_stores(draw: st.DrawFn) -> tuple[list[Attempt], dict[str, list[str | None]]]:
    """Attempts, and a store holding each of them zero to three times with its own or another digest, plus ids
    nobody published."""
    attempts = [attempt(draw(st.sampled_from(LEVELS)), f"d{i}") for i in range(draw(st.integers(0, 25)))]
    store: dict[str, list[str | None]] = {}
    for a in attempts:
        copies = draw(st.lists(st.sampled_from([a.digest, a.digest, "other", None]), max_size=3))
        if copies:
            store[a.event_id] = copies
    for _ in range(draw(st.integers(0, 3))):
        store[str(uuid.uuid4())] = [draw(st.sampled_from(["x", None]))]
    return attempts, store


@given(ledgers_and_stores())
def test_every_acknowledged_event_is_counted_once_as_present_lost_duplicated_or_wrong(
    case: tuple[list[Attempt], dict[str, list[str | None]]],
) -> None:
    attempts, store = case
    audit = audit_store("journal@node-1", attempts, store)
    acked = {a.event_id: a for a in attempts if a.acknowledged}
    by_id = {a.event_id: a for a in attempts}
    assert audit.acknowledged == len(acked)
    assert set(audit.lost) == {i for i in acked if i not in store}
    assert set(audit.duplicated) == {i for i, copies in store.items() if len(copies) > 1}
    assert set(audit.wrong) == {
        i for i, copies in store.items() if i not in by_id or any(c != by_id[i].digest for c in copies)
    }
    assert set(audit.unknown) == {
        i for i, copies in store.items() if i in by_id and not by_id[i].acknowledged and i not in audit.wrong
    }
    clean = {i for i in acked if store.get(i) == [acked[i].digest]}
    assert audit.present == len(clean)
    assert audit.failed == bool(audit.lost or audit.duplicated or audit.wrong)


def test_an_event_present_with_other_content_is_wrong_and_fails_the_store() -> None:
    published = attempt("published", "right")
    audit = audit_store("stream@node-1", [published], {published.event_id: ["changed"]})
    assert audit.wrong == [published.event_id]
    assert audit.present == 0
    assert audit.failed


def test_an_unacknowledged_event_that_arrived_is_unknown_and_allowed() -> None:
    refused = attempt("error", "d")
    audit = audit_store("mirror@node-1", [refused], {refused.event_id: ["d"]})
    assert audit.unknown == [refused.event_id]
    assert not audit.failed


def test_an_outboxed_event_is_a_promise_its_absence_is_a_loss() -> None:
    outboxed = attempt("outboxed")
    audit = audit_store("journal@node-2", [outboxed], {})
    assert audit.lost == [outboxed.event_id]
    assert audit.failed


def test_faults_are_parsed_in_order_and_an_unknown_one_names_the_allowed_values() -> None:
    assert parse_faults("all") == tuple(FAULTS)
    assert parse_faults("pause, leader,pause") == ("pause", "leader")
    assert parse_faults("none") == ()
    with pytest.raises(ConfigError) as refused:
        parse_faults("leader,meteor")
    assert "'meteor'" in str(refused.value)
    assert "nats-down" in str(refused.value)


def test_a_failed_fault_fails_the_run_even_when_every_store_is_whole() -> None:
    published = attempt("published", "d")
    whole = [audit_store("journal@node-1", [published], {published.event_id: ["d"]})]
    ran = ChaosReport({}, {}, [FaultRecord("node", outcome="injected")], whole)
    orphan = ChaosReport({}, {}, [FaultRecord("node", outcome="failed: node-1: its nats-server outlived it")], whole)
    skipped = ChaosReport({}, {}, [FaultRecord("partition", outcome="not applicable: one node has one server")], whole)
    assert ran.ok
    assert skipped.ok
    assert not orphan.ok
