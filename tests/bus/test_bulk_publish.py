"""The bulk publish path (drafts signed in chunks on a worker thread) and the cheaper checks it relies on agree
with the single path: the same canonical bytes, the same NUL verdict, the same rows, the same stream messages."""

from __future__ import annotations

import json
import os
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.client.client import connect
from bus.errors import InvalidEvent
from bus.host.server import NatsServer
from bus.identity.signing import AgentKey, wire_message
from bus.intake.admission import TimeBounds, check_message
from bus.intake.runner import ConsumerRunner
from bus.model.event import _holds_nul, canonical_json, draft_event, envelope_holds_nul
from bus.model.ids import new_event_id
from bus.model.kinds import Evidence
from bus.model.vocab import EvidenceKind
from bus.outbox import signer as signer_module
from bus.outbox.outbox_file import OutboxRow
from bus.subjects import STREAM, events_filter
from observers.journal import Journal, JournalObserver
from tests.conftest import finding
from tests.support import journal_event_ids

ALICE = AgentKey.generate("alice")

# Every kind of text JSON can carry, hostile ones included: NUL and other control characters, backslashes and
# the six characters of an escaped NUL, quotes, lone surrogates, non-BMP characters.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
hostile_text = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from(["\x00", "\\", "u", "0", '"', "\x1f", "\x7f", "\u2028", "\ud800", "\U0001f600"]),
    ),
    max_size=30,
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities included: both encoders must refuse them alike
    | hostile_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=12,
)


def _outcome(encode: Any, value: Any) -> bytes | str:
    try:
        return bytes(encode(value))
    except (ValueError, UnicodeEncodeError, TypeError) as e:
        return type(e).__name__


@settings(max_examples=400, deadline=None)
@given(value=json_values)
def test_canonical_json_is_byte_identical_to_json_dumps_with_the_canonical_arguments(value: Any) -> None:
    def reference(v: Any) -> bytes:
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

    assert _outcome(canonical_json, value) == _outcome(reference, value)


def _draft(text: str = "clean") -> Any:
    return draft_event("finding", finding(text=text), project="p", actor=ALICE.actor, session_id="s")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=hostile_text,
    subject=hostile_text,
    session=hostile_text,
    goal=st.none() | hostile_text,
    ref=hostile_text,
    excerpt=st.none() | hostile_text,
)
def test_the_nul_check_agrees_with_the_walk_of_every_text(
    text: str, subject: str, session: str, goal: str | None, ref: str, excerpt: str | None
) -> None:
    # model_copy does not validate: the hostile texts reach the check exactly as a decoded event's would.
    base = _draft()
    evidence = Evidence.model_construct(kind=EvidenceKind.url, ref=ref, excerpt=excerpt, sha256=None)
    body = base.body.model_copy(update={"text": text, "subject": subject, "evidence": (evidence,)})
    event = base.model_copy(update={"session_id": session, "goal_id": goal, "body": body})
    assert envelope_holds_nul(event) == _holds_nul(event.model_dump())


@settings(max_examples=200, deadline=None)
@given(text=hostile_text.filter(bool), session=hostile_text.filter(bool))
def test_validation_refuses_a_nul_exactly_when_the_walk_finds_one(text: str, session: str) -> None:
    session = session[:128]
    fields = {"text": text, "impact": 0.5, "confidence": 0.5, "subject": "s"}
    if LONE_SURROGATE.search(text + session):  # not Unicode text at all: refused by the field, NUL or not
        with pytest.raises(InvalidEvent, match="unicode string"):
            draft_event("finding", fields, project="p", actor=ALICE.actor, session_id=session)
        return
    if "\x00" not in text + session:
        draft_event("finding", fields, project="p", actor=ALICE.actor, session_id=session)
        return
    with pytest.raises(InvalidEvent) as refused:
        draft_event("finding", fields, project="p", actor=ALICE.actor, session_id=session)
    assert (refused.value.field, refused.value.problem) == (
        "event",
        "a text holds a NUL character (\\u0000); remove it",
    )


