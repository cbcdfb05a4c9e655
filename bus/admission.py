"""The one admission rule. Every path that takes events from the stream (the live runner, replay, verify's
repair, reindex, a second node catching up, the client's fold) admits a message with `Admission.admit`, so a
message is admitted by all of them or by none: bytes, subject, time, signature and the agent's registered key.
Each path then attaches to a batch what deciding it needs from the rest of the stream (`BatchContext`): what
forgets recorded of erased artifacts, and the enrolment records in force.

What fails is `Rejected` with a reason from `DeadLetterReason`; the live runner dead-letters it, the other
paths report it. A registry that does not answer is `Unavailable`: retry later, never guess."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import ParamSpec, TypeVar

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.auth import Enrolment
from bus.authority import NO_RECORDS, Authority, enrolment_record
from bus.erasure import ErasedMap, ErasedRecord, erased_record
from bus.errors import ConfigError, Conflict, InvalidEvent, Unavailable
from bus.event import LEGACY_SCHEMA_VERSION, Envelope, canonical_digest, canonical_event, decode_event
from bus.nats_errors import JS_TIMEOUT_S, NATS_OR_API_ERROR, nats_call
from bus.registry import AgentRegistry
from bus.signing import message_format, verify_message, verify_signature
from bus.state import IdUse, id_use
from bus.subjects import (
    ENROLMENTS_FILTER,
    EVENT_KEY_HEADER,
    EVENT_SIGNATURE_HEADER,
    STREAM,
    event_subject,
    events_filter,
    parse_event_subject,
)
from bus.vocab import DeadLetterReason

# How far ahead of the stream's clock a publisher's clock may run.
DEFAULT_FUTURE_SKEW_S = 300.0
# How long an event may wait (in an outbox, offline) between being recorded and reaching the stream.
DEFAULT_MAX_DELAY_S = 30 * 86_400.0
FUTURE_SKEW_ENV = "EPIBUS_MAX_CLOCK_SKEW_S"
MAX_DELAY_ENV = "EPIBUS_MAX_PUBLISH_DELAY_S"
_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Delivery:
    """An admitted event as it came from the stream."""

    event: Envelope
    subject: str
    stream_seq: int
    num_delivered: int
    stream_time: datetime | None = None  # when JetStream stored it (server clock, ordered with stream_seq)
    # What later `forgotten` events recorded of the erased artifacts this batch refers to (ForgottenArtifacts).
    erased: ErasedMap = field(default_factory=dict, compare=False)
    # The stream's enrolment records when the batch was read: every record before this event is among them.
    authority: Authority = field(default=NO_RECORDS, compare=False)

    @cached_property
    def canonical(self) -> bytes:
        """The event as canonical JSON, made once: its digest and a journal's envelope column share it."""
        return canonical_event(self.event)

    @cached_property
    def digest(self) -> str:
        return canonical_digest(self.canonical)


def batch_authority(deliveries: Sequence[Delivery]) -> Authority:
    """The enrolment records the deliveries of one batch carry (the most recently read, if they differ)."""
    return max((d.authority for d in deliveries), key=lambda a: a.last_seq, default=NO_RECORDS)


def batch_erased(deliveries: Sequence[Delivery]) -> dict[tuple[str, str], tuple[ErasedRecord, ...]]:
    """The records of erased artifacts the deliveries of one batch carry."""
    erased: dict[tuple[str, str], tuple[ErasedRecord, ...]] = {}
    for delivery in deliveries:
        erased.update(delivery.erased)
    return erased


class Rejected(Exception):
    """A message no store may admit, and why."""

    def __init__(self, reason: DeadLetterReason, error: str, event: Envelope | None = None) -> None:
        super().__init__(error)
        self.reason = reason
        self.error = error
        self.event = event


@dataclass(frozen=True)
class Refusal:
    """An admitted message a store will not take, and why: a different event already holds its event id."""

    stream_seq: int
    event_id: str
    reason: DeadLetterReason
    error: str


def first_of_each_id(
    deliveries: Sequence[Delivery], known: Mapping[str, str | None]
) -> tuple[list[Delivery], list[Refusal]]:
    """The rule for reused event ids, for every store: the first event in stream order under an id is the one
    kept. `known` holds the digests a store already has (None: held, digest unknown). Returns the deliveries
    to write (new ids, in stream order) and refusals for those that differ from the event kept; exact repeats
    are neither."""
    seen: dict[str, str | None] = dict(known)
    fresh: list[Delivery] = []
    refused: list[Refusal] = []
    for delivery in sorted(deliveries, key=lambda d: d.stream_seq):
        event_id, digest = str(delivery.event.event_id), delivery.digest
        use = id_use(seen, event_id, digest)
        if use is IdUse.new:
            seen[event_id] = digest
            fresh.append(delivery)
        elif use is IdUse.conflict:
            refused.append(conflict_refusal(delivery, seen[event_id] or ""))
    return fresh, refused


