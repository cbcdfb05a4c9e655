"""Event ids (UUIDv7) and the one function that derives a Qdrant point id from an event id."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from uuid_utils.compat import uuid7

from bus.errors import AmbiguousId, InvalidEvent, NotFound

# Fixed forever: changing it orphans every point already written.
EPIBUS_NAMESPACE = uuid.UUID("6f1c3a52-9d4e-4b8a-9a57-2f0e8c1d7b33")


def new_event_id() -> uuid.UUID:
    """A UUIDv7 (RFC 9562) from uuid-utils: 48-bit Unix milliseconds, then a counter seeded at random each
    millisecond, so ids made by one process sort in creation order, then random bits."""
    return uuid7()


def parse_event_id(value: str, field: str) -> uuid.UUID:
    """An event (or mesh message) id as a person or an agent wrote it: a UUIDv7. Raises InvalidEvent naming
    `field` (the option or argument it came from)."""
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        raise InvalidEvent(f"{field}={value!r}", "is not a UUID") from None
    if parsed.version != 7:
        raise InvalidEvent(f"{field}={value!r}", f"must be a UUIDv7, got version {parsed.version}")
    return parsed


def event_id_time(event_id: uuid.UUID) -> datetime:
    """The creation time embedded in a UUIDv7."""
    if event_id.version != 7:
        raise ValueError(f"event_id {event_id} is UUID version {event_id.version}, expected 7")
    return datetime.fromtimestamp((event_id.int >> 80) / 1000, tz=UTC)


def point_id(event_id: uuid.UUID) -> uuid.UUID:
    """The Qdrant point id of an event. Writer, deleter, reconciler and tests all call this one function."""
    return uuid.uuid5(EPIBUS_NAMESPACE, str(event_id))


def derived_event_id(base: uuid.UUID, label: str) -> uuid.UUID:
    """A second UUIDv7 made from `base` deterministically: same time and counter bits, random bits from a
    hash of (base, label). For one message that makes two events, so a retry makes the same two ids."""
    if base.version != 7:
        raise ValueError(f"event id {base} is UUID version {base.version}, expected 7")
    digest = int.from_bytes(hashlib.sha256(f"{base}:{label}".encode()).digest()[:8], "big") & ((1 << 62) - 1)
    return uuid.UUID(int=(base.int >> 64 << 64) | (0b10 << 62) | digest)


# Id prefixes, as git takes commit prefixes: at least MIN_PREFIX hex digits; dashes are ignored, so a prefix
# copied with its dashes and one typed without them both match.
MIN_PREFIX = 4
SHOWN_MATCHES = 10
_PREFIX_CHARS = re.compile(r"^[0-9a-fA-F-]+$")
_CANONICAL = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def id_digits(value: str) -> str:
    """An id or prefix as the hex digits it is compared by: lowercase, no dashes."""
    return value.replace("-", "").lower()


def id_prefix(value: str) -> str | None:
    """The digits `value` abbreviates an id by, or None when it is to be taken as a whole id: a UUID written
    out in full, or anything that is not hex digits and dashes with at least MIN_PREFIX digits (an id chosen
    by hand, such as `cache-notes`)."""
    if _CANONICAL.fullmatch(value) or not _PREFIX_CHARS.fullmatch(value):
        return None
    digits = id_digits(value)
    return digits if len(digits) >= MIN_PREFIX else None


def only_match(value: str, field: str, matches: Sequence[str], *, what: str, where: str, hint: str) -> str:
    """The one id among `matches` (sorted, at most SHOWN_MATCHES + 1) that `value` abbreviates: itself when an
    id is exactly `value`. Raises NotFound naming the prefix and where it was looked for, AmbiguousId listing
    the matches."""
    if value in matches:
        return value
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFound(what, value, f"no {what} id {where} starts with it; {hint}")
    raise AmbiguousId(field, value, what, where, matches[:SHOWN_MATCHES], len(matches) > SHOWN_MATCHES)
