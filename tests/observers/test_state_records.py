"""One conversion between an artifact state and a plain record, and the store shapes derived from it: any state
survives state → record → state (through JSON text too), state → journal row → state (through a real SQLite
table) and state → mirror payload → state."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, create_engine, delete, select

from bus.model.state import FLAG_UNEARNED, ArtifactState
from bus.model.tombstones import FLAG_PREVIOUSLY_RETRACTED
from bus.model.vocab import EpistemicSource, Lifecycle, ResolutionKind, Trust
from observers.mirror.observer import payload_state, state_payload
from observers.projection import row_to_state, state_to_row
from observers.schema import artifacts, metadata

text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=40)
ids = st.text("abcdef0123456789-", min_size=1, max_size=36)
maybe_id = st.none() | ids
unit = st.none() | st.floats(0.0, 1.0, allow_nan=False)
IN_UTC = st.just(UTC)


def times(zones: st.SearchStrategy[timezone]) -> st.SearchStrategy[datetime]:
    return st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=zones)


def states(zones: st.SearchStrategy[timezone] = IN_UTC) -> st.SearchStrategy[ArtifactState]:
    return st.builds(
        ArtifactState,
        project=ids,
        artifact_id=ids,
        kind=st.sampled_from(["finding", "unknown", "assumption", "decision", "mistake", "dead_end"]),
        author=ids,
        created_event_id=ids,
        created_at=times(zones),
        content=text,
        content_hash=st.text("0123456789abcdef", min_size=64, max_size=64),
        impact=unit,
        confidence=unit,
        source=st.none() | st.sampled_from(EpistemicSource),
        goal_id=maybe_id,
        revises=maybe_id,
        supersedes=maybe_id,
        superseded_by=maybe_id,
        contradicted_by=maybe_id,
        trust=st.sampled_from(Trust),
        lifecycle=st.sampled_from(Lifecycle),
        resolution=st.none() | st.sampled_from(ResolutionKind),
        forgotten=st.booleans(),
        flags=st.frozensets(st.sampled_from([FLAG_UNEARNED, FLAG_PREVIOUSLY_RETRACTED, "repeat_of_tombstone"])),
        last_seq=st.integers(0, 2**62),
        updated_at=st.none() | times(zones),
    )


def test_the_record_has_one_key_per_stored_field() -> None:
    stored = {f.name for f in dataclasses.fields(ArtifactState)} - {"erased"}
    state = ArtifactState("p", "a", "finding", "alice", "e", datetime.now(UTC), "c", "h", None, None, None)
    assert set(state.to_record()) == stored
    assert set(state_to_row(state)) == set(artifacts.c.keys())


@given(states(st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-7))])))
def test_a_state_survives_its_record_as_json_text(state: ArtifactState) -> None:
    record = state.to_record()
    assert ArtifactState.from_record(json.loads(json.dumps(record))) == state
    assert ArtifactState.from_record(record) == state


@given(states())
def test_a_state_survives_its_mirror_payload(state: ArtifactState) -> None:
    payload = json.loads(json.dumps(state_payload(state)))
    assert payload["resolution"] == (state.resolution.value if state.resolution else "none")
    assert payload_state(payload) == state


@pytest.fixture(scope="module")
def table() -> Iterator[Engine]:
    engine = create_engine("sqlite://")
    metadata.create_all(engine, tables=[artifacts])
    yield engine
    engine.dispose()


@settings(max_examples=60, deadline=None)
@given(state=states())
def test_a_state_survives_a_journal_row(table: Engine, state: ArtifactState) -> None:
    with table.begin() as conn:
        conn.execute(delete(artifacts))
        conn.execute(artifacts.insert(), [state_to_row(state)])
        (row,) = conn.execute(select(artifacts)).all()
    assert row_to_state(row._mapping) == state