def conflict_refusal(delivery: Delivery, kept_digest: str) -> Refusal:
    event_id = str(delivery.event.event_id)
    return Refusal(
        delivery.stream_seq,
        event_id,
        DeadLetterReason.duplicate_id_conflict,
        f"event id {event_id} already holds an event with digest {kept_digest[:12]}; this one has "
        f"{delivery.digest[:12]}; the first one is kept: publish yours with a new event id",
    )


def seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as e:
        raise ConfigError(name, f"{raw!r} is not a number of seconds") from e
    if value < 0:
        raise ConfigError(name, f"{raw!r} is negative; give a number of seconds >= 0")
    return value


@dataclass(frozen=True)
class TimeBounds:
    """What `recorded_at` may be, relative to the stream's own clock. Every node of a fleet must use the same
    bounds, or nodes would disagree about which events exist."""

    future_skew_s: float = DEFAULT_FUTURE_SKEW_S
    max_delay_s: float = DEFAULT_MAX_DELAY_S

    @classmethod
    def from_env(cls) -> TimeBounds:
        return cls(
            seconds_from_env(FUTURE_SKEW_ENV, DEFAULT_FUTURE_SKEW_S),
            seconds_from_env(MAX_DELAY_ENV, DEFAULT_MAX_DELAY_S),
        )

    def problem(self, recorded_at: datetime, stream_time: datetime) -> str | None:
        """Why recorded_at is implausible for an event stored at stream_time, or None."""
        stored = stream_time.astimezone(UTC)
        if recorded_at > stored + timedelta(seconds=self.future_skew_s):
            return (
                f"recorded_at={recorded_at.isoformat()} is more than {self.future_skew_s:g}s after the stream "
                f"stored it ({stored.isoformat()}); fix the publisher's clock or raise {FUTURE_SKEW_ENV}"
            )
        if recorded_at < stored - timedelta(seconds=self.max_delay_s):
            return (
                f"recorded_at={recorded_at.isoformat()} is more than {self.max_delay_s:g}s before the stream "
                f"stored it ({stored.isoformat()}); publish a new event, or raise {MAX_DELAY_ENV}"
            )
        return None


def check_message(
    subject: str, data: bytes, stream_time: datetime, bounds: TimeBounds, headers: Mapping[str, str] | None = None
) -> Envelope:
    """Everything admission checks that needs no server: format, decoding, subject, time and signature.
    Whatever the bytes are, the answer is the event or Rejected: nothing a publisher sends escapes as another
    exception."""
    return _refusing(_check_signature, _refusing(_check_unsigned, subject, data, stream_time, bounds, headers or {}))


def _refusing(check: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`check`'s answer; any failure other than Rejected becomes one, with its type."""
    try:
        return check(*args, **kwargs)
    except Rejected:
        raise
    except Exception as e:  # hostile bytes found a failure no check names: refuse it, with its type
        raise Rejected(DeadLetterReason.invalid_event, f"undecodable: {type(e).__name__}: {e}"[:1024]) from e


@dataclass(frozen=True)
class _Unverified:
    """A message whose every check but its signature passed."""

    subject: str
    data: bytes
    headers: Mapping[str, str]
    event: Envelope
    legacy: bool


def _check_unsigned(
    subject: str, data: bytes, stream_time: datetime, bounds: TimeBounds, headers: Mapping[str, str]
) -> _Unverified:
    legacy = message_format(headers) == LEGACY_SCHEMA_VERSION
    try:
        event = decode_event(data, legacy=legacy)
    except InvalidEvent as e:
        raise Rejected(DeadLetterReason.invalid_event, str(e)) from e
    _check_format(event, legacy)
    expected = event_subject(event.project, event.kind, event.artifact_id)
    if subject != expected:
        raise Rejected(DeadLetterReason.subject_mismatch, f"subject {subject} != {expected}", event)
    problem = bounds.problem(event.recorded_at, stream_time)
    if problem is not None:
        raise Rejected(DeadLetterReason.implausible_time, problem, event)
    return _Unverified(subject, data, headers, event, legacy)


def _check_signature(message: _Unverified) -> Envelope:
    try:
        if message.legacy:
            verify_signature(message.event)
            return message.event
        return verify_message(message.subject, message.data, message.headers, message.event)
    except InvalidEvent as e:
        raise Rejected(DeadLetterReason.bad_signature, str(e), message.event) from e


# A batch's signatures are verified in chunks on these threads while the event loop checks the rest of the
# batch: PyNaCl releases the GIL, so verifying uses another core.
VERIFY_THREADS = 2
VERIFY_CHUNK = 32
_verifiers = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="epibus-verify")

