"""The event envelope and its one encoding: canonical JSON, the digest and signing payload, encoding, strict
decoding and validation, and building a draft. Envelopes are frozen pydantic models with extra="forbid"; the
body of each kind is in bus/model/kinds.py."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    SerializeAsAny,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticSerializationError

from bus.errors import InvalidEvent, validation_message
from bus.model.fields import AgentId, ArtifactId, ProjectSlug, PublicKey, Timestamp, not_a_flag
from bus.model.ids import new_event_id
from bus.model.kinds import BUILTIN_BODIES, Body, Model, body_model, is_registered, kind_names, require_kind
from bus.model.vocab import EpistemicSource

# An encoded, signed event may not exceed 64 KiB: large enough for a long post-mortem, small enough that a
# flood of them cannot exhaust a node (nats-server's own max_payload is 1 MiB).
MAX_EVENT_BYTES = 64 * 1024
# 2: the body is the event as sent and its signature travels in headers (bus.identity.signing.seal). 1 (legacy): the
# signature is a member of the body and covers the canonical JSON of the rest; still admitted, never made.
SCHEMA_VERSION: Literal[2] = 2
LEGACY_SCHEMA_VERSION: Literal[1] = 1


class Actor(Model):
    agent_id: AgentId
    public_key: PublicKey


class Envelope(Model):
    event_id: uuid.UUID
    schema_version: Annotated[Literal[1, 2], BeforeValidator(not_a_flag)] = SCHEMA_VERSION
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
        if not is_registered(value):
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
        model = body_model(kind)
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
    if type(event.body) in BUILTIN_BODIES:
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


def invalid_event_of(error: ValidationError) -> InvalidEvent:
    """The first pydantic error as an InvalidEvent naming the field, the input and what is allowed."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "event"
    ctx = first.get("ctx") or {}
    got = first.get("input")
    shown = f"={got!r}" if not isinstance(got, dict | list) else ""
    if "expected" in ctx:
        return InvalidEvent(f"{field}{shown}", f"expected {ctx['expected']}")
    return InvalidEvent(f"{field}{shown}", validation_message(first))


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
    if "kind" in raw and isinstance(raw["kind"], str) and not is_registered(raw["kind"]):
        raise InvalidEvent(f"kind={raw['kind']!r}", "unregistered kind", allowed=kind_names())
    try:
        return Envelope.model_validate(raw)
    except ValidationError as e:
        raise invalid_event_of(e) from e


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
