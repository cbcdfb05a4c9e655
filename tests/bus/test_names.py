"""Names are checked whole: a trailing newline is not part of a valid name (Python's `$` would allow it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bus.errors import ConfigError, InvalidEvent
from bus.identity.signing import AgentKey
from bus.model.event import draft_event, validate_event
from bus.subjects import events_filter, parse_event_subject


@pytest.mark.parametrize("name", ["alice\n", "alice\r\n", "\nalice", "alice bob", ""])
def test_an_agent_name_with_a_newline_is_refused_and_creates_no_key(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="agent"):
        AgentKey.load_or_create(tmp_path, name)
    assert not (tmp_path / "keys").exists() or list((tmp_path / "keys").iterdir()) == []


@pytest.mark.parametrize("field", ["project", "artifact_id"])
def test_an_event_whose_names_end_in_a_newline_is_invalid(tmp_path: Path, field: str) -> None:
    key = AgentKey.load_or_create(tmp_path, "alice")
    event = draft_event(
        "finding",
        {"text": "t", "impact": 0.5, "confidence": 0.5, "subject": "s"},
        project="demo",
        actor=key.actor,
        session_id="s1",
    )
    raw = json.loads(event.model_dump_json()) | {field: "demo\n"}
    with pytest.raises(InvalidEvent, match=field):
        validate_event(raw)


def test_a_subject_with_a_trailing_newline_is_no_event_subject() -> None:
    assert parse_event_subject("epi.demo.finding.a1\n") is None
    with pytest.raises(ConfigError, match="project"):
        events_filter("demo\n")