Checked = Envelope | Rejected


def _verify_all(messages: Sequence[_Unverified]) -> list[Checked]:
    found: list[Checked] = []
    for message in messages:
        try:
            found.append(_refusing(_check_signature, message))
        except Rejected as rejected:
            found.append(rejected)
    return found


async def check_messages(
    messages: Sequence[tuple[str, bytes, datetime, Mapping[str, str] | None]], bounds: TimeBounds
) -> list[Checked]:
    """`check_message` of each (subject, data, stream_time, headers), in order: the event, or the Rejected it
    raises. The same two checks in the same order decide, so it admits and refuses exactly what
    `check_message` does; only the signatures are verified on threads, a chunk at a time."""
    loop = asyncio.get_running_loop()
    found: list[Checked | None] = [None] * len(messages)
    chunks: list[tuple[list[int], asyncio.Future[list[Checked]]]] = []
    indexes: list[int] = []
    chunk: list[_Unverified] = []
    for index, (subject, data, stream_time, headers) in enumerate(messages):
        try:
            chunk.append(_refusing(_check_unsigned, subject, data, stream_time, bounds, headers or {}))
            indexes.append(index)
        except Rejected as rejected:
            found[index] = rejected
        if len(chunk) == VERIFY_CHUNK:
            chunks.append((indexes, loop.run_in_executor(_verifiers, _verify_all, chunk)))
            indexes, chunk = [], []
    # The last chunk here: the loop would only wait for the threads.
    for index, checked in zip(indexes, _verify_all(chunk), strict=True):
        found[index] = checked
    for chunk_indexes, verified in chunks:
        for index, checked in zip(chunk_indexes, await verified, strict=True):
            found[index] = checked
    return [checked for checked in found if checked is not None]


def _check_format(event: Envelope, legacy: bool) -> None:
    """The body's schema_version agrees with the format its headers put it in (`signing.message_format`)."""
    if legacy and event.schema_version != LEGACY_SCHEMA_VERSION:
        raise Rejected(
            DeadLetterReason.bad_signature,
            f"schema_version {event.schema_version} is signed in the {EVENT_SIGNATURE_HEADER} and "
            f"{EVENT_KEY_HEADER} headers, and this message has neither",
            event,
        )
    if not legacy and event.schema_version == LEGACY_SCHEMA_VERSION:
        raise Rejected(
            DeadLetterReason.invalid_event,
            f"schema_version 1 carries its signature in the body; send it without {EVENT_SIGNATURE_HEADER} headers",
            event,
        )
    if not legacy and event.signature is not None:
        raise Rejected(
            DeadLetterReason.invalid_event,
            f"signature: schema_version {event.schema_version} carries it in the {EVENT_SIGNATURE_HEADER} header, "
            "never in the body",
            event,
        )


