"""The envelope: validation, canonical JSON, signatures, ids, the kind registry."""

from __future__ import annotations

import json
import os
import string
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.errors import ConfigError, InvalidEvent
from bus.identity.signing import AgentKey, verify_signature, wire_message
from bus.intake.admission import TimeBounds, check_message
from bus.model import kinds as kinds_module
from bus.model.event import MAX_EVENT_BYTES, Envelope, decode_event, draft_event, encode_event
from bus.model.ids import event_id_time, new_event_id, point_id
from bus.model.kinds import Body, FindingBody, ResolvedBody, kind_names, register_kind
from bus.model.vocab import HELP, DeadLetterReason, EpistemicSource, ResolutionKind, Reversibility, Trust, describe


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> AgentKey:
    return AgentKey.load_or_create(tmp_path_factory.mktemp("keys"), "alice")


def _draft(key: AgentKey, kind: str, body: dict[str, object], **kw: Any) -> Envelope:
    return draft_event(kind, body, project=kw.pop("project", "demo"), actor=key.actor, session_id="s1", **kw)


# NUL is refused (a PostgreSQL journal cannot store it): see the test below.
text_st = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), min_size=1, max_size=200
)
unit_st = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
slug_st = st.from_regex(r"^[a-z0-9][a-z0-9-]{0,20}$", fullmatch=True)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=text_st, impact=unit_st, confidence=unit_st, project=slug_st, source=st.sampled_from([None, *EpistemicSource])
)
def test_any_valid_finding_survives_encode_sign_decode_verify(
    key: AgentKey, text: str, impact: float, confidence: float, project: str, source: EpistemicSource | None
) -> None:
    event = key.sign(
        _draft(
            key,
            "finding",
            {"text": text, "impact": impact, "confidence": confidence, "subject": "s"},
            project=project,
            source=source,
        )
    )
    wire = wire_message(event)
    decoded = check_message(wire.subject, wire.data, datetime.now(UTC), TimeBounds(), wire.headers)
    assert decoded == event
    assert encode_event(decoded) == wire.data  # canonical: same bytes every time
    verify_signature(decoded)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(impact=st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.000001)).filter(lambda x: x == x))
def test_impact_outside_zero_to_one_is_rejected_naming_the_field(key: AgentKey, impact: float) -> None:
    with pytest.raises(InvalidEvent, match=r"body\.impact"):
        _draft(key, "finding", {"text": "t", "impact": impact, "confidence": 0.5, "subject": "s"})


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=12))
def test_any_extra_body_key_is_rejected(key: AgentKey, extra: str) -> None:
    body = {"text": "t", "impact": 0.5, "confidence": 0.5, "subject": "s"}
    if extra in body or extra in FindingBody.model_fields:
        return
    with pytest.raises(InvalidEvent, match=rf"body\.{extra}.*Extra inputs"):
        _draft(key, "finding", {**body, extra: 1})


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    project=st.text(min_size=0, max_size=70).filter(
        lambda p: not __import__("re").fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", p)
    )
)
def test_bad_project_slug_is_rejected(key: AgentKey, project: str) -> None:
    with pytest.raises(InvalidEvent, match="project"):
        _draft(key, "unknown", {"question": "q", "impact": 0.1}, project=project)


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_never_decode_to_an_event(data: bytes) -> None:
    with pytest.raises(InvalidEvent):
        decode_event(data)


def test_unknown_kind_lists_the_allowed_kinds(key: AgentKey) -> None:
    with pytest.raises(InvalidEvent) as info:
        _draft(key, "rumour", {"text": "t"})
    assert "rumour" in str(info.value)
    for kind in ("finding", "decision", "dead_end"):
        assert kind in str(info.value)


def test_enum_error_names_field_value_and_allowed_values(key: AgentKey) -> None:
    body = {"choice": "c", "rationale": "r", "confidence": 0.5, "reversibility": "maybe"}
    with pytest.raises(InvalidEvent) as info:
        _draft(key, "decision", body)
    assert str(info.value) == "body.reversibility='maybe': expected 'exploratory', 'committal' or 'forced'"


def test_decision_requires_a_rationale(key: AgentKey) -> None:
    with pytest.raises(InvalidEvent, match=r"body\.rationale"):
        _draft(key, "decision", {"choice": "c", "confidence": 0.5, "reversibility": "committal"})


def test_envelope_extra_key_is_rejected(key: AgentKey) -> None:
    event = key.sign(_draft(key, "unknown", {"question": "q", "impact": 0.0}))
    raw = json.loads(encode_event(event))
    raw["priority"] = "high"
    with pytest.raises(InvalidEvent, match="priority"):
        decode_event(json.dumps(raw).encode())


