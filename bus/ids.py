"""Event ids (UUIDv7) and the one function that derives a Qdrant point id from an event id."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from datetime import UTC, datetime

# Fixed forever: changing it orphans every point already written.
EPIBUS_NAMESPACE = uuid.UUID("6f1c3a52-9d4e-4b8a-9a57-2f0e8c1d7b33")

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_event_id() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then a 12-bit counter so ids made in one millisecond
    by this process still sort in creation order, then 62 random bits."""
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms, _counter = now_ms, int.from_bytes(os.urandom(2), "big") & 0x3FF
        else:
            _counter += 1
            if _counter > 0xFFF:  # counter exhausted: borrow the next millisecond
                _last_ms, _counter = _last_ms + 1, 0
        ms, counter = _last_ms, _counter
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | rand
    return uuid.UUID(int=value)


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