class Admission:
    """Admits messages for one reader. Holds the agent key registry (and its cache) and the time bounds."""

    def __init__(self, registry: AgentRegistry, bounds: TimeBounds | None = None) -> None:
        self.registry = registry
        self.bounds = bounds or TimeBounds.from_env()

    async def admit(
        self, subject: str, data: bytes, stream_time: datetime, headers: Mapping[str, str] | None = None
    ) -> Envelope:
        """The event, or Rejected (never admit it) or Unavailable (the registry did not answer: retry).
        `headers`: the message's, which carry a schema_version 2 event's signature."""
        return await self._bind(check_message(subject, data, stream_time, self.bounds, headers))

    async def _bind(self, event: Envelope) -> Envelope:
        """The last check, the only one that asks a server: the actor's key is the one registered for it."""
        try:
            await self.registry.bind(event.actor)
        except Conflict as e:
            raise Rejected(DeadLetterReason.unknown_actor_key, str(e), event) from e
        return event

    async def admit_msg(self, msg: Msg) -> Delivery:
        """Admit a message read from a JetStream consumer (its metadata carries the stream's sequence and time)."""
        metadata = msg.metadata
        event = await self.admit(msg.subject, msg.data, metadata.timestamp, msg.headers)
        return Delivery(event, msg.subject, metadata.sequence.stream, metadata.num_delivered, metadata.timestamp)

    async def check_msgs(self, msgs: Sequence[Msg]) -> list[Checked | None]:
        """Every check `admit_msg` makes that needs no server, for a batch read from a JetStream consumer, with
        the signatures verified on threads (`check_messages`). Hand each answer, in order, to `admit_checked`.
        None: the message's metadata does not parse, and `admit_checked` raises what `admit_msg` would."""
        readable: list[int] = []
        for index, msg in enumerate(msgs):
            try:
                msg.metadata  # noqa: B018 - parsed and kept on the message, or it raises
            except Exception:  # noqa: BLE001 - raised again by admit_checked for this message alone
                continue
            readable.append(index)
        found: list[Checked | None] = [None] * len(msgs)
        checked = await check_messages(
            [(msgs[i].subject, msgs[i].data, msgs[i].metadata.timestamp, msgs[i].headers) for i in readable],
            self.bounds,
        )
        for index, answer in zip(readable, checked, strict=True):
            found[index] = answer
        return found

    async def admit_checked(self, msg: Msg, checked: Checked | None) -> Delivery:
        """What `admit_msg` answers for `msg`, given what `check_msgs` found: Rejected, Unavailable or the
        delivery. Call it in stream order: the first event of an agent binds its key."""
        if checked is None:
            return await self.admit_msg(msg)
        if isinstance(checked, Rejected):
            raise checked
        metadata = msg.metadata
        event = await self._bind(checked)
        return Delivery(event, msg.subject, metadata.sequence.stream, metadata.num_delivered, metadata.timestamp)


def forgets_in(deliveries: Sequence[Delivery]) -> list[tuple[Envelope, int]]:
    """The admitted `forgotten` events among `deliveries`, with their stream sequences: what
    ForgottenArtifacts.read finds by asking the stream, for a path that has read a whole project itself (an
    agent's fold, which the broker lets read only its own projects' subjects)."""
    return [
        (d.event, d.stream_seq)
        for d in sorted(deliveries, key=lambda d: d.stream_seq)
        if (address := parse_event_subject(d.subject)) is not None and address.kind == "forgotten"
    ]