def test_oversize_event_is_rejected_before_anything_is_written(key: AgentKey) -> None:
    event = key.sign_v1(  # signing in the current format refuses it already (tests/bus/test_wire.py)
        _draft(
            key,
            "finding",
            {
                "text": "x" * 16_000,
                "impact": 0.5,
                "confidence": 0.5,
                "subject": "s",
                "evidence": [{"kind": "file", "ref": "a" * 2000, "excerpt": "e" * 4000}] * 12,
            },
        )
    )
    with pytest.raises(InvalidEvent, match=str(MAX_EVENT_BYTES)):
        encode_event(event)
    with pytest.raises(InvalidEvent, match="limit"):
        decode_event(b" " * (MAX_EVENT_BYTES + 1))


def test_superseded_needs_a_successor_and_only_superseded_may_name_one(key: AgentKey) -> None:
    with pytest.raises(InvalidEvent, match="superseded_by"):
        _draft(key, "resolved", {"resolution": "superseded"}, artifact_id="a1")
    with pytest.raises(InvalidEvent, match="superseded_by"):
        _draft(key, "resolved", {"resolution": "stale", "superseded_by": "a2"}, artifact_id="a1")
    ok = _draft(key, "resolved", {"resolution": "superseded", "superseded_by": "a2"}, artifact_id="a1")
    assert isinstance(ok.body, ResolvedBody)
    assert ok.body.superseded_by == "a2"


def test_unknown_resolution_kind_is_an_error_never_coerced(key: AgentKey) -> None:
    with pytest.raises(InvalidEvent, match="resolution"):
        _draft(key, "resolved", {"resolution": "obsolete"}, artifact_id="a1")


def test_transition_kinds_require_an_artifact_id(key: AgentKey) -> None:
    with pytest.raises(InvalidEvent, match="artifact_id"):
        _draft(key, "verified", {})


def test_tampered_legacy_event_fails_signature_verification(key: AgentKey) -> None:
    event = key.sign_v1(_draft(key, "unknown", {"question": "is it cold?", "impact": 0.2}))
    raw = json.loads(encode_event(event))
    raw["body"]["impact"] = 0.9
    with pytest.raises(InvalidEvent, match="does not verify"):
        verify_signature(decode_event(json.dumps(raw).encode()))


def test_unsigned_event_fails_verification(key: AgentKey) -> None:
    with pytest.raises(InvalidEvent, match="missing"):
        verify_signature(_draft(key, "unknown", {"question": "q", "impact": 0.2}))


def test_a_key_cannot_sign_for_another_agent(tmp_path: Path, key: AgentKey) -> None:
    bob = AgentKey.load_or_create(tmp_path, "bob")
    with pytest.raises(InvalidEvent, match="actor"):
        bob.sign(_draft(key, "unknown", {"question": "q", "impact": 0.2}))


def test_agent_key_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    first = AgentKey.load_or_create(tmp_path, "carol")
    again = AgentKey.load_or_create(tmp_path, "carol")
    other = AgentKey.load_or_create(tmp_path, "dave")
    assert first.public_key == again.public_key != other.public_key
    assert (tmp_path / "keys" / "carol.nk").stat().st_mode & 0o777 == 0o600


def test_agent_name_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="agent"):
        AgentKey.load_or_create(tmp_path, "../etc/passwd")


def test_event_ids_are_uuid7_and_sort_in_creation_order() -> None:
    ids = [new_event_id() for _ in range(5000)]
    assert all(i.version == 7 for i in ids)
    assert ids == sorted(ids, key=lambda u: u.bytes)
    assert len(set(ids)) == len(ids)
    assert abs((event_id_time(ids[0]) - datetime.now(UTC)).total_seconds()) < 5


def test_point_id_is_deterministic_and_distinct_per_event() -> None:
    a, b = new_event_id(), new_event_id()
    assert point_id(a) == point_id(uuid.UUID(str(a)))
    assert point_id(a) != point_id(b)
    assert point_id(a).version == 5


def test_non_uuid7_event_id_is_rejected(key: AgentKey) -> None:
    event = key.sign(_draft(key, "unknown", {"question": "q", "impact": 0.2}))
    raw = json.loads(encode_event(event))
    raw["event_id"] = str(uuid.uuid4())
    with pytest.raises(InvalidEvent, match="UUIDv7"):
        decode_event(json.dumps(raw).encode())


