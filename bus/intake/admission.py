"""The one admission rule. Every path that takes events from the stream (the live runner, replay, verify's
repair, reindex, a second node catching up, the client's fold) admits a message with `Admission.admit`, so a
message is admitted by all of them or by none: bytes, subject, time, signature and the agent's registered key.
Each path then attaches to a batch what deciding it needs from the rest of the stream (bus/intake/batch_context.py).

What fails is `Rejected` with a reason from `DeadLetterReason`; the live runner dead-letters it, the other
paths report it. A registry that does not answer is `Unavailable`: retry later, never guess."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import ParamSpec, TypeVar

from nats.aio.msg import Msg

from bus.enrolment.registry import AgentRegistry
from bus.errors import ConfigError, Conflict, InvalidEvent
from bus.identity.signing import message_format, verify_message, verify_signature
from bus.model.authority import NO_RECORDS, Authority
from bus.model.erasure import ErasedMap
from bus.model.event import LEGACY_SCHEMA_VERSION, Envelope, canonical_digest, canonical_event, decode_event
from bus.model.state import IdUse, id_use
from bus.model.vocab import DeadLetterReason
from bus.subjects import (
    EVENT_KEY_HEADER,
    EVENT_SIGNATURE_HEADER,
    event_subject,
)

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