class ForgottenArtifacts:
    """What the stream's `forgotten` events recorded of the artifacts a batch refers to. A path that reads
    the stream after a forget erased an artifact's messages asks this, so links to that artifact (contradicted
    by it, superseding it) are decided as the live nodes decided them. Forgotten events are admitted like any
    other message: a forged one records nothing."""

    def __init__(self, js: JetStreamContext, admission: Admission) -> None:
        self._js = js
        self._admission = admission
        # (project, artifact_id) -> (messages on its `forgotten` subject when read, the admitted forgets there)
        self._forgets: dict[tuple[str, str], tuple[int, tuple[tuple[Envelope, int], ...]]] = {}

    async def read(self, deliveries: Sequence[Delivery]) -> list[tuple[Envelope, int]]:
        """Every admitted forget of the batch's projects, with its stream sequence. Raises Unavailable."""
        found: list[tuple[Envelope, int]] = []
        for project in sorted({d.event.project for d in deliveries}):
            # Every forget of the project, not only those the batch links to: an erased event's id stays
            # taken whatever artifact a later message under it names.
            for subject, count in sorted((await self._forget_subjects(project)).items()):
                found += await self._forgets_on(project, subject, count)
        return found

    @staticmethod
    def records(forgets: Sequence[tuple[Envelope, int]], authority: Authority) -> ErasedMap:
        """What the forgets their actors were allowed to make recorded (`erasure.erased_record`): a forget every
        path rejects erased nothing. `authority` must hold every enrolment record before the forgets."""
        found: dict[tuple[str, str], tuple[ErasedRecord, ...]] = {}
        for event, seq in sorted(forgets, key=lambda f: f[1]):
            record = erased_record(event, seq, authority)
            if record is not None:
                key = (event.project, event.artifact_id)
                found[key] = (*found.get(key, ()), record)
        return found

    async def _forget_subjects(self, project: str) -> dict[str, int]:
        async with nats_call(f"forgotten artifacts of {project}"):
            info = await self._js.stream_info(STREAM, subjects_filter=events_filter(project, "forgotten"))
        return dict(info.state.subjects or {})

    async def _forgets_on(self, project: str, subject: str, count: int) -> tuple[tuple[Envelope, int], ...]:
        """Every admitted forget on one artifact's `forgotten` subject, in stream order (an artifact id can be
        claimed again after a forget, and forgotten again)."""
        key = (project, subject.rsplit(".", 1)[1])
        cached = self._forgets.get(key)
        if cached is not None and cached[0] == count:
            return cached[1]
        forgets: list[tuple[Envelope, int]] = []
        seq = 1
        for _ in range(count):
            try:
                async with asyncio.timeout(JS_TIMEOUT_S):
                    msg = await self._js.get_msg(STREAM, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                break
            except NATS_OR_API_ERROR as e:
                raise Unavailable("nats", f"the forgets on {subject}: {type(e).__name__} {e}") from e
            if msg.seq is None or msg.data is None or msg.time is None:
                break
            seq = msg.seq + 1
            try:
                event = await self._admission.admit(subject, msg.data, msg.time, msg.headers)
            except Rejected:
                continue  # dead-lettered wherever it was read: it forgot nothing
            forgets.append((event, msg.seq))
        self._forgets[key] = (count, tuple(forgets))
        return tuple(forgets)


class EnrolmentLog:
    """The stream's enrolment records (`epi.epibus.enrolment.*`), each admitted like any message and kept only
    if it is a valid record (`bus.authority.enrolment_record`). Read on from where the last read stopped: a
    record is never erased, and one stored before an event is in the stream whenever that event is read."""

    def __init__(self, js: JetStreamContext, admission: Admission) -> None:
        self._js = js
        self._admission = admission
        self._records: list[tuple[int, Enrolment]] = []
        self._seen: set[str] = set()  # event ids read: a record resent later is a repeat, never a new record
        self._next_seq = 1
        self._authority = NO_RECORDS

    async def read(self) -> Authority:
        """Every record up to now. Raises Unavailable."""
        read = False
        while True:
            try:
                async with asyncio.timeout(JS_TIMEOUT_S):
                    msg = await self._js.get_msg(STREAM, seq=self._next_seq, subject=ENROLMENTS_FILTER, next=True)
            except nats.js.errors.NotFoundError:
                break
            except NATS_OR_API_ERROR as e:
                raise Unavailable("nats", f"enrolment records: {type(e).__name__} {e}") from e
            if msg.seq is None or msg.data is None or msg.time is None or msg.subject is None:
                break
            await self._take(msg.seq, msg.subject, msg.data, msg.time, msg.headers)
            read = True
        if read:
            self._authority = Authority.of(self._records)
        return self._authority

    async def read_filtered(self) -> Authority:
        """Every record up to now, read through a consumer filtered to the records: the read an agent may make
        (the broker refuses it message gets by sequence). Raises Unavailable."""
        from bus.reader import read_stream  # the reader admits through this module: imported when used

        read = False
        async for batch in read_stream(self._js, STREAM, filter_subject=ENROLMENTS_FILTER, start_seq=self._next_seq):
            for msg in batch:
                await self._take(
                    msg.metadata.sequence.stream, msg.subject, msg.data, msg.metadata.timestamp, msg.headers
                )
                read = True
        if read:
            self._authority = Authority.of(self._records)
        return self._authority

    async def _take(
        self, seq: int, subject: str, data: bytes, stream_time: datetime, headers: Mapping[str, str] | None
    ) -> None:
        try:
            event: Envelope | None = await self._admission.admit(subject, data, stream_time, headers)
        except Rejected:
            event = None  # dead-lettered wherever it was read: it enrols nobody
        if event is not None and str(event.event_id) not in self._seen:
            self._seen.add(str(event.event_id))
            record = enrolment_record(event)
            if record is not None:
                self._records.append((seq, record))
        self._next_seq = seq + 1


class BatchContext:
    """What deciding a batch needs from the rest of the stream, attached to each delivery the same way on
    every path: the records of erased artifacts and the enrolment records in force."""

    def __init__(self, js: JetStreamContext, admission: Admission) -> None:
        self.forgotten = ForgottenArtifacts(js, admission)
        self.enrolments = EnrolmentLog(js, admission)

    async def read(self, deliveries: Sequence[Delivery]) -> tuple[ErasedMap, Authority]:
        """Raises Unavailable. The enrolment records are read after the batch and its forgets, so none that
        comes before them in the stream is missed."""
        forgets = await self.forgotten.read(deliveries)
        authority = await self.enrolments.read()
        return ForgottenArtifacts.records(forgets, authority), authority

    async def attach(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Raises Unavailable."""
        erased, authority = await self.read(deliveries)
        return [replace(d, erased=erased, authority=authority) for d in deliveries]