class HypothesisBody(Body):
    kind: ClassVar[str] = "hypothesis"
    claim: str
    odds: float


def test_custom_kinds_can_be_registered_and_round_trip(key: AgentKey, monkeypatch: pytest.MonkeyPatch) -> None:
    # A private copy of the registry: the kind must not leak into later tests (the docs list every kind).
    monkeypatch.setattr(kinds_module, "_KINDS", dict(kinds_module._KINDS))
    register_kind(HypothesisBody)
    assert "hypothesis" in kind_names()
    event = key.sign(_draft(key, "hypothesis", {"claim": "warmup helps", "odds": 0.3}))
    assert decode_event(encode_event(event)).body == HypothesisBody(claim="warmup helps", odds=0.3)
    register_kind(HypothesisBody)  # idempotent for the same model


def test_a_taken_kind_name_cannot_be_rebound() -> None:
    class Impostor(Body):
        kind: ClassVar[str] = "finding"
        text: str

    with pytest.raises(ConfigError, match="already registered"):
        register_kind(Impostor)


def test_every_vocabulary_value_has_one_line_help() -> None:
    for vocab in (EpistemicSource, ResolutionKind, Trust, Reversibility, DeadLetterReason):
        assert set(HELP[vocab]) == {v.value for v in vocab}
        assert all("\n" not in line and line for line in HELP[vocab].values())
        assert describe(vocab).count(":") >= len(vocab)


def test_a_nul_character_in_any_text_is_refused_with_a_clear_error() -> None:
    key = AgentKey.generate("alice")
    with pytest.raises(InvalidEvent, match="NUL"):
        draft_event(
            "finding",
            {"text": "a\x00b", "impact": 0.1, "confidence": 0.1, "subject": "s"},
            project="p",
            actor=key.actor,
            session_id="s",
        )


# Texts made of what confuses a scan of the encoded event: NULs, backslashes and the letters of \u0000.
nul_prone = st.lists(
    st.sampled_from(["\x00", "\\", "u0000", "\\u0000", "a", "\n", "\u00e9"]), min_size=1, max_size=8
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=nul_prone, subject=nul_prone, excerpt=nul_prone)
def test_an_event_is_refused_for_a_nul_exactly_when_one_of_its_texts_holds_one(
    text: str, subject: str, excerpt: str
) -> None:
    key = AgentKey.generate("alice")
    body = {
        "text": text,
        "impact": 0.1,
        "confidence": 0.1,
        "subject": subject,
        "evidence": [{"kind": "file", "ref": "r", "excerpt": excerpt}],
    }
    if any("\x00" in t for t in (text, subject, excerpt)):
        with pytest.raises(InvalidEvent, match="NUL"):
            draft_event("finding", body, project="p", actor=key.actor, session_id="s")
    else:
        drafted = draft_event("finding", body, project="p", actor=key.actor, session_id="s").body
        assert isinstance(drafted, FindingBody)
        assert drafted.text == text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("schema_version", True),
        ("recorded_at", 1_700_000_000),
        ("body.impact", True),
        ("body.impact", "0.5"),
        ("body.confidence", False),
    ],
)
def test_numbers_flags_and_times_are_never_coerced(tmp_path: Path, field: str, value: object) -> None:
    """`true` once passed as schema_version 1 and the signature still verified: the same event under other bytes."""
    from bus.identity.signing import AgentKey
    from bus.model.event import decode_event, draft_event, encode_event

    key = AgentKey.load_or_create(tmp_path, "alice")
    body = {"text": "t", "impact": 0.5, "confidence": 0.5, "subject": "s"}
    event = key.sign(draft_event("finding", body, project="demo", actor=key.actor, session_id="s1"))
    raw = json.loads(encode_event(event))
    target, _, name = field.rpartition(".")
    (raw[target] if target else raw)[name] = value
    with pytest.raises(InvalidEvent, match=name):
        decode_event(json.dumps(raw).encode())


def test_a_forked_child_never_repeats_its_parent_s_event_ids() -> None:
    new_event_id()  # the parent's generator has state before the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its ids and leave at once
        os.close(read_end)
        os.write(write_end, "\n".join(str(new_event_id()) for _ in range(2000)).encode())
        os._exit(0)
    os.close(write_end)
    parent = {str(new_event_id()) for _ in range(2000)}
    with os.fdopen(read_end, "rb") as child_output:
        child = set(child_output.read().decode().split("\n"))
    os.waitpid(pid, 0)
    assert len(child) == 2000
    assert not parent & child
