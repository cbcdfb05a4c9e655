"""The event envelope, the body model of every kind, the kind registry and canonical JSON.

Events are frozen pydantic models with extra="forbid". Bodies are chosen by `kind` through the registry, so
custom kinds can be added with `register_kind` and an unregistered kind is an InvalidEvent."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticSerializationError

from bus.errors import ConfigError, InvalidEvent
from bus.ids import new_event_id
from bus.subjects import ARTIFACT_PATTERN, KIND_PATTERN, PROJECT_PATTERN
from bus.vocab import EpistemicSource, EvidenceKind, Lifecycle, ResolutionKind, Reversibility, Trust

# An encoded, signed event may not exceed 64 KiB: large enough for a long post-mortem, small enough that a
# flood of them cannot exhaust a node (nats-server's own max_payload is 1 MiB).
MAX_EVENT_BYTES = 64 * 1024
# 2: the body is the event as sent and its signature travels in headers (bus.signing.seal). 1 (legacy): the
# signature is a member of the body and covers the canonical JSON of the rest; still admitted, never made.
SCHEMA_VERSION: Literal[2] = 2
LEGACY_SCHEMA_VERSION: Literal[1] = 1

Text = Annotated[str, StringConstraints(min_length=1, max_length=16_000)]
ShortText = Annotated[str, StringConstraints(min_length=1, max_length=200)]
# Numbers, flags and times are never coerced (true is not 1, "0.5" is not 0.5, 1700000000 is not a time):
# an event has one encoding, and bytes that differ from it are refused rather than read as the same event.
Unit = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, strict=True)]
Count = Annotated[int, Field(ge=1, strict=True)]
Flag = Annotated[bool, Field(strict=True)]


def _no_number_as_time(value: Any) -> Any:
    if isinstance(value, int | float):
        raise ValueError("must be an ISO 8601 time with its offset, not a number")
    return value


Timestamp = Annotated[AwareDatetime, BeforeValidator(_no_number_as_time)]


def _not_a_flag(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is a flag, not the number 1")
    return value


ProjectSlug = Annotated[str, StringConstraints(pattern=PROJECT_PATTERN.pattern)]
ArtifactId = Annotated[str, StringConstraints(pattern=ARTIFACT_PATTERN.pattern)]
AGENT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
AgentId = Annotated[str, StringConstraints(pattern=AGENT_PATTERN.pattern)]
PublicKey = Annotated[str, StringConstraints(pattern=r"^U[A-Z2-7]{55}$")]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evidence(Model):
    kind: EvidenceKind
    ref: Annotated[str, StringConstraints(min_length=1, max_length=2_000)]
    excerpt: Annotated[str, StringConstraints(max_length=4_000)] | None = None
    sha256: Sha256 | None = None


class Body(Model):
    """Base of every body. Subclasses set `kind` and say whether they act on an existing artifact."""

    kind: ClassVar[str]
    transition: ClassVar[bool] = False
    # True for records a subsystem writes about itself (the mesh's task steps): they are not claims, so no
    # hand-publishing command and no tombstone check.
    system_record: ClassVar[bool] = False

    def content_text(self) -> str:
        """The claim in words: what is embedded, hashed for tombstones, shown in a table."""
        return " ".join(str(v) for v in self.model_dump(mode="json").values() if isinstance(v, str))


IMPACT = "How much it matters, from 0 (not at all) to 1 (decisive)."
CONFIDENCE = "How sure, from 0 to 1; 0.8 or more on intuition alone is flagged as unearned."


class FindingBody(Body):
    """What was found to be true, how much it matters (impact) and how sure (confidence), with its evidence."""

    kind: ClassVar[str] = "finding"
    text: Text = Field(description="What was found, in a few sentences.")
    impact: Unit = Field(description=IMPACT)
    confidence: Unit = Field(description=CONFIDENCE)
    subject: ShortText = Field(description="What it is about, in a few words (a component, a topic).")
    evidence: tuple[Evidence, ...] = Field(default=(), description="Pointers to what shows it.")
    revises: ArtifactId | None = Field(default=None, description="The finding this one corrects or refines.")
    supersedes: ArtifactId | None = Field(default=None, description="The claim this one replaces (it is resolved).")

    def content_text(self) -> str:
        return self.text


class UnknownBody(Body):
    """An open question worth handing over: what is not known yet, and how much it matters."""

    kind: ClassVar[str] = "unknown"
    question: Text = Field(description="The open question.")
    impact: Unit = Field(description=IMPACT)

    def content_text(self) -> str:
        return self.question


class MistakeBody(Body):
    """A mistake made: what it was, why it was wrong, its cost, its root cause and how to prevent it."""

    kind: ClassVar[str] = "mistake"
    mistake: Text = Field(description="What was done wrong.")
    why_wrong: Text = Field(description="Why it was wrong.")
    cost_estimate: ShortText = Field(description="What it cost, in a few words (time, data, money).")
    root_cause: Text = Field(description="Why it happened.")
    prevention: Text = Field(description="What stops it from happening again.")


class DecisionBody(Body):
    """A choice made, the alternatives weighed and the rationale, and how hard it is to undo."""

    kind: ClassVar[str] = "decision"
    choice: Text = Field(description="What was decided.")
    alternatives: tuple[ShortText, ...] = Field(default=(), description="The options not taken.")
    rationale: Text = Field(description="Why this choice (required).")
    confidence: Unit = Field(description=CONFIDENCE)
    reversibility: Reversibility


class AssumptionBody(Body):
    """Something taken as true without checking it, and how confident that is."""

    kind: ClassVar[str] = "assumption"
    text: Text = Field(description="What is taken as true.")
    confidence: Unit = Field(description=CONFIDENCE)

    def content_text(self) -> str:
        return self.text


class DeadEndBody(Body):
    """An approach that was tried and failed, and why: so nobody tries it again blindly."""

    kind: ClassVar[str] = "dead_end"
    approach: Text = Field(description="What was tried.")
    why_failed: Text = Field(description="Why it did not work.")


class ResolvedBody(Body):
    kind: ClassVar[str] = "resolved"
    transition: ClassVar[bool] = True
    resolution: ResolutionKind
    superseded_by: ArtifactId | None = None
    note: Text | None = None

    @model_validator(mode="after")
    def _successor_iff_superseded(self) -> ResolvedBody:
        if self.resolution is ResolutionKind.superseded and self.superseded_by is None:
            raise ValueError("resolution 'superseded' requires superseded_by (the replacing artifact id)")
        if self.resolution is not ResolutionKind.superseded and self.superseded_by is not None:
            raise ValueError(f"superseded_by is only allowed with resolution 'superseded', not {self.resolution}")
        return self


class VerifiedBody(Body):
    kind: ClassVar[str] = "verified"
    transition: ClassVar[bool] = True
    note: Text | None = None
    evidence: tuple[Evidence, ...] = ()


class ContradictedBody(Body):
    kind: ClassVar[str] = "contradicted"
    transition: ClassVar[bool] = True
    contradicted_by: ArtifactId
    reason: Text


class RolledBackBody(Body):
    kind: ClassVar[str] = "rolled_back"
    transition: ClassVar[bool] = True
    reason: Text


class ErasedState(Model):
    """What a forgotten artifact was from stream sequence `seq` on, without its content. A `forgotten` event
    carries the artifact's states, so a path that reads the stream after the artifact's messages were erased
    decides what other events did with it (contradicted by it, superseding it) exactly as live nodes did."""

    seq: Count
    kind: Annotated[str, StringConstraints(pattern=KIND_PATTERN.pattern)]
    author: AgentId
    created_event_id: uuid.UUID
    created_at: Timestamp
    impact: Unit | None = None
    confidence: Unit | None = None
    revises: ArtifactId | None = None
    supersedes: ArtifactId | None = None
    superseded_by: ArtifactId | None = None
    contradicted_by: ArtifactId | None = None
    trust: Trust
    lifecycle: Lifecycle
    resolution: ResolutionKind | None = None
    forgotten: Flag = False  # from `seq` on the artifact was gone (an earlier forget of the same id)


class ErasedEvent(Model):
    """An event the forget erases from the stream, by id and digest: its id stays taken on every path."""

    event_id: uuid.UUID
    digest: Sha256


class ForgottenBody(Body):
    kind: ClassVar[str] = "forgotten"
    transition: ClassVar[bool] = True
    reason: Text
    history: tuple[ErasedState, ...] = ()  # the artifact's states in stream order, content left out
    events: tuple[ErasedEvent, ...] = ()  # the artifact's events the forget erases


@dataclass(frozen=True)
class KindSpec:
    name: str
    body: type[Body]

    @property
    def transition(self) -> bool:
        return self.body.transition


_KINDS: dict[str, KindSpec] = {}


def register_kind(body: type[Body], *, name: str | None = None) -> KindSpec:
    """Register a body model under its kind name. Idempotent for the same model; a different model under a
    taken name raises ConfigError."""
    kind = name or body.kind
    if not KIND_PATTERN.fullmatch(kind):
        raise ConfigError("kind", f"{kind!r} must match {KIND_PATTERN.pattern}")
    if body.model_config.get("extra") != "forbid":
        raise ConfigError("kind", f"body model for {kind!r} must forbid extra keys (subclass bus.event.Body)")
    existing = _KINDS.get(kind)
    if existing is not None and existing.body is not body:
        raise ConfigError("kind", f"{kind!r} is already registered to {existing.body.__name__}")
    spec = KindSpec(kind, body)
    _KINDS[kind] = spec
    return spec


def kind_names() -> list[str]:
    return sorted(_KINDS)


def require_kind(kind: str) -> KindSpec:
    spec = _KINDS.get(kind)
    if spec is None:
        raise InvalidEvent("kind", repr(kind), allowed=kind_names())
    return spec


_BUILTIN_BODIES: tuple[type[Body], ...] = (
    FindingBody,
    UnknownBody,
    MistakeBody,
    DecisionBody,
    AssumptionBody,
    DeadEndBody,
    ResolvedBody,
    VerifiedBody,
    ContradictedBody,
    RolledBackBody,
    ForgottenBody,
)
for _body in _BUILTIN_BODIES:
    register_kind(_body)


class Actor(Model):
    agent_id: AgentId
    public_key: PublicKey


class Envelope(Model):
    event_id: uuid.UUID
    schema_version: Annotated[Literal[1, 2], BeforeValidator(_not_a_flag)] = SCHEMA_VERSION
    project: ProjectSlug
    kind: str
    artifact_id: ArtifactId
    actor: Actor
    session_id: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    goal_id: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    recorded_at: Timestamp
    valid_from: Timestamp | None = None
    valid_until: Timestamp | None = None
    source: EpistemicSource | None = None
    body: SerializeAsAny[Body]
    signature: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{86}$")] | None = None

    @field_validator("event_id")
    @classmethod
    def _uuid7(cls, value: uuid.UUID) -> uuid.UUID:
        if value.version != 7:
            raise ValueError(f"must be a UUIDv7, got version {value.version}")
        return value

    @field_validator("kind")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in _KINDS:
            raise ValueError(f"{value!r} not in {{{', '.join(kind_names())}}}")
        return value

    @field_validator("recorded_at", "valid_from", "valid_until")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        try:
            return value.astimezone(UTC)
        except OverflowError as e:  # e.g. 9999-12-31T23:59:59-23:59 is past datetime.max in UTC
            raise ValueError(f"{value.isoformat()} is out of range once converted to UTC") from e

    @field_validator("body", mode="before")
    @classmethod
    def _body_for_kind(cls, value: Any, info: ValidationInfo) -> Body:
        kind = info.data.get("kind")
        if kind is None:
            raise ValueError("cannot be validated without a valid kind")
        model = _KINDS[kind].body
        if isinstance(value, Body):
            if type(value) is not model:
                raise ValueError(f"{type(value).__name__} is not the body of kind {kind!r} ({model.__name__})")
            return value
        return model.model_validate(value)

    @model_validator(mode="after")
    def _valid_interval(self) -> Envelope:
        if self.valid_from and self.valid_until and self.valid_until < self.valid_from:
            raise ValueError("valid_until is before valid_from")
        return self

    @model_validator(mode="after")
    def _no_nul_characters(self) -> Envelope:
        # PostgreSQL cannot store NUL in text: one such event would stop every PostgreSQL journal for good.
        if envelope_holds_nul(self):
            raise ValueError("a text holds a NUL character (\\u0000); remove it")
        return self


def envelope_holds_nul(event: Envelope) -> bool:
    """Whether any text of the event (a key or a value) holds NUL. JSON escapes NUL as \\u0000 wherever it is,
    so its absence from the compact encoding (pydantic's, in Rust) proves there is none; only a hit pays for the
    exact walk. Custom bodies may serialise differently to JSON, so they always take the walk."""
    if type(event.body) in _BUILTIN_BODIES:
        try:
            encoded = event.__pydantic_serializer__.to_json(event)
        except PydanticSerializationError:  # e.g. a lone surrogate: the walk decides
            return _holds_nul(event.model_dump())
        if b"\\u0000" not in encoded:
            return False
    return _holds_nul(event.model_dump())


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_holds_nul(v) for v in value)
    return False


# json.dumps with these arguments builds this very encoder on every call; one instance gives the same bytes.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same object always gives the same bytes."""
    return _CANONICAL.encode(value).encode()


def canonical_event(event: Envelope) -> bytes:
    """The whole signed event as canonical JSON: what its digest covers, and what a journal keeps."""
    return canonical_json(event.model_dump(mode="json"))


def event_digest(event: Envelope) -> str:
    """sha256 of the whole signed event: two events under one event id are the same event only if equal."""
    return canonical_digest(canonical_event(event))


def canonical_digest(canonical: bytes) -> str:
    """`event_digest` of the event whose `canonical_event` these bytes are."""
    return hashlib.sha256(canonical).hexdigest()


def signing_payload(event: Envelope) -> bytes:
    """What a legacy (schema_version 1) signature covers: the canonical JSON of everything but the signature."""
    return canonical_json(event.model_dump(mode="json", exclude={"signature"}))


def encode_event(event: Envelope) -> bytes:
    """The message body: for schema_version 2 the event without its signature (which travels in headers), for
    a legacy event the event with it. Canonical JSON either way."""
    if event.schema_version == LEGACY_SCHEMA_VERSION:
        data = canonical_json(event.model_dump(mode="json"))
    else:
        data = canonical_json(event.model_dump(mode="json", exclude={"signature"}))
    if len(data) > MAX_EVENT_BYTES:
        raise InvalidEvent("event", f"is {len(data)} bytes encoded; the limit is {MAX_EVENT_BYTES}")
    return data


def raise_for_validation(error: ValidationError) -> InvalidEvent:
    """The first pydantic error as an InvalidEvent naming the field, the input and what is allowed."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "event"
    ctx = first.get("ctx") or {}
    got = first.get("input")
    shown = f"={got!r}" if not isinstance(got, dict | list) else ""
    if "expected" in ctx:
        return InvalidEvent(f"{field}{shown}", f"expected {ctx['expected']}")
    return InvalidEvent(f"{field}{shown}", str(first["msg"]).removeprefix("Value error, "))


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Parsers disagree on which of two equal keys wins: signed bytes must mean one event in every language.
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidEvent(f"event.{twice}", "appears twice in one object; send each key once")
    return found


def decode_event(data: bytes, *, legacy: bool = False) -> Envelope:
    """Parse and validate an encoded event. Raises InvalidEvent; never returns a partial event. `legacy`: the
    message is in the legacy format, where a missing schema_version means 1; otherwise it must be present."""
    if len(data) > MAX_EVENT_BYTES:
        raise InvalidEvent("event", f"is {len(data)} bytes; the limit is {MAX_EVENT_BYTES}")
    try:
        raw = json.loads(data, object_pairs_hook=_no_duplicate_keys)
    except InvalidEvent:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidEvent("event", f"is not JSON ({e})") from e
    except RecursionError as e:
        raise InvalidEvent("event", "is JSON nested too deeply to decode") from e
    except ValueError as e:  # e.g. an integer longer than Python's 4300-digit conversion limit
        raise InvalidEvent("event", f"holds a value JSON cannot decode here ({e})") from e
    if not isinstance(raw, dict):
        raise InvalidEvent("event", f"is a JSON {type(raw).__name__}, expected an object")
    if legacy:
        raw.setdefault("schema_version", LEGACY_SCHEMA_VERSION)
    elif "schema_version" not in raw:
        raise InvalidEvent("schema_version", f"is missing; every event states its schema version ({SCHEMA_VERSION})")
    return validate_event(raw)


def validate_event(raw: dict[str, Any]) -> Envelope:
    if "kind" in raw and isinstance(raw["kind"], str) and raw["kind"] not in _KINDS:
        raise InvalidEvent(f"kind={raw['kind']!r}", "unregistered kind", allowed=kind_names())
    try:
        return Envelope.model_validate(raw)
    except ValidationError as e:
        raise raise_for_validation(e) from e


def draft_event(
    kind: str,
    body: Body | dict[str, Any],
    *,
    project: str,
    actor: Actor,
    session_id: str,
    artifact_id: str | None = None,
    goal_id: str | None = None,
    source: EpistemicSource | str | None = None,
    valid_from: datetime | None = None,
    valid_until: datetime | None = None,
    event_id: uuid.UUID | None = None,
    recorded_at: datetime | None = None,
) -> Envelope:
    """A new, unsigned event. A new artifact gets its id from the event id; a transition must name one.
    `event_id` and `recorded_at` are for callers that rebuild one event on a retry (same id, same bytes)."""
    spec = require_kind(kind)
    if spec.transition and artifact_id is None:
        raise InvalidEvent("artifact_id", f"is required for transition kind {kind!r}")
    event_id = event_id or new_event_id()
    return validate_event(
        {
            "event_id": event_id,
            "project": project,
            "kind": kind,
            "artifact_id": artifact_id if artifact_id is not None else str(event_id),
            "actor": actor,
            "session_id": session_id,
            "goal_id": goal_id,
            "recorded_at": recorded_at or datetime.now(UTC),
            "valid_from": valid_from,
            "valid_until": valid_until,
            "source": source,
            "body": body,
        }
    )