@settings(max_examples=60, deadline=None)
@given(text=hostile_text.filter(lambda t: t and "\x00" not in t), legacy=st.booleans(), resign=st.booleans())
def test_a_prepared_and_bulk_signed_event_gives_the_row_of_the_event_signed_alone(
    text: str, legacy: bool, resign: bool
) -> None:
    if LONE_SURROGATE.search(text):  # cannot be UTF-8: refused when the event is made, before any signing path
        with pytest.raises(InvalidEvent, match=r"body\.text"):
            draft_event("finding", finding(text=text), project="p", actor=ALICE.actor, session_id="s")
        return
    draft = draft_event("finding", finding(text=text), project="p", actor=ALICE.actor, session_id="s")
    if legacy:  # a legacy event, or an already signed one, is re-made as schema_version 2 by both paths
        draft = ALICE.sign_v1(draft)
    elif resign:
        draft = ALICE.sign(draft)
    single = OutboxRow.of(ALICE.sign(draft))
    prepared = ALICE.prepare(draft)
    (signature,) = ALICE.sign_prepared([prepared])
    assert OutboxRow.prepared(prepared, signature, ALICE.public_key) == single
    assert ALICE.seal(prepared, signature) == ALICE.sign(draft)


def test_a_forked_child_does_not_repeat_its_parents_event_ids() -> None:
    new_event_id()  # the pool holds bytes the child would inherit
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.write(write, new_event_id().bytes)
        os._exit(0)
    os.close(write)
    try:
        child_id = uuid.UUID(bytes=os.read(read, 16))
    finally:
        os.close(read)
        os.waitpid(child, 0)
    parent_id = new_event_id()
    assert child_id.int & ((1 << 62) - 1) != parent_id.int & ((1 << 62) - 1)


async def test_bulk_signed_drafts_are_the_messages_single_publishes_send_and_journal_alike(
    nats_server: NatsServer, home: Path, project: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signer_module, "SIGN_CHUNK", 64)  # several chunks, and a partial last one
    at = datetime.now(UTC)
    async with connect(nats_server.url, agent="alice", home=home, outbox=False) as client:
        drafts = [
            client.draft(
                "finding",
                finding(i),
                project=project,
                event_id=new_event_id(),
                recorded_at=at + timedelta(microseconds=i),
            )
            for i in range(300)
        ]
        signed_alone = [client.key.sign(d) for d in drafts]
        # One already signed event among drafts keeps its place.
        batch = [*drafts[:100], signed_alone[100], *drafts[101:]]
        receipts = await client.publish_many(batch)
        assert [r.event_id for r in receipts] == [d.event_id for d in drafts]
        seqs = [r.stream_seq for r in receipts if r.stream_seq is not None]
        assert len(seqs) == len(receipts)
        assert seqs == sorted(seqs)
        js = client.js
        for receipt, alone in zip(receipts, signed_alone, strict=True):
            stored = await js.get_msg(STREAM, receipt.stream_seq)
            expected = wire_message(alone)
            assert stored.subject == expected.subject
            assert stored.data == expected.data
            assert {k: v for k, v in (stored.headers or {}).items() if k in expected.headers} == expected.headers
            assert check_message(stored.subject, stored.data, datetime.now(UTC), TimeBounds(), stored.headers) == alone
        # The same events published one by one are duplicates: JetStream saw the very same ids.
        again = await client.publish(signed_alone[7])
        assert again.duplicate
        assert again.stream_seq == receipts[7].stream_seq
        url = f"sqlite:///{tmp_path / 'journal.db'}"
        journal = Journal(url)
        journal.migrate()
        try:
            assert client.nc is not None
            runner = ConsumerRunner(
                client.nc, JournalObserver(journal, name="bulk"), filter_subject=events_filter(project)
            )
            for _ in range(50):
                if runner.stats.handled >= len(drafts):
                    break
                await runner.step()
            assert runner.stats.dead_lettered == {}
        finally:
            journal.close()
    assert sorted(journal_event_ids(url, project)) == sorted(str(d.event_id) for d in drafts)
