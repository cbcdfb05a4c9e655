"""The batch admission (`check_messages`, `Admission.check_msgs` + `admit_checked`: signatures verified on
threads, a chunk at a time) answers exactly what the one-message admission answers, for random histories
with hostile messages mixed in: forged keys, broken signatures, misfiled subjects, impossible times, reused
ids, resends, and bytes built to break a parser, with their signature headers kept, dropped or swapped."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.enrolment.registry import AgentRegistry
from bus.host.server import NatsServer
from bus.intake import admission as admission_module
from bus.intake.admission import Admission, Delivery, Rejected, TimeBounds, check_message, check_messages
from bus.intake.stream_read import read_stream
from bus.model.event import Envelope
from bus.model.vocab import DeadLetterReason
from bus.subjects import STREAM, events_filter
from tests.histories import Message, Op, build, fresh_project, histories, make_keys, publish, register_keys
from tests.hostile import hostile_payloads

QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
Answer = tuple[str, object]


def answer(outcome: Envelope | Rejected) -> Answer:
    """What an admission decided, comparable across paths: the event, or the reason and the error."""
    if isinstance(outcome, Rejected):
        return ("rejected", (outcome.reason, outcome.error, outcome.event))
    return ("admitted", outcome)


def one_at_a_time(items: Sequence[tuple[str, bytes, datetime, dict[str, str] | None]]) -> list[Answer]:
    found = []
    for subject, data, stream_time, headers in items:
        try:
            found.append(answer(check_message(subject, data, stream_time, TimeBounds(), headers)))
        except Rejected as rejected:
            found.append(answer(rejected))
    return found


# What a hostile publisher does to a good message: other bytes under its signature, its headers dropped, the
# headers of another message, a byte flipped, a truncation.
TAMPER = ("keep", "hostile-bytes", "no-headers", "other-headers", "flip-byte", "truncate")


def tampered(messages: list[Message], choices: list[tuple[str, int]]) -> list[tuple[str, bytes, dict[str, str] | None]]:
    payloads = [h.value for h in hostile_payloads()]
    out: list[tuple[str, bytes, dict[str, str] | None]] = []
    for index, message in enumerate(messages):
        how, pick = choices[index % len(choices)] if choices else ("keep", 0)
        data, headers = message.data, message.headers
        if how == "hostile-bytes":
            data = payloads[pick % len(payloads)]
        elif how == "no-headers":
            headers = None
        elif how == "other-headers":
            headers = messages[pick % len(messages)].headers
        elif how == "flip-byte" and data:
            at = pick % len(data)
            data = data[:at] + bytes([data[at] ^ 0x20]) + data[at + 1 :]
        elif how == "truncate":
            data = data[: pick % (len(data) + 1)]
        out.append((message.subject, data, headers))
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=QUIET)
@given(
    history=histories,
    chunk=st.integers(min_value=1, max_value=9),
    choices=st.lists(st.tuples(st.sampled_from(TAMPER), st.integers(min_value=0, max_value=10_000)), max_size=12),
    late=st.booleans(),
)
def test_a_batch_is_checked_exactly_as_one_message_at_a_time(
    history: list[Op], chunk: int, choices: list[tuple[str, int]], late: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admission_module, "VERIFY_CHUNK", chunk)  # several chunks on threads, and a tail
    messages = build(history, make_keys(), fresh_project())
    # stored now (not when the module was imported: a worker may reach this test minutes later), or, late, so
    # far ahead that every event is implausibly old
    stream_time = datetime(2999, 1, 1, tzinfo=UTC) if late else datetime.now(UTC)
    items = [(s, d, stream_time, h) for s, d, h in tampered(messages, choices)]
    batched = [answer(outcome) for outcome in asyncio.run(check_messages(items, TimeBounds()))]
    single = one_at_a_time(items)
    assert batched == single
    assert len(batched) == len(messages)


def test_the_property_sees_both_answers_and_every_refusal_it_claims_to() -> None:
    """A guard for the property above: its tampering does produce admitted events and each kind of refusal."""
    keys = make_keys()
    ops: list[Op] = [("claim", 0, 0, 0, "none", 0), ("forged", 1), ("bad_signature", 0), ("wrong_subject", 2)]
    messages = build(ops, keys, fresh_project())
    now = datetime.now(UTC)
    items = [(s, d, now, h) for s, d, h in tampered(messages, [])]
    items.append((messages[0].subject, b"[" * 30000, now, messages[0].headers))
    items.append((messages[0].subject, messages[0].data, datetime(2999, 1, 1, tzinfo=UTC), messages[0].headers))
    found = asyncio.run(check_messages(items, TimeBounds()))
    kinds = [a.reason.value if isinstance(a, Rejected) else "admitted" for a in found]
    assert kinds == ["admitted", "admitted", "bad_signature", "subject_mismatch", "invalid_event", "implausible_time"]
    # the forged one is admitted here: only the key registry (admit_checked) refuses it
    assert [answer(a) for a in found] == one_at_a_time(items)


async def _admit_both_ways(url: str, project: str) -> tuple[list[Answer], list[Answer], int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        messages = [m async for batch in read_stream(js, STREAM, filter_subject=events_filter(project)) for m in batch]
        single: list[Answer] = []
        one = Admission(AgentRegistry(js))
        for msg in messages:
            try:
                delivery: Delivery | Rejected = await one.admit_msg(msg)
            except Rejected as rejected:
                delivery = rejected
            single.append(_delivered(delivery))
        batched: list[Answer] = []
        many = Admission(AgentRegistry(js))
        for msg, checked in zip(messages, await many.check_msgs(messages), strict=True):
            try:
                delivery = await many.admit_checked(msg, checked)
            except Rejected as rejected:
                delivery = rejected
            batched.append(_delivered(delivery))
        return single, batched, len(messages)
    finally:
        await nc.close()


def _delivered(outcome: Delivery | Rejected) -> Answer:
    if isinstance(outcome, Rejected):
        return answer(outcome)
    return ("admitted", (outcome.event, outcome.subject, outcome.stream_seq, outcome.stream_time))


@settings(max_examples=25, deadline=None, suppress_health_check=QUIET)
@given(history=histories, chunk=st.integers(min_value=1, max_value=5))
def test_read_from_the_stream_the_batch_admits_and_refuses_what_admit_msg_does(
    shared_nats_server: NatsServer, history: list[Op], chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real stream and key registry: forged keys are refused by the registry on both paths."""
    monkeypatch.setattr(admission_module, "VERIFY_CHUNK", chunk)
    keys = make_keys()
    project = fresh_project()

    async def go() -> tuple[list[Answer], list[Answer], int]:
        await register_keys(shared_nats_server.url, keys)
        nc = await nats.connect(shared_nats_server.url)
        try:
            await publish(nc.jetstream(), build([*history, ("forged", 0)], keys, project))
        finally:
            await nc.close()
        return await _admit_both_ways(shared_nats_server.url, project)

    single, batched, read = asyncio.run(go())
    assert batched == single
    assert len(single) == read
    reasons = {outcome[0] for kind, outcome in single if kind == "rejected"}  # type: ignore[index]
    assert DeadLetterReason.unknown_actor_key in reasons  # the forged event: refused by the registry on both


def test_a_message_whose_metadata_does_not_parse_fails_alone() -> None:
    """A message that is not a JetStream delivery (no metadata) raises what admit_msg raises, for it alone."""

    class NotJetStream:
        subject = "epi.x.finding.y"
        data = b"{}"
        headers = None
        reply = "not-an-ack-subject"

        @property
        def metadata(self) -> object:
            raise ValueError(f"no metadata in {self.reply} ({uuid.uuid4()})")

    async def go() -> None:
        admission = Admission(AgentRegistry(None))  # type: ignore[arg-type]  # never asked: nothing is admitted
        msgs = [NotJetStream()]
        checked = await admission.check_msgs(msgs)  # type: ignore[arg-type]
        assert checked == [None]
        with pytest.raises(ValueError, match="no metadata"):
            await admission.admit_checked(msgs[0], checked[0])  # type: ignore[arg-type]

    asyncio.run(go())
