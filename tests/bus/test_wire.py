"""The wire format: an event is signed over a domain prefix, its subject and its body bytes as sent, the
signature and key travel in headers, and legacy events (signature inside, schema_version 1) stay admitted."""

from __future__ import annotations

import base64
import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.client.client import connect
from bus.host.server import NatsServer
from bus.identity.signing import (
    EVENT_DOMAIN,
    AgentKey,
    WireMessage,
    event_signed_bytes,
    message_format,
    verify_key,
    wire_message,
)
from bus.intake.admission import Rejected, TimeBounds, check_message
from bus.intake.reader import dead_letters
from bus.model.event import LEGACY_SCHEMA_VERSION, SCHEMA_VERSION, Envelope, draft_event, encode_event
from bus.model.vocab import DeadLetterReason
from bus.outbox.outbox import Outbox
from bus.outbox.outbox_file import OutboxRow
from bus.subjects import DLQ_REASON, EVENT_KEY_HEADER, EVENT_SIGNATURE_HEADER, STREAM
from epibus.cli.common import Target
from epibus.cli.dlq import _dlq_replay
from observers.journal import Journal, JournalObserver
from tests.bus.test_runner import FailingObserver, running
from tests.conftest import finding
from tests.support import eventually, headers_of, journal_event_ids

ALICE = AgentKey.generate("alice")
MALLORY = AgentKey.generate("alice")  # the same agent name, another key


def _admit(subject: str, data: bytes, headers: dict[str, str]) -> Envelope:
    return check_message(subject, data, datetime.now(UTC), TimeBounds(), headers)


def _event(key: AgentKey, text: str, project: str = "p") -> Envelope:
    return key.sign(draft_event("finding", finding(text=text), project=project, actor=key.actor, session_id="s"))


def _refusal(subject: str, data: bytes, headers: dict[str, str]) -> DeadLetterReason:
    with pytest.raises(Rejected) as refused:
        _admit(subject, data, headers)
    return refused.value.reason


text_st = st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), min_size=1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=text_st, at=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255))
def test_a_signed_event_verifies_and_any_changed_byte_of_body_or_subject_is_refused(
    text: str, at: int, flip: int
) -> None:
    event = _event(ALICE, text)
    wire = wire_message(event)
    headers = dict(wire.headers)
    assert _admit(wire.subject, wire.data, headers) == event
    # The signature is plain ed25519 over the documented bytes, checked here without epibus's own verifier.
    verify_key(headers[EVENT_KEY_HEADER]).verify(
        EVENT_DOMAIN + wire.subject.encode() + b"\n" + wire.data,
        base64.urlsafe_b64decode(headers[EVENT_SIGNATURE_HEADER] + "=="),
    )
    body = bytearray(wire.data)
    body[at % len(body)] ^= flip
    # Refused whatever the change hits first (the JSON, the subject it implies, the signature): never admitted.
    assert _refusal(wire.subject, bytes(body), headers) in set(DeadLetterReason)
    subject = bytearray(wire.subject.encode())
    subject[at % len(subject)] ^= flip
    changed = subject.decode("utf-8", errors="replace")
    assert _refusal(changed, wire.data, headers) in {DeadLetterReason.subject_mismatch, DeadLetterReason.bad_signature}


@settings(max_examples=25, deadline=None)
@given(first=text_st, second=text_st)
def test_swapped_headers_and_swapped_keys_are_refused(first: str, second: str) -> None:
    one, other = wire_message(_event(ALICE, first)), wire_message(_event(ALICE, second))
    swapped = {EVENT_SIGNATURE_HEADER: other.headers[EVENT_SIGNATURE_HEADER], EVENT_KEY_HEADER: ALICE.public_key}
    assert _refusal(one.subject, one.data, swapped) is DeadLetterReason.bad_signature
    # The same body signed by another key: the key header names it, the body names alice's key.
    forged = MALLORY._pair.sign(event_signed_bytes(one.subject, one.data))
    stolen = {EVENT_SIGNATURE_HEADER: _b64(forged), EVENT_KEY_HEADER: MALLORY.public_key}
    assert _refusal(one.subject, one.data, stolen) is DeadLetterReason.bad_signature
    named = {EVENT_SIGNATURE_HEADER: _b64(forged), EVENT_KEY_HEADER: ALICE.public_key}
    assert _refusal(one.subject, one.data, named) is DeadLetterReason.bad_signature
    assert _refusal(one.subject, one.data, {}) is DeadLetterReason.bad_signature  # headers stripped


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_one_function_decides_the_format_and_the_body_must_agree() -> None:
    assert message_format(None) == message_format({"Nats-Msg-Id": "x"}) == LEGACY_SCHEMA_VERSION
    assert message_format({EVENT_SIGNATURE_HEADER: ""}) == message_format({EVENT_KEY_HEADER: ""}) == SCHEMA_VERSION
    legacy = ALICE.sign_v1(draft_event("finding", finding(1), project="p", actor=ALICE.actor, session_id="s"))
    data = encode_event(legacy)
    assert json.loads(data)["schema_version"] == 1
    assert "signature" in json.loads(data)
    subject = wire_message(legacy).subject
    assert _admit(subject, data, {}) == legacy
    # A legacy body under v2 headers, or a v2 body with a signature member, is refused.
    v2 = wire_message(_event(ALICE, "v2"))
    assert _refusal(subject, data, dict(v2.headers)) is DeadLetterReason.invalid_event
    inside = json.loads(v2.data) | {"signature": v2.headers[EVENT_SIGNATURE_HEADER]}
    assert _refusal(v2.subject, json.dumps(inside).encode(), dict(v2.headers)) is DeadLetterReason.invalid_event
    # Each key once: parsers disagree about which of two equal keys wins.
    doubled = v2.data[:-1] + b',"kind":"decision"}'
    assert _refusal(v2.subject, doubled, dict(v2.headers)) is DeadLetterReason.invalid_event


def test_signing_serialises_once_and_the_bytes_signed_are_the_bytes_sent() -> None:
    event = _event(ALICE, "once")
    assert wire_message(event).data is wire_message(event).data  # kept from signing, not encoded again
    copy = event.model_copy(update={"session_id": "other"})
    assert wire_message(copy).data != wire_message(event).data  # a changed copy is encoded anew
    assert json.loads(wire_message(event).data)["schema_version"] == SCHEMA_VERSION


def _reordered(wire: WireMessage) -> bytes:
    """The same event as a third party re-serialising it would send it: same content, keys reversed."""
    return json.dumps(dict(reversed(list(json.loads(wire.data).items())))).encode()


async def test_legacy_events_in_the_stream_are_journaled_and_reserialised_ones_are_dead_lettered(
    nats_server: NatsServer, home: Path, project: str, journal: Journal
) -> None:
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, JournalObserver(journal)) as (runner,),
    ):
        current = client.event("finding", finding(1), project=project)
        await client.publish(current)
        legacy = client.key.sign_v1(
            draft_event("finding", finding(2), project=project, actor=client.key.actor, session_id="s")
        )
        reserialised = client.event("finding", finding(3), project=project)
        wire = wire_message(reserialised)
        raw = await nats.connect(nats_server.url)
        js = raw.jetstream()
        await js.publish(wire_message(legacy).subject, encode_event(legacy))  # as today's streams hold them
        await js.publish(wire.subject, _reordered(wire), headers=dict(wire.headers))
        await raw.close()
        await eventually(lambda: runner.stats.handled == 2 and sum(runner.stats.dead_lettered.values()) == 1)
        letters = await dead_letters(client.js)
    assert sorted(journal_event_ids(journal.url, project)) == sorted([str(current.event_id), str(legacy.event_id)])
    assert [headers_of(m)[DLQ_REASON] for m in letters] == ["bad_signature"]
    # The dead letter keeps the signature headers, so `dlq replay` can send the message again as it came.
    assert headers_of(letters[0])[EVENT_SIGNATURE_HEADER] == wire.headers[EVENT_SIGNATURE_HEADER]
    assert headers_of(letters[0])[EVENT_KEY_HEADER] == client.key.public_key


async def test_an_outbox_file_from_before_signature_columns_still_forwards_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    legacy = ALICE.sign_v1(draft_event("finding", finding(1), project="p", actor=ALICE.actor, session_id="s"))
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE,"
        " subject TEXT NOT NULL, payload BLOB NOT NULL, created_at REAL NOT NULL, lease_owner TEXT,"
        " lease_until REAL NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT, sent_at REAL,"
        " stream_seq INTEGER, duplicate INTEGER, origin TEXT)"
    )
    conn.execute(
        "INSERT INTO outbox (event_id, subject, payload, created_at) VALUES (?, ?, ?, 0)",
        (str(legacy.event_id), wire_message(legacy).subject, encode_event(legacy)),
    )
    conn.commit()
    conn.close()
    current = _event(ALICE, "new")
    outbox = await Outbox(path).open()
    try:
        await outbox.add([OutboxRow.of(current)])
        rows = {row.event_id: row for row in await outbox.claim(10, 30.0)}
    finally:
        await outbox.close()
    old, new = rows[str(legacy.event_id)], rows[str(current.event_id)]
    assert old.headers() == {"Nats-Msg-Id": str(legacy.event_id)}
    assert _admit(old.subject, old.payload, old.headers()) == legacy
    assert new.headers()[EVENT_SIGNATURE_HEADER] == current.signature
    assert _admit(new.subject, new.payload, new.headers()) == current


async def test_a_replayed_dead_letter_keeps_its_subject_and_signature_headers(
    nats_server: NatsServer, home: Path, project: str
) -> None:
    observer = FailingObserver("always-fails", failures=10**6)
    async with (
        connect(nats_server.url, agent="alice", home=home) as client,
        running(nats_server.url, observer, max_deliver=2, redelivery_delays_s=(0.05,), fetch_timeout_s=0.2) as (
            runner,
        ),
    ):
        event = client.event("finding", finding(), project=project)
        await client.publish(event)
        await eventually(lambda: runner.stats.dead_lettered.get("max_deliver") == 1)
        (letter,) = await dead_letters(client.js)
        replayed = await _dlq_replay(
            {letter.metadata.sequence.stream}, False, False, Target(nats_server.url, home, "alice")
        )
        assert replayed == [letter.metadata.sequence.stream]
        wire = wire_message(event)
        again = await client.js.get_msg(STREAM, subject=wire.subject)  # the last on the subject
    assert again.seq == 2  # a second message on the subject: the replay
    assert again.data == wire.data
    assert again.headers is not None
    assert {k: again.headers[k] for k in wire.headers} == dict(wire.headers)
    assert _admit(wire.subject, again.data, again.headers) == event
